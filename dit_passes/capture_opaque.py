"""Opaque submodules: capture a model whose forward cannot be traced as a whole.

When ``torch.export`` fails inside a submodule's forward (HiDream's mixture-of-experts routes tokens on the host
with ``bincount().cpu().numpy()``), capture retries with that submodule, and every module of its class, captured
as one **opaque call**: a ``dit_passes::opaque_module`` custom-op node that runs the module eagerly. The rest of the
model is exported as usual, so the passes see and rewrite everything around it.

Contract
  finds: the innermost submodule of the model (not the model itself, nor a layer of ``torch.nn``) on the failing
  call stack of the export error; all modules of its class become opaque (same code, same failure); up to ``MAX_ROUNDS`` classes.
  requires: an opaque module's call takes tensors and constants (hashable Python values) and returns tensors,
  ``None`` or constants in a pytree (tensor, tuple, list, dict); it does not write into its inputs or its own
  buffers, and does not return its inputs (checked on the eager run, else CaptureError); its output shapes depend
  only on its input shapes, dtypes and constants (each signature seen in the eager run must give one output
  metadata, else CaptureError).
  guarantees: the graph holds ``opaque_module(tensors, handle) -> list[Tensor]`` (then ``getitem`` per output)
  with ``meta["val"]`` from the eager run and ``meta["dit_module_path"]`` the module's path; the module is
  registered in the graph module under its original path (its parameters move with ``.to()``), the same object as
  the model's (no copy). Running the op calls the module eagerly (contiguous outputs: the fake kernel says so).
  The op's fake kernel knows only the input signatures of the eager run: a pass that changes the shapes reaching
  it (sequence or tensor sharding) fails in shape propagation and refuses, since nothing proves that the module
  acts token by token. A pass that only moves nodes (caches, regional compile) works unchanged.

Graph before / after (one MoE feed-forward, in a block):
  before: export fails at ``ff_i.moe_infer``: ``.numpy() is not supported for tensor subclasses``
  after:  ``opaque = dit_passes.opaque_module([norm_out], 'double_stream_blocks.0.block.ff_i@3')``;
          ``ff_out = getitem(opaque, 0)``
"""
from __future__ import annotations

import copy
import itertools
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .capture import CaptureError

MAX_ROUNDS = 4  # module classes made opaque, one per failed export, before capture gives up

# Process-wide index from a graph's handle string to its OpaqueCall. Weak: each graph module holds its own calls
# (``gm.dit_opaque_calls``), so an entry lives exactly as long as a graph that can call it.
_CALLS: "weakref.WeakValueDictionary[str, OpaqueCall]" = weakref.WeakValueDictionary()
_HANDLE_NUMBERS = itertools.count()


class OpaqueContractError(CaptureError):
    """An opaque module breaks the contract above (mutation, aliasing, data-dependent outputs)."""


def _meta_key(tensors: Sequence[torch.Tensor]) -> Tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


class OpaqueCall:
    """One call signature (argument tree, constants) of one opaque module: the module, how to rebuild its call
    from the op's tensors, and the output metadata recorded eagerly per input signature."""

    def __init__(self, path: str, module: torch.nn.Module, in_spec: pytree.TreeSpec, constants: List[Any]):
        self.path, self.module, self.in_spec, self.constants = path, module, in_spec, constants
        self.handle = f"{path}@{next(_HANDLE_NUMBERS)}"
        self.out_spec: Optional[pytree.TreeSpec] = None
        self.out_constants: List[Any] = []  # per output leaf: None where it is a tensor
        self.out_meta: Dict[Tuple, List[Tuple[Tuple[int, ...], torch.dtype, torch.device]]] = {}
        _CALLS[self.handle] = self

    def _call_module(self, tensors: Sequence[torch.Tensor]) -> List[Any]:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        out_leaves, out_spec = pytree.tree_flatten(self.module(*args, **kwargs))
        return out_leaves, out_spec

    def record(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Eager run (before export): call the module, check the contract, remember the output metadata."""
        watched = list(tensors) + list(self.module.buffers())
        versions = [t._version for t in watched]
        out_leaves, out_spec = self._call_module(tensors)
        if any(t._version != v for t, v in zip(watched, versions)):
            raise OpaqueContractError(f"opaque module {self.path} ({type(self.module).__name__}) writes into its inputs or "
                               f"buffers: it cannot be captured as an opaque call")
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        outs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        if any(o.untyped_storage().data_ptr() in inputs for o in outs):
            raise OpaqueContractError(f"opaque module {self.path} ({type(self.module).__name__}) returns a view of its "
                               f"input: it cannot be captured as an opaque call")
        constants = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        meta = [(tuple(o.shape), o.dtype, o.device) for o in outs]
        key = _meta_key(tensors)
        if self.out_spec is None:
            self.out_spec, self.out_constants = out_spec, constants
        if out_spec != self.out_spec or constants != self.out_constants or self.out_meta.get(key, meta) != meta:
            raise OpaqueContractError(f"opaque module {self.path} ({type(self.module).__name__}) returned outputs of other "
                               f"structures or shapes for the same input shapes: its outputs are data-dependent")
        self.out_meta[key] = meta
        return pytree.tree_unflatten(out_leaves, out_spec)

    def run(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        out_leaves, _ = self._call_module(tensors)
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        outs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        expected = self.out_meta.get(_meta_key(tensors))
        if expected is not None and [(tuple(o.shape), o.dtype) for o in outs] != [m[:2] for m in expected]:
            raise RuntimeError(f"opaque module {self.path} ({type(self.module).__name__}) returned shapes "
                               f"{[tuple(o.shape) for o in outs]}, its captured call {[m[0] for m in expected]}: "
                               f"its output shapes depend on input values; run this model eagerly")
        # a custom op returns fresh, contiguous tensors (what its fake kernel promised)
        return [o.clone(memory_format=torch.contiguous_format)
                if o.untyped_storage().data_ptr() in inputs or not o.is_contiguous() else o for o in outs]

    def fake(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        meta = self.out_meta.get(_meta_key(tensors))
        if meta is None:
            raise RuntimeError(
                f"opaque module {self.path} ({type(self.module).__name__}, run eagerly: it cannot be traced) has "
                f"output shapes recorded only for inputs {sorted(self.out_meta)}, not for {_meta_key(tensors)}: "
                f"a rewrite that changes the shapes reaching it cannot be proven (nothing shows that it acts token "
                f"by token); leave this model unsharded")
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in meta]

    def unflatten_outputs(self, tensors: Sequence[Any]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if c is None else c for c in self.out_constants], self.out_spec)


_TENSOR = object()  # marks a tensor leaf among an OpaqueCall's constants


@torch.library.custom_op("dit_passes::opaque_module", mutates_args=())
def opaque_module(tensors: List[torch.Tensor], handle: str) -> List[torch.Tensor]:
    """Run the opaque module registered under ``handle`` eagerly on ``tensors`` (its flattened tensor arguments)."""
    return _CALLS[handle].run(tensors)


@opaque_module.register_fake
def _(tensors, handle):
    return _CALLS[handle].fake(tensors)


OPAQUE_MODULE_OP = torch.ops.dit_passes.opaque_module.default


def is_opaque_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is OPAQUE_MODULE_OP


class _OpaqueProxy(torch.nn.Module):
    """Stands in for an opaque module in the traced copy of the model: records eagerly, then traces as the op.

    The module is held outside ``_modules`` (``object.__setattr__``), so export lifts none of its parameters."""

    def __init__(self, path: str, module: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "inner", module)
        self.path = path
        self.calls: Dict[Tuple, OpaqueCall] = {}
        self.tracing = False

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        try:
            key = (str(spec), tuple((type(c), c) for c in constants if c is not _TENSOR))
            call = self.calls.get(key)
        except TypeError as e:  # an unhashable constant argument
            raise OpaqueContractError(f"opaque module {self.path} takes a non-tensor argument that is not a constant: "
                               f"{e}") from e
        if not self.tracing:
            if call is None:
                call = self.calls[key] = OpaqueCall(self.path, self.inner, spec, constants)
            with torch._C.DisableTorchFunction():  # capture's scalar recorder must not see the module's reads
                return call.record(tensors)
        if call is None or call.out_spec is None:
            raise OpaqueContractError(f"opaque module {self.path} is called during tracing with arguments its eager run "
                               f"did not pass: the model's control flow is not reproducible")
        return call.unflatten_outputs(opaque_module(tensors, call.handle))


def failing_module(model: torch.nn.Module, error: BaseException,
                   traced: Optional[torch.nn.Module] = None) -> Optional[Tuple[str, torch.nn.Module]]:
    """The innermost submodule of ``model`` (path, module) whose code is on the call stack where ``error`` was
    raised (the innermost exception of its chain that passed through one); None if only the model itself is.
    ``traced``: the copy of the model that raised it (its copied modules map to the model's by path)."""
    paths = {id(m): p for p, m in model.named_modules() if m is not model}
    if traced is not None:
        paths.update({id(m): p for p, m in traced.named_modules()
                      if m is not traced and not isinstance(m, _OpaqueProxy)})
    seen, found, e = set(), None, error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb, innermost = e.__traceback__, None
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            # torch's own layers (Linear, LayerNorm ...) fail on what they are given, not by their code: blame the
            # model code that called them
            if isinstance(owner, torch.nn.Module) and id(owner) in paths \
                    and not type(owner).__module__.startswith("torch."):
                innermost = paths[id(owner)]
            tb = tb.tb_next
        found = innermost or found
        e = e.__cause__ or e.__context__
    return None if found is None else (found, model.get_submodule(found))


def opaque_copy(model: torch.nn.Module, opaque: Dict[str, _OpaqueProxy]) -> torch.nn.Module:
    """A shallow copy of ``model`` whose modules on the paths to ``opaque`` are copies with the proxies in place
    (parameters, buffers and every other module shared); the caller's model is not touched."""
    root = copy.copy(model)
    root.__dict__["_modules"] = dict(model._modules)
    copies = {"": root}
    for path, proxy in sorted(opaque.items()):
        parent_path, _, name = path.rpartition(".")
        parts = parent_path.split(".") if parent_path else []
        for i in range(len(parts)):
            prefix, sub = ".".join(parts[:i]), ".".join(parts[:i + 1])
            if sub not in copies:
                parent = copies[prefix]
                child = copy.copy(parent._modules[parts[i]])
                child.__dict__["_modules"] = dict(child._modules)
                parent._modules[parts[i]] = copies[sub] = child
        copies[parent_path]._modules[name] = proxy
    return root


def opaque_paths(model: torch.nn.Module, classes: Sequence[type]) -> Dict[str, torch.nn.Module]:
    """The outermost modules of ``model`` whose class is one of ``classes``, by path."""
    found: Dict[str, torch.nn.Module] = {}
    for path, m in model.named_modules():
        if m is not model and type(m) in classes and not any(path.startswith(p + ".") for p in found):
            found[path] = m
    return found


def export_with_opaque_modules(model: torch.nn.Module, error: BaseException,
                               attempt: Callable[[torch.nn.Module, Dict[str, "_OpaqueProxy"]], Any]
                               ) -> Tuple[Any, List[OpaqueCall]]:
    """Retry capture with the failing submodules' classes opaque, one more class per failure. ``attempt(copy,
    proxies)`` exports the model copy (an eager run first: the proxies record), returning what capture needs.
    Raises the last export error when no submodule is to blame or after ``MAX_ROUNDS`` classes, and an
    ``OpaqueContractError`` at once (a module that breaks the contract stays unsupported)."""
    classes: List[type] = []
    traced: Optional[torch.nn.Module] = None
    while True:
        culprit = failing_module(model, error, traced)
        if culprit is None or type(culprit[1]) in classes or len(classes) >= MAX_ROUNDS:
            raise error
        classes.append(type(culprit[1]))
        proxies = {p: _OpaqueProxy(p, m) for p, m in opaque_paths(model, classes).items()}
        traced = opaque_copy(model, proxies)
        try:
            result = attempt(traced, proxies)
        except OpaqueContractError:
            raise
        except Exception as e:  # noqa: BLE001 - another class may be to blame: one more round
            error = e
            continue
        return result, [c for p in proxies.values() for c in p.calls.values()]


def install_opaque_modules(gm: fx.GraphModule, calls: List[OpaqueCall]) -> None:
    """Register each opaque module in ``gm`` under its path and keep its calls alive with the graph."""
    for call in calls:
        try:
            gm.get_submodule(call.path)
        except AttributeError:
            gm.add_submodule(call.path, call.module)
    gm.dit_opaque_calls = list(calls)
