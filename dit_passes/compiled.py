"""CompiledDiT: the drop-in module ``compile_dit`` returns.

It holds the original transformer (for ``.config``, ``.dtype``, ``.to()``) and one lowered graph per
input signature. A call whose tensor shapes, dtypes, device or constant arguments differ from every
graph seen so far is captured and run through the passes again, so a graph is never reused for the
wrong shape (another resolution, a CFG batch of 2, another text length).

Per-request state lives in ``compiled.runtime`` (a :class:`Runtime`, one per instance): the current
cache context (``with compiled.cache_context("uncond"):`` as diffusers pipelines do), and whatever
state passes register (DBCache's cache state, collective counters). Two CompiledDiT instances never
share state.

Bounded graphs: at most ``max_graphs`` lowered graphs are kept (default :data:`DEFAULT_MAX_GRAPHS`); a new
signature beyond that evicts the least recently called one, with the state passes keep for it
(``Runtime.forget_graph``: the residual cache's buffers of that graph). An evicted signature called again is
lowered again, as at its first call. ``compiled.graph_stats`` counts lowerings and evictions (``explain()``
shows them), and a warning says when new signatures keep evicting (:class:`GraphStats`).

A graph runs the module as it was captured. When the original's submodules change after lowering (a LoRA adapter
loaded or unloaded, a submodule replaced), every graph is dropped and lowered again at its next call
(:func:`module_tree`, compared at each call; ``graph_stats.module_changes`` counts it). Changes inside a submodule
that keep its identity (a LoRA scale set in place, a weight tensor assigned anew) are not seen: lower again with
``set_passes(compiled.passes)``.

One caller at a time: the runtime holds per-call state (the cache context, the residual cache's pending slot),
so a second thread entering ``forward`` (or ``lower``, ``cache_context``, ``new_generation``) while a call or a
``cache_context`` block of another thread runs gets a RuntimeError naming the fix (one module per thread, or a
lock around whole generations) instead of a mixed cache state.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .capture import Captured, bind_call, capture, signature_key, value_key
from .infra.trace_templates import default_templates
from .analysis.blocks import get_structure
from .infra.facts import facts_of
from .infra.cuda_graph_step import FIX as CUDA_GRAPH_FIX
from .infra.cuda_graph_step import CudaGraphStep, CudaGraphUnavailable, conditional_capture_mode
from .infra.fx_sources import drop_module_sources, drop_sources_since, source_keys
from .infra.graph_runner import GraphRunner
from .infra.memory import MemoryReport, memory_report, onloaded_tensors
from .infra.pass_base import Pass, PassContext
from .infra.pass_manager import PassManager
from .infra.phases import Phase
from .infra.runtime import Runtime
from .infra.weight_source import as_weight_source, check_has_source, source_stand_ins
from .passes.cleanup import Cleanup
from .passes.load_weights import LoadWeights

logger = logging.getLogger("dit_passes")


def _warm_inductor_pool() -> None:
    """Start Inductor's compile-worker pool now: torch's ``maybe_warm_pool`` (``AsyncCompile.warm_pool`` where it is
    missing), which the Inductor backend itself calls only at its first compile, after the capture and the passes
    (18 s for FLUX.1-dev on the GPU host). Kernels Inductor compiles before the pool is ready are compiled one by one
    in this process. torch's own switches turn it off (``TORCH_WARM_POOL=0``, one compile thread, no Triton)."""
    try:
        from torch._inductor import async_compile
    except ImportError:  # a torch without Inductor: nothing to warm
        return
    warm = getattr(async_compile, "maybe_warm_pool", None)
    if warm is None:
        warm = getattr(getattr(async_compile, "AsyncCompile", None), "warm_pool", None)
    if warm is not None:
        warm()


@dataclasses.dataclass
class LoweredGraph:
    """One signature's graph plus how to feed it: extra inputs / outputs passes registered."""

    gm: fx.GraphModule
    captured: Captured
    manager: PassManager
    runner: Optional[Callable[..., Any]] = None  # torch.compile(gm) when asked for; None: run eagerly
    eager: Optional[GraphRunner] = None  # the eager path: gm's graph without FX's per-node overhead

    def __post_init__(self) -> None:
        if self.eager is None:
            self.eager = GraphRunner(self.gm)
        # The facts the call path needs, read once here: the guarded GraphFacts is for passes, and an outer
        # torch.compile cannot trace its __getattribute__ (it would fall back to eager for the whole call).
        facts = facts_of(self.gm)
        self.state_io = list(facts.state_io)
        self.inference_only = facts.inference_only
        self.num_user_outputs = facts.num_user_outputs

    def run(self, flat: List[torch.Tensor], runtime: Runtime) -> List[torch.Tensor]:
        args = list(flat)
        for io in self.state_io:
            args.extend(io.inputs(runtime))
        if self.runner is not None:
            run = self.runner
        elif torch.compiler.is_compiling():
            run = self.gm  # under an outer torch.compile: FX's plain forward, which Dynamo traces in one frame
        else:
            run = self.eager
        if self.inference_only and torch.is_grad_enabled():
            # torch.cond's autograd rule re-traces both branches with fake tensors, which a graph whose
            # weights are real attributes cannot satisfy; a DiT step is inference anyway
            with torch.no_grad():
                outs = run(*args)
        else:
            outs = run(*args)
        if not self.state_io:
            return list(outs)
        n_user = self.num_user_outputs if self.num_user_outputs is not None else len(outs)
        rest = outs[n_user:]
        for io in self.state_io:
            io.outputs(runtime, rest[:io.num_outputs])
            rest = rest[io.num_outputs:]
        return list(outs[:n_user])


# Lowered graphs a module keeps by default. A served pipeline lowers one graph per input signature: per resolution,
# CFG batch 1 or 2, text length; 8 holds e.g. 4 resolutions with and without a CFG batch. A graph shares the
# module's weights, so what it costs is its code, its compiled kernels and, with mode="reduce-overhead", its CUDA
# graph's static activations; a signature evicted and called again costs a new lowering (a capture and the passes:
# seconds), which a warning reports when it keeps happening.
DEFAULT_MAX_GRAPHS = 8


@dataclasses.dataclass
class GraphStats:
    """What the module's graph limit did (``compiled.graph_stats``): ``lowered`` graphs in all, ``evicted`` of them
    (least recently called first), ``graphs`` kept now of at most ``limit`` (None: no limit).

    The warning rule: new signatures keep evicting when more than ``limit`` of the last ``2 * limit`` lowerings
    each evicted a graph. A single new resolution evicts once and stays quiet; a stream of signatures more
    numerous than the limit (each lowering past the first ``limit`` evicts) trips it after ``limit + 1``
    evictions, so the cost (a lowering per call where the graphs would have been reused) is reported while it is
    still small. Warned once per module; ``warned`` says whether it was."""

    limit: Optional[int]
    graphs: int = 0
    lowered: int = 0
    evicted: int = 0
    warned: bool = False
    recent: "collections.deque[bool]" = dataclasses.field(default_factory=collections.deque, repr=False)
    module_changes: int = 0  # times every graph was dropped because the module's submodules changed (a LoRA)

    def summary(self) -> str:
        limit = "no limit" if self.limit is None else f"limit {self.limit}"
        changed = f"; lowered again {self.module_changes}x after the module changed" if self.module_changes else ""
        return f"{self.graphs} graph(s) kept ({limit}); {self.lowered} lowered, {self.evicted} evicted{changed}"


def module_tree(root: torch.nn.Module) -> List[Any]:
    """Every submodule of ``root`` (and None where a slot holds None), breadth first: what a lowered graph was
    captured from. Compared by identity at each call (a few hundred list entries: ~0.1 ms for the digits DiT, where
    ``named_modules()`` takes twice that), so an adapter injected or removed after lowering (PEFT's LoRA layers
    replace the linears they wrap) is seen. The entries are the modules themselves, not their ids: a module freed
    and another allocated at its address cannot pass as unchanged."""
    out: List[Any] = [root]
    for module in out:
        if module is not None:
            out.extend(module._modules.values())
    return out


def _check_max_graphs(max_graphs: Optional[int]) -> Optional[int]:
    if max_graphs is None:
        return None
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(f"max_graphs must be a positive int (the lowered graphs a module keeps) or None for no "
                         f"limit, got {max_graphs!r}")
    return max_graphs


# what a second thread entering one compiled module is told to do
_ONE_CALLER = ("this CompiledDiT is running a call in another thread; its runtime holds per-call state (the cache "
               "context, the residual cache's state), so two threads cannot share it. Give each thread its own "
               "module (compile_dit / enable_cache on its own model or pipeline), or serialise whole generations "
               "with a lock around pipe(...)")


def _output_class():
    try:
        from diffusers.models.modeling_outputs import Transformer2DModelOutput
        return Transformer2DModelOutput
    except Exception:  # noqa: BLE001 - diffusers optional for plain modules
        return None


class CompiledDiT(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, passes: Sequence[Pass] = (), *, cleanup: bool = True,
                 dump_dir: Optional[str] = None, block_lists: Optional[List[str]] = None,
                 torch_compile: Optional[Dict[str, Any]] = None, keep_original: bool = False, weights: Any = None,
                 device: Union[str, torch.device, None] = None, max_graphs: Optional[int] = DEFAULT_MAX_GRAPHS):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"compile_dit expects an nn.Module (a diffusers transformer), got {type(model).__name__}")
        self.original = model
        # False: the weights a pass replaces leave ``model`` (meta tensors in their place, DESIGN.md §14)
        self.keep_original = bool(keep_original)
        self.graphs = torch.nn.ModuleDict()
        self.runtime = Runtime()
        # a model built on the meta device: its weights are read from this checkpoint while lowering, onto
        # ``device`` (default: the call's inputs' device); a sharding pass reads only its slice
        self.runtime.weights.source = as_weight_source(weights)
        self._device = None if device is None else torch.device(device)
        self._passes = list(passes)
        self._cleanup = cleanup
        self._dump_dir = dump_dir
        self._block_lists = block_lists
        if torch_compile is not None and not isinstance(torch_compile, dict):
            raise TypeError(f"torch_compile must be a dict of torch.compile keyword arguments (e.g. "
                            f"{{'mode': 'max-autotune-no-cudagraphs'}}), got {type(torch_compile).__name__}")
        self._regional = None  # torch_compile={"regional": True, ...}: a RegionalCompile pass, run after the others
        # torch_compile={"regional": True, "mode": "reduce-overhead"}: the blocks compiled by Inductor, the whole
        # step (top graph, regions, both cache arms) replayed as one CUDA graph (infra/cuda_graph_step.py)
        self._cuda_graphs = False
        self._graph_pool: Any = None
        if torch_compile is not None and torch_compile.get("regional"):
            from .passes.regional_compile import RegionalCompile
            if any(p.phase is Phase.COMPILE for p in passes if isinstance(p, Pass)):
                raise ValueError("torch_compile={'regional': True} adds passes.RegionalCompile; a compile-phase pass "
                                 "is in passes=[...] already: keep one")
            self._cuda_graphs = torch_compile.get("mode") == "reduce-overhead"
            self._regional = RegionalCompile(**{k: v for k, v in torch_compile.items()
                                                if k != "regional" and not (k == "mode" and self._cuda_graphs)})
            torch_compile = None
        elif torch_compile is not None:
            torch_compile = {k: v for k, v in torch_compile.items() if k != "regional"}
            if any(p.phase is Phase.COMPILE for p in passes if isinstance(p, Pass)):
                raise ValueError("passes.RegionalCompile compiles each block; torch_compile={...} would compile the "
                                 "whole graph on top of it: drop one (or use torch_compile={'regional': True, ...})")
        self._torch_compile = torch_compile
        self._pool_warmed = False  # Inductor's compile workers started at the first CUDA lowering (_warm_inductor_pool)
        # signature -> graph, least recently called first; with each graph its id (its name in self.graphs,
        # ctx.graph_id of its passes), never reused while the graphs live: an evicted graph's id is not taken again
        self._by_key: "collections.OrderedDict[Any, LoweredGraph]" = collections.OrderedDict()
        self._ids: Dict[int, Tuple[int, Any]] = {}  # id(LoweredGraph) -> (graph id, its signature's base key)
        self._next_id = 0
        self.graph_stats = GraphStats(_check_max_graphs(max_graphs))
        self._value_leaves: Dict[Any, List[int]] = {}  # signature -> leaves whose values key the graph
        self._last: Optional[LoweredGraph] = None
        self._tree: Optional[List[Any]] = None  # module_tree(model) when the graphs kept were lowered
        self._call_lock = threading.Lock()  # one caller at a time (the module docstring)
        self._caller: Optional[int] = None
        PassManager(self._passes)  # validate the pass list (types, ordering) now, not at the first call

    # -- the original's identity ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self._modules.get("original")
            if original is None:
                raise
            return getattr(original, name)

    @property
    def config(self):
        return self.original.config

    @property
    def dtype(self) -> torch.dtype:
        p = next(self.original.parameters(), None)
        return p.dtype if p is not None else torch.float32

    @property
    def device(self) -> torch.device:
        p = next((p for p in self.original.parameters() if not p.is_meta), None)  # meta: released weights
        return p.device if p is not None else torch.device("cpu")

    def _apply(self, fn, recurse=True):
        # ``.to(device)`` / ``.half()``: a released weight (meta, its values live in the graphs) takes the dtype
        # and stays where it is
        def apply(t: torch.Tensor) -> torch.Tensor:
            if not t.is_meta:
                return fn(t)
            try:
                return fn(t)
            except NotImplementedError:
                return t
        return super()._apply(apply, recurse)

    @property
    def released(self) -> Dict[str, str]:
        """``{weight path: how it was replaced}`` for the original's weights that passes replaced and that left
        it (meta tensors now); empty with ``keep_original=True``."""
        return {} if self.keep_original else self.runtime.weights.released_weights()

    @contextlib.contextmanager
    def cache_context(self, name: str, **where: Any) -> Iterator[None]:
        """Select a named cache context (diffusers pipelines use "cond" / "uncond"). ``where``: the fields diffusers'
        ``CacheContext`` takes (``step_index``, ``sigma``, ``num_inference_steps``: WanPipeline passes them) are
        accepted and unused: the cache passes count steps and generations themselves."""
        # the block is this thread's: another thread's call would read its context
        with self._one_caller(), self.runtime.in_context(name):
            yield

    def new_generation(self) -> None:
        with self._one_caller():  # resetting the state under another thread's call would mix two generations
            self.runtime.new_generation()

    @property
    def passes(self) -> List[Pass]:
        """The pass list every signature is lowered with (``compile_dit``'s, without the implicit Cleanup)."""
        return list(self._passes)

    def set_passes(self, passes: Sequence[Pass]) -> None:
        """Replace the pass list; every graph is lowered again at its next call. State passes keep in
        ``runtime.state`` (process groups, quantized weights) stays; state tied to the old graphs (the
        residual cache's buffers) is dropped."""
        PassManager(list(passes))  # validate now
        with self._one_caller():  # not under another thread's call
            self._passes = list(passes)
            self._forget_graphs()
            self.runtime.drop_lowering_state()

    def _forget_graphs(self) -> None:
        """Every signature is lowered again at its next call; ``runtime.state`` is left to the caller."""
        drop_module_sources(g.gm for g in self._by_key.values())
        self._by_key.clear()
        self._ids.clear()
        self._next_id = 0
        self._value_leaves.clear()
        self._last = None
        self._tree = None
        self.graph_stats.graphs = 0
        for name in list(self.graphs.keys()):
            del self.graphs[name]

    # -- the graph limit -----------------------------------------------------------------------
    @property
    def max_graphs(self) -> Optional[int]:
        """The most lowered graphs this module keeps (None: no limit); settable, e.g. on the module
        ``enable_cache`` put in the pipeline: ``pipe.transformer.max_graphs = 16``."""
        return self.graph_stats.limit

    @max_graphs.setter
    def max_graphs(self, value: Optional[int]) -> None:
        limit = _check_max_graphs(value)
        with self._one_caller():  # not under another thread's call
            self.graph_stats.limit = limit
            self._evict_beyond_limit(keep=None)

    def _evict_beyond_limit(self, keep: Optional[LoweredGraph]) -> int:
        """Evict the least recently called graphs (never ``keep``, the one just lowered) down to the limit, with
        the state passes keep for them; returns how many."""
        limit, evicted = self.graph_stats.limit, 0
        while limit is not None and len(self._by_key) > limit:
            key = next(k for k, g in self._by_key.items() if g is not keep)
            lowered = self._by_key.pop(key)
            gid, base = self._ids.pop(id(lowered))
            del self.graphs[f"g{gid}"]
            drop_module_sources([lowered.gm])
            self.runtime.forget_graph(gid)
            if self._last is lowered:
                self._last = None
            if base in self._value_leaves and all(b != base for _, b in self._ids.values()):
                del self._value_leaves[base]  # no graph of that signature left: its value leaves go too
            evicted += 1
        self.graph_stats.evicted += evicted
        self.graph_stats.graphs = len(self._by_key)
        return evicted

    def _record_lowering(self, lowered: LoweredGraph) -> None:
        stats = self.graph_stats
        stats.lowered += 1
        evicted = self._evict_beyond_limit(keep=lowered)
        if stats.limit is None:
            return
        stats.recent.append(evicted > 0)
        while len(stats.recent) > 2 * stats.limit:
            stats.recent.popleft()
        if not stats.warned and sum(stats.recent) > stats.limit:
            stats.warned = True
            warnings.warn(f"CompiledDiT({type(self.original).__name__}): new input signatures keep evicting lowered "
                          f"graphs: {sum(stats.recent)} of the last {len(stats.recent)} lowerings evicted one "
                          f"(max_graphs={stats.limit}; {stats.summary()}). Each evicted signature called again is "
                          f"captured and lowered again; raise max_graphs (compile_dit(..., max_graphs=N), or "
                          f"module.max_graphs = N) to hold every resolution / batch / text length served, or send "
                          f"fewer distinct shapes", RuntimeWarning, stacklevel=4)

    # -- what the passes report ----------------------------------------------------------------
    def report(self, name: str) -> Any:
        """The runtime report pass ``name`` registered (e.g. ``report("dbcache")``: the cache's decisions)."""
        return self.runtime.report(name)

    def cache_report(self) -> Any:
        """The report of the residual-cache pass (DBCache, FirstBlockCache, MagCache: the one report with a
        per-generation ``summary``), or None."""
        return self.runtime.cache_report()

    def cache_summary(self, as_dict: bool = False):
        """Per generation: cached steps, residual diffs and their percentiles (one device sync)."""
        return self.runtime.cache_summary(as_dict, owner="this CompiledDiT")

    def fidelity_stats(self) -> Dict[str, Any]:
        """What the passes' reports say about the last generation's work (for :mod:`dit_passes.fidelity`):
        the merged ``fidelity_stats()`` of every report that has one; ``{}`` if none does."""
        out: Dict[str, Any] = {}
        for report in self.runtime.reports.values():
            stats = getattr(report, "fidelity_stats", None)
            if stats is not None:
                out.update(stats())
        return out

    # -- lowering ------------------------------------------------------------------------------
    def lower(self, *args: Any, **kwargs: Any) -> LoweredGraph:
        """Capture + run the passes for this call's signature (done lazily by ``forward``)."""
        with self._one_caller():
            return self._lower(args, kwargs)

    def _lower(self, args: Any, kwargs: Any) -> LoweredGraph:
        kwargs = bind_call(self.original, args, kwargs)
        kwargs.pop("return_dict", None)
        base = signature_key(kwargs)
        # A data-dependent model's graph is specialised on its masks' values too (capture.value_key).
        value_leaves = self._value_leaves.get(base)
        key = base if value_leaves is None else (base, value_key(kwargs, value_leaves))
        if self._by_key and module_tree(self.original) != self._tree:
            self._module_changed()
        if key in self._by_key:
            self._by_key.move_to_end(key)  # the most recently called: evicted last
            return self._by_key[key]
        ledger = self.runtime.weights
        tensors = [x for x in pytree.tree_leaves(kwargs) if isinstance(x, torch.Tensor)]
        check_has_source(self.original, ledger.source, tensors)
        device = self._device or (tensors[0].device if tensors else torch.device("cpu"))
        if device.type == "cuda" and not self._pool_warmed and self._compiles_with_inductor():
            self._pool_warmed = True
            _warm_inductor_pool()  # its worker processes start while the capture and the passes run
        if self._cuda_graphs:  # refused before capturing
            if device.type != "cuda":
                raise CudaGraphUnavailable(f"torch_compile={{'regional': True, 'mode': 'reduce-overhead'}} replays the "
                                           f"step as a CUDA graph: the call's tensors are on {device}; run on a CUDA "
                                           f"device or {CUDA_GRAPH_FIX}")
            capture_mode = conditional_capture_mode()  # this torch / CUDA has conditional nodes
        sources = source_keys()  # FX's generated source kept from here on: only the kept graph's (infra/fx_sources.py)
        read: Dict[str, torch.Tensor] = {}  # what LoadWeights reads from the checkpoint: it goes into the model too
        passes = ([Cleanup()] if self._cleanup else []) + ([LoadWeights(read)] if ledger.source is not None else []) \
            + self._passes + ([self._regional] if self._regional else [])
        loaded = [t for p in passes for t in p.loads_weights]
        # weights released by an earlier lowering, and weights on the meta device that the checkpoint holds:
        # shape-only stand-ins while capturing and running the passes
        with ledger.stand_ins(self.original, loaded), source_stand_ins(self.original, ledger.source, device, read,
                                                                       ledger):
            captured = capture(self.original, (), kwargs, templates=default_templates())
            if captured.value_leaves:
                self._value_leaves[base] = captured.value_leaves
                key = (base, value_key(kwargs, captured.value_leaves))
            gm = captured.gm
            if self._block_lists:
                facts_of(gm).block_lists = self._block_lists
            graph_id = self._next_id
            dump = None if self._dump_dir is None else f"{self._dump_dir}/g{graph_id}"
            manager = PassManager(passes, dump_dir=dump)
            facts_of(gm).structure_summary = get_structure(gm).summary()  # also: not-a-DiT fails here
            ctx = PassContext(example_inputs=kwargs, runtime=self.runtime, graph_id=graph_id)
            # a pass may release each weight it replaced at once (ledger.release_now: quantization, one linear at
            # a time), so lowering a model in memory never holds the whole model and the whole result
            ledger.model = None if self.keep_original else self.original
            released_before = ledger.released_now
            try:
                manager.run(gm, ctx)
            except Exception as exc:
                released = ledger.released_now - released_before
                if released:
                    exc.add_note(f"dit_passes: this lowering had already released {released} weight(s) of the model "
                                 "(replaced as they were prepared, each held once): reload the model before using it "
                                 "again, or compile with keep_original=True")
                raise
            finally:
                ledger.model = None
            ledger.check_graph(gm, ", ".join(p.name for p in passes))
        if not self.keep_original:
            ledger.release_in(self.original)  # what the passes replaced leaves the user's module
        # each lowered graph is compiled on its own: the whole step, cache branch included, in one graph; one a pass
        # marked eager_only (few-shot observation, a few calls) runs eagerly, the next lowering is compiled
        eager_only = facts_of(gm).eager_only
        runner = None if self._torch_compile is None or eager_only else torch.compile(gm, **{"fullgraph": True,
                                                                                            **self._torch_compile})
        lowered = LoweredGraph(gm, captured, manager, runner)
        if self._cuda_graphs and not eager_only:
            lowered.runner = self._cuda_graph_step(lowered, capture_mode)
        self._next_id = graph_id + 1
        self.graphs[f"g{graph_id}"] = gm
        self._by_key[key] = lowered
        self._ids[id(lowered)] = (graph_id, base)
        self._record_lowering(lowered)
        self._tree = module_tree(self.original)
        drop_sources_since(sources, [gm])
        return lowered

    def _module_changed(self) -> None:
        """The original's submodules are not those the graphs were captured from (a LoRA adapter loaded or
        unloaded: ``pipe.load_lora_weights``, ``pipe.transformer.unload_lora()``; a submodule replaced): every graph
        runs the module as it was, so they are all dropped, with the state passes keep for them (as
        ``set_passes``), and each signature is lowered again at its next call. A generation under way when that
        happens starts its cache state again."""
        logger.info("CompiledDiT(%s): its submodules changed since its graphs were lowered (e.g. a LoRA adapter "
                    "loaded or unloaded); lowering them again", type(self.original).__name__)
        self._forget_graphs()
        self.runtime.drop_lowering_state()
        self.graph_stats.module_changes += 1

    def _compiles_with_inductor(self) -> bool:
        """Whether a lowered graph goes to Inductor: the whole graph (``torch_compile={...}``) or its blocks
        (``torch_compile={"regional": True}``, ``passes.RegionalCompile``), with the default backend."""
        from .passes.regional_compile import RegionalCompile
        kwargs = [self._torch_compile] if self._torch_compile is not None else []
        kwargs += [p.compile_kwargs for p in self._passes + [self._regional] if isinstance(p, RegionalCompile)]
        return any(k.get("backend", "inductor") == "inductor" for k in kwargs)

    def _cuda_graph_step(self, lowered: LoweredGraph, capture_mode: type) -> CudaGraphStep:
        """The lowered graph's eager runner, replayed as a CUDA graph (mode="reduce-overhead") with the conditional
        capture ``lower`` checked before capturing."""
        if self._graph_pool is None:  # one memory pool for every signature's graph: they never run at once
            self._graph_pool = torch.cuda.graph_pool_handle()
        return CudaGraphStep(lowered.eager, pool=self._graph_pool, capture_mode=capture_mode)

    @contextlib.contextmanager
    def _one_caller(self) -> Iterator[None]:
        """Refuse a second thread while a call runs (the module docstring); the same thread may re-enter."""
        me = threading.get_ident()
        if self._caller == me:
            yield
            return
        if not self._call_lock.acquire(blocking=False):
            raise RuntimeError(_ONE_CALLER)
        self._caller = me
        try:
            yield
        finally:
            self._caller = None
            self._call_lock.release()

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)  # a lock does not pickle or deep-copy: a copy gets its own
        state.pop("_call_lock", None)
        state["_caller"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._call_lock = threading.Lock()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # _one_caller spelled out: no generator on the per-call path
        me = threading.get_ident()
        if self._caller == me or torch.compiler.is_compiling():  # re-entered; traced by an outer torch.compile
            return self._forward(args, kwargs)
        if not self._call_lock.acquire(blocking=False):
            raise RuntimeError(_ONE_CALLER)
        self._caller = me
        try:
            return self._forward(args, kwargs)
        finally:
            self._caller = None
            self._call_lock.release()

    def _forward(self, args: Any, kwargs: Any) -> Any:
        kwargs = bind_call(self.original, args, kwargs)
        return_dict = kwargs.pop("return_dict", True)
        lowered = self._lower((), kwargs)
        self._last = lowered
        cap = lowered.captured
        leaves, _ = pytree.tree_flatten(kwargs)
        flat = [x for x, t in zip(leaves, cap.leaf_is_tensor) if t]
        outs = lowered.run(flat, self.runtime)
        self.runtime.calls += 1
        if self.runtime.after_call():  # a pass's state asks for new graphs (few-shot quantization): the same passes
            self._forget_graphs()
        result = pytree.tree_unflatten(outs, cap.out_spec)
        if not cap.accepts_return_dict or not return_dict:
            return result
        cls = _output_class()
        sample = result[0] if isinstance(result, (tuple, list)) else result
        return cls(sample=sample) if cls is not None else result

    # -- inspection ----------------------------------------------------------------------------
    def _current(self) -> LoweredGraph:
        if self._last is None and not self._by_key:
            raise RuntimeError("nothing captured yet: call the module once (or compiled.lower(**inputs)), "
                               "or pass example_inputs= to compile_dit")
        return self._last or next(iter(self._by_key.values()))

    @property
    def graph(self) -> fx.Graph:
        return self._current().gm.graph

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._current().gm

    @property
    def code(self) -> str:
        return self._current().gm.print_readable(print_output=False, include_stride=False, include_device=False)

    @property
    def structure(self):
        """The discovered structure of the current graph (re-derived if a pass invalidated it). After the
        residual-cache pass it is the structure the pass cut: the middle blocks now live in its branch."""
        gm = self._current().gm
        cut = facts_of(gm).structure_at_cut
        return cut if cut is not None else get_structure(gm)

    def memory_report(self) -> MemoryReport:
        """What this rank keeps resident: every distinct tensor storage reachable from this module (its graphs,
        the original module, the runtime state and the passes) once, by kind (fp32 / bf16 dense, fp8, int8,
        int4 packed, scales, low rank, offloaded to the host, runtime state) and by block; the weights passes
        released (meta) apart. ``str(report)`` reads; ``report.as_dict()`` / ``report.entries`` for numbers."""
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        try:
            block_lists = [bl.name for bl in self.structure.block_lists]
        except Exception:  # noqa: BLE001 - nothing lowered yet (or not analysable): the model's own lists
            block_lists = [n for n, m in self.original.named_children() if isinstance(m, torch.nn.ModuleList)]
        roots = [("graphs", self.graphs), ("original", self.original), ("compiled", self)]
        return memory_report(roots, block_lists, rank, onloaded_tensors(self.graphs.values()))

    def explain(self, print_output: bool = True) -> str:
        cur = self._current()
        text = (f"captured {type(self.original).__name__} in {cur.captured.seconds:.2f} s; "
                f"{self.graph_stats.summary()}\n"
                + facts_of(cur.gm).structure_summary + "\n" + cur.manager.explain())
        if print_output:
            print(text)
        return text
