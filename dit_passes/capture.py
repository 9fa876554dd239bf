"""Capture: trace a diffusers transformer into a flat, editable ATen GraphModule.

Contract (see DESIGN.md §1)
  requires: an ``nn.Module`` whose forward runs under ``torch.export.export(strict=False)`` with the
  given call (diffusers transformers do).
  guarantees: ``Captured.gm`` takes one positional tensor per tensor leaf of the call (names in
  ``input_names``), returns a flat tuple of tensors, holds parameters/buffers as attributes under their
  original paths (same tensor objects, no copy), and every ``call_function`` node carries
  ``meta["val"]`` and ``meta["dit_module_path"]``; the graph is functional (no in-place ops).

Non-tensor arguments (``return_dict``, ``joint_attention_kwargs=None``, QwenImage's ``img_shapes``,
Python ints/floats) are constants of the capture: they are part of :func:`signature_key`, so a call
with other constants captures again instead of reusing a graph that baked in the old ones.

Data-dependent Python (Lumina2 computes caption lengths with ``mask.sum(1).tolist()`` and builds its
shapes from them) cannot be traced symbolically. When export fails and an eager run shows such scalar
reads (``item`` / ``tolist`` / ``bool`` / ``int``) or data-dependent lengths (``nonzero``, boolean-mask
indexing, ``repeat_interleave`` with tensor repeats: Qwen-Image 2.1 expands its slot mask that way), capture
replays the eager values during tracing, so the graph is specialised on them: the values of the call's
non-floating tensors (masks) then join the signature (``Captured.value_leaves``), and the graph returns the
traced scalars as an extra output that is checked against the baked ones at every call
(:class:`ValueSpecializationError` if they differ). One-element integer tensors passed as sizes (``reshape(b, gh,
gw, ...)`` with HiDream's patch grid) are read the same way.

Function caches (``lru_cache``) that an export fills hold fake tensors, as do attributes a lazy forward adds while
traced: capture empties / deletes them after each export (:mod:`dit_passes.capture_caches`), so a fresh model
needs no eager call before its capture and runs eagerly after it.

Where export still fails inside a submodule, that submodule's class is captured as opaque eager calls
(:mod:`dit_passes.capture_opaque`, DESIGN.md section 1) and the rest of the model is exported around them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import re
import sys
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .capture_caches import trace_time_caches_dropped
from .capture_tensor_data import TensorDataTraced
from .capture_values import ScalarRecorder, ScalarReplay
from .infra.trace_templates import TraceTemplates
from .infra.facts import StateIO, facts_of
from .infra.pass_base import Refusal


class CaptureError(RuntimeError, Refusal):
    """torch.export could not trace the module with the given call."""


class ValueSpecializationError(CaptureError):
    """A graph specialised on data-dependent scalars was called with inputs that change them."""


@dataclasses.dataclass
class Captured:
    gm: fx.GraphModule
    input_names: List[str]            # one per graph placeholder, in order
    input_spec: pytree.TreeSpec        # spec of the flattened call kwargs
    leaf_is_tensor: List[bool]         # per flattened leaf of the call
    constants: List[Any]               # the non-tensor leaves (None where the leaf is a tensor)
    out_spec: pytree.TreeSpec          # structure of the model's return_dict=False output
    accepts_return_dict: bool
    seconds: float = 0.0
    # Set only for data-dependent models (see the module docstring): flattened-leaf indices of the
    # non-floating tensors whose values are part of the signature, and the scalars baked in.
    value_leaves: List[int] = dataclasses.field(default_factory=list)
    baked_scalars: List[Any] = dataclasses.field(default_factory=list)


def bind_call(model: torch.nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Turn a positional/keyword call into keywords of ``model.forward`` (clear error if it does not fit)."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{type(model).__name__}.forward{sig} does not accept this call: {e}. "
                        f"Pass the transformer's keyword arguments (e.g. hidden_states=..., timestep=...)") from e
    out = dict(bound.arguments)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in out:
            out.update(out.pop(name))
        elif p.kind is inspect.Parameter.VAR_POSITIONAL and name in out:
            if out[name]:
                raise TypeError(f"{type(model).__name__}.forward takes *{name}: pass those arguments by keyword")
            out.pop(name)
    return out


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, x.device.type, x.device.index)
    if isinstance(x, (int, float, bool, str, type(None))):
        return ("C", type(x).__name__, x)
    return ("C", type(x).__name__, repr(x))


def signature_key(kwargs: Dict[str, Any]) -> Tuple:
    """Hashable key of a call: shapes/dtypes/devices of tensors and the values of constants."""
    leaves, spec = pytree.tree_flatten(kwargs)
    return (str(spec), tuple(_leaf_key(x) for x in leaves))


def value_key(kwargs: Dict[str, Any], value_leaves: Sequence[int]) -> Tuple:
    """The values of the given tensor leaves (for graphs specialised on data-dependent scalars)."""
    leaves, _ = pytree.tree_flatten(kwargs)
    return tuple(tuple(leaves[i].detach().cpu().reshape(-1).tolist()) for i in value_leaves)


_DYNAMO_SEGMENT = re.compile(r"\['([^']*)'\]|\.([A-Za-z_0-9]+)|\[(\d+)\]")


def normalize_module_path(path: str) -> str:
    """Normalise a module path from nn_module_stack to dotted form.

    torch.export gives ``transformer_blocks.0.attn``; Dynamo gives forms like
    ``L['self'].transformer_blocks[0].attn`` or ``L['self'].__dict__['_modules']['transformer_blocks'].0``.
    """
    if not path or ("[" not in path and not path.startswith("L")):
        return path
    p = path
    for prefix in ("L['self']", "L__self__", "self"):
        if p.startswith(prefix):
            p = p[len(prefix):]
            break
    parts = []
    for m in _DYNAMO_SEGMENT.finditer(p):
        seg = m.group(1) or m.group(2) or m.group(3)
        if seg in ("__dict__", "_modules"):
            continue
        parts.append(seg)
    return ".".join(parts)


def innermost_module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_module_path(path)


def module_class_of(node: fx.Node, path: str) -> str:
    for p, cls in (node.meta.get("nn_module_stack") or {}).values():
        if normalize_module_path(p) == path:
            return cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return ""


def annotate_module_paths(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["dit_module_path"] = innermost_module_path(n)


class _CallWithConstants(torch.nn.Module):
    """Calls the model with the flat tensor leaves re-inserted among the constant leaves.

    Not registered as a parent of the model (``object.__setattr__``): the exported parameter names stay
    the model's own (``transformer_blocks.0...``), not ``model.transformer_blocks.0...``.
    """

    def __init__(self, model, spec, is_tensor, constants, force_return_dict_false):
        super().__init__()
        object.__setattr__(self, "_model", model)
        self._spec, self._is_tensor, self._constants = spec, is_tensor, constants
        self._force = force_return_dict_false
        self.replay_values: List[Any] | None = None  # set: trace with ScalarReplay, return (out, guard)

    def forward(self, *tensors):
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self._is_tensor, self._constants)]
        kw = pytree.tree_unflatten(leaves, self._spec)
        if self._force:
            kw["return_dict"] = False
        if self.replay_values is None:
            return self._model(**kw)
        replay = ScalarReplay(self.replay_values)  # fresh per trace: export may run forward twice
        with replay:
            out = self._model(**kw)
        if len(replay.sources) != len(self.replay_values):
            raise CaptureError(f"the traced model read {len(replay.sources)} tensor scalars, its eager run "
                               f"{len(self.replay_values)}: its control flow is not reproducible")
        guard = torch.stack([x.reshape(()).to(torch.float64) for x in replay.sources])
        return out, guard

    def record_scalars(self, tensors) -> List[Any]:
        """Run the model eagerly once and return the scalars it reads from tensors, in order."""
        rec = ScalarRecorder()
        with torch.no_grad(), rec:
            self.forward(*tensors)
        return rec.values


@contextlib.contextmanager
def _export_noise_quiet():
    """A failed export on torch 2.11 prints its whole partial graph to stderr, after a shape warning that pages the
    graph too ("Unable to find user code corresponding to {u0}"); capture turns that failure into its retries (value
    specialisation, opaque modules) or a CaptureError naming the cause, so what a failed attempt wrote to stderr is
    dropped. A successful export's stderr is passed on."""
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level, buffer = log.level, io.StringIO()
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buffer):
            yield
        sys.stderr.write(buffer.getvalue())
    finally:
        log.setLevel(level)


def _export_static(wrapper: "_CallWithConstants", tensors: tuple, why: str):
    """``torch.export`` of ``wrapper``, refused (CaptureError) if the graph still holds a data-dependent size.
    The model's function caches that the trace fills are emptied after it (:mod:`.capture_caches`: they would hold
    fake tensors, which break the next eager run, the value-specialised retry's included). ``x.data`` reads as ``x.detach()``
    (:mod:`.capture_tensor_data`: export does not record ``.data``, and fails on the fake constant it leaves)."""
    with torch.inference_mode(False), torch.no_grad(), trace_time_caches_dropped(wrapper._model), \
            _export_noise_quiet(), TensorDataTraced():
        ep = torch.export.export(wrapper, tensors, strict=False)
    dynamic = _data_dependent_shape(ep.graph_module)
    if dynamic is not None:
        raise CaptureError(f"the graph has data-dependent shapes{why} ({dynamic}); the passes need static ones")
    return ep


def _export_replayed(wrapper: "_CallWithConstants", tensors: tuple, error: BaseException,
                     scalars: List[Any] | None = None):
    """``(exported program, scalars)`` traced with the eager run's tensor scalars replayed (``scalars``, else
    recorded now); raises ``error`` (the static export's) when the eager run reads none."""
    if scalars is None:
        try:
            scalars = [] if any(x.is_meta for x in tensors) else wrapper.record_scalars(tensors)
        except Exception:  # noqa: BLE001 - the model does not even run eagerly: report the export error
            scalars = []
    if not scalars:
        raise error
    wrapper.replay_values = scalars
    return _export_static(wrapper, tensors, " even specialised on the call's values"), scalars


def _data_dependent_shape(gm: fx.GraphModule) -> str | None:
    """The first node whose shape holds an unbacked (data-dependent) size, described; None if there is none."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val.shape):
            where = n.meta.get("stack_trace", "").strip().splitlines()[-2:] if n.meta.get("stack_trace") else []
            at = f" at {' / '.join(w.strip() for w in where)}" if where else ""
            return f"node {n.name} {tuple(val.shape)}{at}"
    return None


def capture(model: torch.nn.Module, args: Sequence[Any] = (), kwargs: Dict[str, Any] | None = None,
            templates: TraceTemplates | None = None) -> Captured:
    """Trace ``model`` called with ``args`` / ``kwargs``; with ``templates``, reuse a graph traced from another
    instance of the same architecture and call (``infra.trace_templates``), else trace and remember it there."""
    import time

    t0 = time.perf_counter()
    kwargs = bind_call(model, args, kwargs or {})
    accepts_return_dict = "return_dict" in inspect.signature(model.forward).parameters
    if accepts_return_dict:
        kwargs = {k: v for k, v in kwargs.items() if k != "return_dict"}
    leaves, spec = pytree.tree_flatten(kwargs)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    if not any(is_tensor):
        raise CaptureError(f"the call to {type(model).__name__} has no tensor arguments: nothing to trace")
    constants = [None if t else x for t, x in zip(is_tensor, leaves)]
    input_names = [n for n, t in zip(_leaf_names(kwargs), is_tensor) if t]
    call = _Call(kwargs, leaves, spec, is_tensor, constants, input_names, accepts_return_dict)
    call_key = signature_key(kwargs)
    if templates is None:
        return _trace(model, call, t0)
    key = templates.key_of(model, call_key)
    values_of = lambda value_leaves: value_key(kwargs, value_leaves)  # noqa: E731
    hit = templates.lookup(model, key, values_of)
    if hit is None:
        with templates.exclusive(model, key, values_of) as hit:  # another process may be capturing it
            if hit is None:
                captured = _trace(model, call, t0)
                templates.store(model, key, value_key(kwargs, captured.value_leaves), captured.gm,
                                {"out_spec": captured.out_spec, "value_leaves": captured.value_leaves,
                                 "baked_scalars": captured.baked_scalars})
                return captured
    gm, fields = hit
    out_spec, value_leaves, scalars = fields["out_spec"], fields["value_leaves"], fields["baked_scalars"]
    if scalars:
        _install_scalar_guard(gm, model, out_spec.num_leaves, out_spec.num_leaves + 1, scalars)
    return Captured(gm, input_names, spec, is_tensor, constants, out_spec, accepts_return_dict,
                    time.perf_counter() - t0, value_leaves, scalars)


class _Call(NamedTuple):
    """A call bound to the model's forward keywords (``return_dict`` left out), flattened."""
    kwargs: Dict[str, Any]
    leaves: List[Any]
    spec: pytree.TreeSpec
    is_tensor: List[bool]
    constants: List[Any]
    input_names: List[str]
    accepts_return_dict: bool


def _trace(model: torch.nn.Module, call: _Call, t0: float) -> Captured:
    """torch.export of ``call``, post-processed into :class:`Captured` (see the module docstring)."""
    import time

    t_cpu0 = time.process_time()
    kwargs, leaves, spec, is_tensor, constants, input_names, accepts_return_dict = call
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def wrap(traced: torch.nn.Module) -> _CallWithConstants:
        wrapper = _CallWithConstants(traced, spec, is_tensor, constants, accepts_return_dict)
        # Parameters belong to the wrapped model; export reads them through the wrapper's forward, so make
        # them visible as the wrapper's own under the same names.
        for name, mod in traced.named_children():
            wrapper._modules[name] = mod
        for name, p in traced.named_parameters(recurse=False):
            wrapper._parameters[name] = p
        for name, b in traced.named_buffers(recurse=False):
            wrapper._buffers[name] = b
        return wrapper

    opaque_calls: List[Any] = []
    try:  # (a graph can trace with token counts read from the inputs' values: masks)
        ep, scalars = _export_static(wrapper := wrap(model), tensors, ""), []
    except Exception as e:  # noqa: BLE001
        try:  # data-dependent Python? retry specialised on the eager run's scalars
            ep, scalars = _export_replayed(wrapper, tensors, e)
        except Exception as first_error:  # noqa: BLE001
            e = first_error
            if not any(x.is_meta for x in tensors):  # a submodule that cannot be traced? run it eagerly
                from .capture_opaque import export_with_opaque_modules

                def attempt(traced, proxies):
                    wrapper = wrap(traced)
                    scalars = wrapper.record_scalars(tensors)  # the proxies record their outputs too
                    for proxy in proxies.values():
                        proxy.tracing = True
                    try:
                        return _export_static(wrapper, tensors, ""), []
                    except Exception as e:  # noqa: BLE001
                        if not scalars:
                            raise
                        return _export_replayed(wrapper, tensors, e, scalars)

                try:
                    (ep, scalars), opaque_calls = export_with_opaque_modules(model, e, attempt)
                except Exception as last:  # noqa: BLE001
                    e = last if isinstance(last, CaptureError) else e
            if not opaque_calls:
                raise CaptureError(f"torch.export could not trace {type(model).__name__}: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:400]}. Check that the call matches the model's "
                                   f"forward (tensor inputs, constant options) and that the model runs eagerly "
                                   f"with it") from e

    if _mutates(ep.graph_module.graph):
        # In-place writes into views (Lumina2 / Wan / CogVideoX build tensors with ``x[i, :n] = ...``)
        # hide dataflow from block discovery and from passes that move nodes: functionalise them
        # (``copy_`` -> ``slice_scatter``...). An empty table decomposes nothing, so linear and
        # attention stay whole.
        try:
            with torch.inference_mode(False), torch.no_grad():
                ep = ep.run_decompositions({})
        except Exception as e:  # noqa: BLE001
            raise CaptureError(f"could not functionalise the in-place ops of {type(model).__name__}'s graph: "
                               f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    gm = _unlifted_module(ep)
    out_spec = gm._out_spec if hasattr(gm, "_out_spec") else ep.call_spec.out_spec
    n_flat = out_spec.num_leaves
    if scalars:  # the wrapper returned (model output, guard): the user's output is child 0
        out_spec = out_spec.child(0) if hasattr(out_spec, "child") else out_spec.children_specs[0]
    _flatten_codegen(gm, input_names)
    _register_constants_as_buffers(gm)
    annotate_module_paths(gm)
    if opaque_calls:
        from .capture_opaque import install_opaque_modules
        install_opaque_modules(gm, opaque_calls)
    value_leaves: List[int] = []
    if scalars:
        value_leaves = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                        and not x.is_floating_point() and not x.is_complex()]
        _install_scalar_guard(gm, model, out_spec.num_leaves, n_flat, scalars)
    _log_capture(model, signature_key(kwargs), time.process_time() - t_cpu0)
    return Captured(gm, input_names, spec, is_tensor, constants, out_spec, accepts_return_dict,
                    time.perf_counter() - t0, value_leaves, scalars)


def _unlifted_module(ep) -> fx.GraphModule:
    """``ep.module()`` without its input guards where this torch can leave them out (``check_guards=False``, torch
    >= 2.9): _flatten_codegen drops the guard call and the input-check hook anyway, and generating the guard function
    plus the extra recompile of the whole graph cost ~0.3 s on FLUX.1-dev. The graph is the same either way."""
    if "check_guards" in inspect.signature(ep.module).parameters:
        return ep.module(check_guards=False)
    return ep.module()


def _log_capture(model: torch.nn.Module, call_key: Tuple, cpu_seconds: float) -> None:
    """``DIT_PASSES_CAPTURE_LOG=<file>``: one line per torch.export (pid, key hash, CPU s, class, test), to count how
    often a run captures one key across its processes."""
    import hashlib
    import os

    from .infra import env
    path = env.capture_log()
    if not path:
        return
    from .infra.trace_templates import module_fingerprint
    key = hashlib.sha256(repr((module_fingerprint(model), call_key)).encode()).hexdigest()[:16]
    test = env.current_test()
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\t{key}\t{cpu_seconds:.2f}\t{type(model).__name__}\t{test}\n")


def _mutates(graph: fx.Graph) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable for n in graph.nodes)


def _install_scalar_guard(gm: fx.GraphModule, model: torch.nn.Module, n_user: int, n_flat: int,
                          scalars: List[Any]) -> None:
    """The guard output (last) is checked at each call through CompiledDiT's state-io protocol."""

    if n_flat != n_user + 1:
        raise CaptureError(f"internal: expected {n_user} outputs and one guard, got {n_flat} outputs")
    expected = torch.tensor([float(v) for v in scalars], dtype=torch.float64)
    name = type(model).__name__

    def check(runtime: Any, vals: Sequence[torch.Tensor]) -> None:
        got = vals[0].detach().cpu()
        if not torch.equal(got, expected):
            raise ValueSpecializationError(
                f"{name}'s graph was specialised on data-dependent scalars {expected.tolist()} (item/tolist "
                f"in its forward), but this call computes {got.tolist()}; they depend on floating-point inputs, "
                f"which are not part of the signature. Run this model eagerly, or keep those inputs fixed")

    facts = facts_of(gm)
    facts.num_user_outputs = n_user
    facts.state_io.append(StateIO(inputs=lambda runtime: (), outputs=check, num_outputs=1))


def _leaf_names(kwargs: Dict[str, Any]) -> List[str]:
    """A readable name per flattened leaf: ``hidden_states``, ``img_shapes_0_1`` ..."""
    names: List[str] = []
    for k in kwargs:
        sub, _ = pytree.tree_flatten(kwargs[k])
        if len(sub) == 1 and pytree.tree_flatten(kwargs[k])[1].num_leaves == 1 and not isinstance(kwargs[k], (list, tuple, dict)):
            names.append(k)
        else:
            names.extend(f"{k}_{i}" for i in range(len(sub)))
    return names


def _flatten_codegen(gm: fx.GraphModule, input_names: List[str]) -> None:
    """Drop export's pytree codegen and input guards: plain positional tensors in, flat tuple out."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            g.erase_node(n)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    # export's unlifted module checks every call against the traced input tree (passes add inputs), and
    # wraps every call in hooks that register nn.Module-typed inputs with pytree (ours are all tensors):
    # drop them, so that a call is the graph's code and nothing else
    for hooks in (gm._forward_pre_hooks, gm._forward_hooks):
        for key, hook in list(hooks.items()):
            if (getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook"
                    or getattr(hook, "__qualname__", "").startswith("_create_stateful_graph_module.")):
                del hooks[key]
                gm._forward_pre_hooks_with_kwargs.pop(key, None)
                gm._forward_hooks_with_kwargs.pop(key, None)
                gm._forward_hooks_always_called.pop(key, None)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_names):
        raise CaptureError(f"export produced {len(placeholders)} inputs for {len(input_names)} tensor "
                           f"arguments; this call shape is not supported")
    for ph, name in zip(placeholders, input_names):
        ph.target = name
        ph.name = name
    g._codegen = fx.graph.CodeGen()
    out = g.output_node()
    flat = out.args[0]
    if not isinstance(flat, (list, tuple)):
        flat = (flat,)
    out.args = (tuple(flat),)
    gm.recompile()


def _register_constants_as_buffers(gm: fx.GraphModule) -> None:
    """Lifted tensor constants become non-persistent buffers, so ``.to(device)`` moves them too."""
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        owner_path, _, attr = n.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        val = getattr(owner, attr, None)
        if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter) \
                and attr not in owner._buffers:
            delattr(owner, attr)
            owner.register_buffer(attr, val, persistent=False)
