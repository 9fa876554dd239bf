"""dit_passes as a torch.compile backend, and as an Inductor post-grad custom pass.

``torch.compile(model, backend=dit_passes.backend(passes=[...]))``: Dynamo captures the model, a
pre-dispatch trace lowers it to ATen (the level torch.export produces, so ``aten.linear`` and attention
stay whole and block discovery finds the same structure as ``compile_dit``), our passes run on that graph, and the
result goes to Inductor (``compiler="inductor"``), to AOTAutograd with no compiler (``compiler="aot_eager"``) or runs
as is (``compiler="eager"``; both for CPU tests).

State between calls, as in ``compile_dit``: the backend object holds one :class:`~dit_passes.infra.runtime.Runtime`
(``be.runtime``) that every graph it lowers shares. A cache pass makes its graph take the cache state as extra
inputs and return the next state as extra outputs (``facts.state_io``); the callable the backend hands Dynamo feeds
those from the runtime and keeps what comes back, so Dynamo sees the model's own inputs and outputs only.
``be.cache_context("uncond")``, ``be.new_generation()``, ``be.report("dbcache")``, ``be.cache_summary()`` act as
they do on a ``CompiledDiT``. One backend object per compiled model: two models compiled with one object would
share its runtime (their graphs keep separate cache states, but one context and one report per pass).

What Dynamo gives a backend, and what follows:

* One FX graph per frame it traced, the model's parameters lifted to graph inputs (one per call, not attributes).
  The passes that replace, concatenate, load or move weights cannot rewrite an input and are refused when the
  backend is built, naming ``compile_dit`` (which captures with ``torch.export``, weights as attributes): the
  quantization passes, ``FuseSiblingLinears``, ``LayerwiseOffload``, ``LoadQuantized``. The parallel passes are
  refused too: their collectives need every rank to lower the same graphs in the same order, and Dynamo decides
  recompiles per process. ``RegionalCompile`` is the compiler's job here (``compiler="inductor"``).
* A graph break splits the model into several graphs; each goes through the passes on its own, and a cache pass
  needs the whole block stack in one graph (it refuses a piece without blocks). ``torch.compile(...,
  fullgraph=True)`` makes a break an error that names its cause.
* Dynamo recompiles when a guard fails: a second resolution gives a new graph (or, from the second shape on, one
  graph with symbolic sizes, Dynamo's automatic dynamic shapes). The passes need concrete shapes (the cache keeps
  residuals of the block range's shape), so the backend lowers a graph once per concrete input shapes it is called
  with; each lowering has its own cache state, as ``compile_dit``'s one graph per signature does.
"""
from __future__ import annotations

import contextlib
import hashlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.fx as fx

from .capture import annotate_module_paths
from .infra.facts import facts_of
from .infra.graph_runner import GraphRunner
from .infra.pass_base import Pass, PassContext, PassError
from .infra.pass_manager import PassManager
from .infra.phases import Phase
from .infra.runtime import Runtime
from .passes.cleanup import Cleanup

COMPILERS = ("inductor", "aot_eager", "eager")

# Why the backend refuses the passes of a phase: Dynamo lifts the weights to graph inputs, and decides recompiles per
# process. Every such pass runs in compile_dit.
_REFUSED_PHASES = {
    Phase.SHARD_WEIGHTS: "shards the step over ranks: its collectives need every rank to lower the same graphs in the "
                         "same order, and Dynamo decides recompiles (guard failures) per process; it also slices "
                         "weights, which Dynamo passes as graph inputs",
    Phase.SHARD_SEQUENCE: "shards the step over ranks: its collectives need every rank to lower the same graphs in the "
                          "same order, and Dynamo decides recompiles (guard failures) per process",
    Phase.FUSE_LINEARS: "concatenates weights into new ones, and Dynamo passes the weights as graph inputs (no "
                        "linear would qualify: the pass would change nothing)",
    Phase.QUANTIZE: "replaces weights by quantized ones, and Dynamo passes the weights as graph inputs",
    Phase.LOAD_WEIGHTS: "loads weights into the graph, and Dynamo passes the weights as graph inputs",
    Phase.OFFLOAD: "moves weights off the device and loads them per block, and Dynamo passes the weights as graph "
                   "inputs",
    Phase.COMPILE: "compiles the blocks itself; under torch.compile the backend's compiler does that "
                   "(dit_passes.backend(..., compiler='inductor'))",
}


def refusal(p: Pass) -> Optional[str]:
    """Why the torch.compile backend cannot run pass ``p`` (None: it can)."""
    why = _REFUSED_PHASES.get(p.phase)
    if why is None and p.loads_weights:
        why = _REFUSED_PHASES[Phase.LOAD_WEIGHTS]
    return why


class DitBackend:
    """A torch.compile backend. ``runtime`` holds the passes' state between calls (the cache's buffers, the current
    cache context, the reports); ``graphs`` every ATen graph the passes rewrote, ``last_manager`` the last one's
    pass records."""

    def __init__(self, passes: Sequence[Pass] = (), compiler: str = "inductor", dump_dir: Optional[str] = None):
        if compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS} ('inductor', or 'aot_eager' / 'eager' to run the "
                             f"rewritten graph without Inductor), got {compiler!r}")
        self.passes = list(passes)
        PassManager(self.passes)  # validate now (types, ordering)
        refused = [(p, refusal(p)) for p in self.passes]
        refused = [f"{p.describe()}: {why}" for p, why in refused if why is not None]
        if refused:
            raise ValueError("dit_passes.backend cannot run " + "; ".join(refused) + ". Use "
                             "dit_passes.compile_dit(model, passes=[...]) (its torch_compile={...} compiles the "
                             "rewritten graph with Inductor) for these passes")
        self.compiler = compiler
        self.dump_dir = dump_dir
        self.runtime = Runtime()
        self.graphs: List[fx.GraphModule] = []
        self.last_manager: Optional[PassManager] = None
        # (Dynamo's frame, the call's tensor shapes) -> the graph id the passes' state is kept under: a recompile of
        # one frame (a static graph, then one with symbolic sizes) called at shapes seen before continues that
        # lowering's state, as compile_dit's one graph per signature does
        self._graph_ids: Dict[Any, int] = {}

    # -- Dynamo's entry point --------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable:
        from torch._guards import CompileContext
        compile_id = CompileContext.current_compile_id()
        return DynamoGraph(self, gm, None if compile_id is None else compile_id.frame_id)

    def lower(self, gm: fx.GraphModule, args: Sequence[Any], names: Sequence[Optional[str]],
              frame: Optional[int] = None) -> "LoweredStep":
        """Dynamo's graph of ``frame`` at the concrete shapes of ``args`` (its inputs' ``names``, None where the model
        names none): ATen, our passes, then the compiler (at its first run, when the state inputs exist)."""
        aten_gm = lower_to_aten(gm, list(args), names)
        annotate_module_paths(aten_gm)
        signature = (frame, tuple(_shape_key([a for a in args if isinstance(a, torch.Tensor)])))
        graph_id = self._graph_ids.setdefault(signature, len(self._graph_ids))
        dump = None if self.dump_dir is None else f"{self.dump_dir}/g{len(self.graphs)}"
        manager = PassManager([Cleanup(), *self.passes], dump_dir=dump)
        named = {n: a for n, a in zip(names, args) if n is not None}
        ctx = PassContext(example_inputs={"args": list(args), **named}, runtime=self.runtime, graph_id=graph_id,
                          frontend="dynamo")
        try:
            manager.run(aten_gm, ctx)
        except PassError as e:
            raise PassError(f"{e} [dit_passes.backend runs the passes on each graph Dynamo hands it, and a graph break "
                            f"hands them a part of the model: torch.compile(..., fullgraph=True) names the break; "
                            f"dit_passes.compile_dit captures the whole model with torch.export]") from e
        self.last_manager = manager
        self.graphs.append(aten_gm)
        return LoweredStep(aten_gm, self.compiler)

    # -- the caller's handle on the state, as on CompiledDiT ------------------------------------
    @contextlib.contextmanager
    def cache_context(self, name: str, **where: Any) -> Iterator[None]:
        """Select a named cache context for the calls inside (diffusers pipelines use "cond" / "uncond"); ``where``
        (diffusers' ``CacheContext`` fields) is accepted and unused, as on ``CompiledDiT``."""
        with self.runtime.in_context(name):
            yield

    def new_generation(self) -> None:
        """A new generation starts at the next call (serving: call between requests)."""
        self.runtime.new_generation()

    def report(self, name: str) -> Any:
        """The runtime report pass ``name`` registered (e.g. ``report("dbcache")``)."""
        return self.runtime.report(name)

    def cache_report(self) -> Any:
        """The residual-cache pass's report (the one with a per-generation ``summary``), or None."""
        return self.runtime.cache_report()

    def cache_summary(self, as_dict: bool = False):
        """Per generation: cached steps, residual diffs and their percentiles."""
        return self.runtime.cache_summary(as_dict, owner="this backend")

    @property
    def structure(self):
        """The structure of the last rewritten graph (as it was before a cache pass moved blocks into its branch)."""
        from .analysis.blocks import get_structure
        if not self.graphs:
            raise RuntimeError("the backend has compiled no graph yet: run the compiled model once")
        cut = facts_of(self.graphs[-1]).structure_at_cut
        return cut if cut is not None else get_structure(self.graphs[-1])

    def explain(self, print_output: bool = True) -> str:
        if self.last_manager is None:
            raise RuntimeError("the backend has compiled no graph yet: run the compiled model once")
        text = f"{len(self.graphs)} graph(s) lowered from Dynamo\n" + self.last_manager.explain()
        if print_output:
            print(text)
        return text


def _static(gm: fx.GraphModule) -> bool:
    """Whether every input of Dynamo's graph has concrete sizes (no symbolic size: one lowering serves it)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value")
        if isinstance(val, torch.Tensor):
            if not all(isinstance(s, int) for s in val.shape):
                return False
        elif not isinstance(val, (int, float, bool, type(None))) or isinstance(val, torch.SymInt):
            return False
    return True


def _shape_key(args: Sequence[Any]) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)


class DynamoGraph:
    """What the backend returns to Dynamo for one of its graphs: the graph lowered (and rewritten) once per concrete
    input shapes, each lowering run with the passes' state."""

    def __init__(self, owner: DitBackend, gm: fx.GraphModule, frame: Optional[int] = None):
        self.owner = owner
        self.gm = gm
        self.frame = frame
        self.static = _static(gm)
        inputs = gm.graph.find_nodes(op="placeholder")
        # read now: Dynamo drops its inputs' sources (meta "grapharg") once the backend returns
        self.names = [input_name(n) for n in inputs]
        positional = [n.name for n in inputs if _positional(n)]
        if positional:
            warnings.warn(f"dit_passes.backend: the model's forward takes *args and was called with positional "
                          f"arguments ({', '.join(positional)}): the passes find the timestep and the latents by "
                          f"name (without it a cache pass ignores the timestep, others refuse); call the compiled "
                          f"model with keyword arguments, as diffusers pipelines do", stacklevel=2)
        self.lowered: Dict[Any, LoweredStep] = {}

    def __call__(self, *args: Any) -> Any:
        key = None if self.static else _shape_key(args)
        step = self.lowered.get(key)
        if step is None:
            step = self.lowered[key] = self.owner.lower(self.gm, args, self.names, self.frame)
        outs = step.run(list(args), self.owner.runtime)
        self.owner.runtime.calls += 1
        return outs


class LoweredStep:
    """One rewritten ATen graph and how to call it: the state inputs / outputs its passes registered are fed from and
    returned to the runtime; the model's own outputs go back to Dynamo."""

    def __init__(self, gm: fx.GraphModule, compiler: str):
        self.gm = gm
        self.compiler = compiler
        facts = facts_of(gm)
        self.state_io = list(facts.state_io)
        self.inference_only = facts.inference_only
        self.num_user_outputs = facts.num_user_outputs
        self.runner: Optional[Callable] = GraphRunner(gm) if compiler == "eager" else None

    def _compile(self, args: List[Any]) -> None:
        """Both compilers go through AOTAutograd's ``aot_module_simplified``, which, given a GraphModule, returns a
        function of the unpacked arguments (its ``_boxed_call`` attribute is copied from the inner function)."""
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx
            self.runner = compile_fx(self.gm, args)
        else:
            from torch._dynamo.backends.debugging import aot_eager
            self.runner = aot_eager(self.gm, args)

    def run(self, args: List[Any], runtime: Runtime) -> List[Any]:
        for io in self.state_io:
            args.extend(io.inputs(runtime))
        # torch.cond's autograd rule re-traces both branches; a DiT step is inference anyway
        grad = torch.no_grad() if self.inference_only and torch.is_grad_enabled() else contextlib.nullcontext()
        with grad:
            if self.runner is None:
                self._compile(args)
            outs = self.runner(*args)
        outs = list(outs)
        if not self.state_io:
            return outs
        n_user = self.num_user_outputs if self.num_user_outputs is not None else len(outs)
        rest = outs[n_user:]
        for io in self.state_io:
            io.outputs(runtime, rest[:io.num_outputs])
            rest = rest[io.num_outputs:]
        return outs[:n_user]


def input_name(node: fx.Node) -> Optional[str]:
    """The model's own name for one of Dynamo's graph inputs: a keyword argument (``L['kwargs']['timestep']``, the
    ``**kwargs`` of a wrapped forward) or a named parameter of the traced frame (``L['timestep']``); None for
    weights, positional arguments of a ``*args`` wrapper and anything nested."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    base = getattr(source, "base", None)
    if isinstance(getattr(source, "index", None), str) and getattr(base, "is_varkw", False):
        return source.index
    name = getattr(source, "local_name", None)
    if name is not None and name != "self" and not source.is_varargs and not source.is_varkw:
        return name
    return None


def _positional(node: fx.Node) -> bool:
    """Whether a graph input is a positional argument that went through a ``*args`` wrapper (it has no name)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return getattr(getattr(source, "base", None), "is_varargs", False)


def lower_to_aten(gm: fx.GraphModule, example_inputs: List[Any],
                  names: Optional[Sequence[Optional[str]]] = None) -> fx.GraphModule:
    """Dynamo graph -> ATen graph at export's level (pre-dispatch: ``aten.linear`` and
    ``aten.scaled_dot_product_attention`` stay whole), keeping each node's ``nn_module_stack``. The inputs the model
    names (``names``, one per input, None where it has none: ``hidden_states``, ``timestep``, ...) keep them, as
    ``torch.export`` gives them: passes find the timestep and the latents by name."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args):
        return fx.Interpreter(gm).run(*args)

    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Trace in Dynamo's own fake mode (its shape env) when there is one, so no guard is created on unknown symbols;
    # at a call (real inputs) a fresh one, at the call's concrete shapes.
    mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    fakes = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fx_traceback.preserve_node_meta(), torch.no_grad(), mode:
        aten_gm = make_fx(run, pre_dispatch=True, tracing_mode="real")(*fakes)
    # make_fx keeps one placeholder per argument, in order
    taken = {n.name for n in aten_gm.graph.nodes}
    for ours, name in zip(aten_gm.graph.find_nodes(op="placeholder"), names or ()):
        if name is not None and name.isidentifier() and name not in taken:
            ours.target = name
            ours._rename(name)
            taken.add(name)
    aten_gm.recompile()
    return aten_gm


def backend(passes: Sequence[Pass] = (), compiler: str = "inductor", dump_dir: Optional[str] = None) -> DitBackend:
    """``torch.compile(model, backend=dit_passes.backend(passes=[...], compiler="inductor"))``; see the module's
    docstring for what Dynamo changes. Keep the object: its ``runtime`` holds the passes' state."""
    return DitBackend(passes, compiler, dump_dir)


def _pass_uuid(passes: Sequence[Pass]) -> str:
    desc = "|".join(p.describe() for p in passes)
    return hashlib.sha256(desc.encode()).hexdigest()


try:  # torch >= 2.6
    from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass
except Exception:  # noqa: BLE001
    _CustomGraphPass = object  # type: ignore[assignment,misc]


class InductorPostGradPass(_CustomGraphPass):  # type: ignore[misc,valid-type]
    """Our pass pipeline as ``torch._inductor.config.post_grad_custom_post_pass``.

    ``uuid()`` is a hash of the passes' descriptions, so Inductor's FX-graph cache keys on the pipeline.
    Post-grad graphs are decomposed (``mm`` instead of ``linear``): use passes that only need block
    structure here (e.g. analysis); weight-rewriting passes belong in ``compile_dit``.
    """

    def __init__(self, passes: Sequence[Pass] = ()):
        self.passes = list(passes)
        self.last_manager: Optional[PassManager] = None

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:
            raise RuntimeError("post-grad graph has no owning module")
        annotate_module_paths(gm)
        manager = PassManager(self.passes, verify=False)
        manager.run(gm, PassContext(frontend="inductor"))
        self.last_manager = manager

    def uuid(self) -> str:
        return _pass_uuid(self.passes)
