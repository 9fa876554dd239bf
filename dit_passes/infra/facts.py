"""GraphFacts: everything passes tell each other about a graph, as one typed record on the graph.

``facts_of(gm)`` returns the record (kept in ``gm.meta["dit_passes"]``). A pass declares the fields it
reads and writes (``Pass.reads`` / ``Pass.writes``, checked against the field names when the class is
defined); while it runs, the PassManager lets it read and assign only those, and afterwards checks that
no other field changed. Fields, one by one:

Structure
* ``structure``: the discovered :class:`~dit_passes.analysis.structure.DiTStructure` of the graph as it is
  now. *Derived*: a pass that reads it gets it re-discovered if an earlier pass invalidated it.
* ``block_lists``: the user's override of discovery's main stack (``compile_dit(block_lists=[...])``).
* ``structure_summary``: discovery's one-paragraph summary of the captured graph (for ``explain()``).
* ``structure_at_cut``: the structure as it was before a pass moved blocks out of the top graph (into a
  cache branch or compiled templates); what ``CompiledDiT.structure`` shows afterwards.

Calling convention (what ``CompiledDiT`` does around the graph)
* ``num_user_outputs``: how many leading outputs are the model's own; the rest belong to ``state_io``.
* ``state_io``: tensors threaded through the graph between calls (cache state, capture's value guard),
  one :class:`StateIO` per owner, in the order of their extra inputs / outputs.
* ``inference_only``: the graph holds a ``torch.cond`` whose branches cannot be differentiated; run it
  under ``no_grad``.
* ``eager_only``: why the graph must run eagerly (None: it may be compiled), e.g. few-shot quantization's observe
  ops, which mutate their spans (torch.cond refuses mutation): no whole-graph ``torch.compile``, no regional
  compile, no CUDA graph for it; the graph lowered after it is compiled as asked.

Parallelism
* ``parallel_group``: the process group whose ranks must take the same data-dependent decisions (the
  cache's residual diff is all-reduced over it). Context parallelism sets it to the sequence group; tensor
  parallelism sets it only where no sequence group exists.
* ``mesh``: the :class:`~dit_passes.parallel.mesh.ParallelMesh` of the context-parallel pass.
* ``tp_group`` / ``tp_size``: the ranks that share the weights, and how many.

Weights and cache
* ``offload_loads``: each inserted weight-load node -> the index of the block it loads for (the cache keeps
  each load on its block's side of the cut).
* ``cache_cut``: where the residual cache cut the block range (:class:`CacheCut`).

Quantization
* ``fused_linears``: each linear ``FuseSiblingLinears`` made out of siblings, by its module path (the first
  member's) -> :class:`FusedLinear` (the members' paths and row counts, in the order of the fused weight's rows).
  ``SVDQuantW4A4`` gives such a linear a low-rank branch of ``rank`` per member; the quantization passes record the
  members in a checkpoint's signature, and ``LoadQuantized`` checks the graph fused the same groups. Empty: no pass
  fused anything.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

META_KEY = "dit_passes"


@dataclasses.dataclass
class StateIO:
    """Tensors one owner threads through the graph: ``inputs(runtime)`` are appended to the call's
    arguments; the graph's next ``num_outputs`` extra outputs go to ``outputs(runtime, tensors)``."""

    inputs: Callable[[Any], Sequence[torch.Tensor]]
    outputs: Callable[[Any, Sequence[torch.Tensor]], None]
    num_outputs: int


@dataclasses.dataclass(frozen=True)
class CacheCut:
    """The residual cache's cut: ``Fn`` first and ``Bn`` last blocks computed, the rest in the branch."""

    Fn: int
    Bn: int
    blocks: int
    middle_nodes: int
    streams_cached: int

    @property
    def middle(self) -> int:
        return self.blocks - self.Fn - self.Bn


@dataclasses.dataclass(frozen=True)
class FusedLinear:
    """One linear fused out of ``members``: ``(module path, rows)`` each, in the order of the fused weight's rows."""

    members: Tuple[Tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(r for _, r in self.members)


class FactAccessError(RuntimeError):
    """A pass touched a fact it did not declare (raised while the PassManager guards the facts)."""


@dataclasses.dataclass
class GraphFacts:
    structure: Optional[Any] = None
    block_lists: Optional[List[str]] = None
    structure_summary: str = ""
    structure_at_cut: Optional[Any] = None
    num_user_outputs: Optional[int] = None
    state_io: List[StateIO] = dataclasses.field(default_factory=list)
    inference_only: bool = False
    parallel_group: Optional[Any] = None
    mesh: Optional[Any] = None
    tp_group: Optional[Any] = None
    tp_size: int = 1
    offload_loads: Dict[fx.Node, int] = dataclasses.field(default_factory=dict)
    cache_cut: Optional[CacheCut] = None
    eager_only: Optional[str] = None
    fused_linears: Dict[str, FusedLinear] = dataclasses.field(default_factory=dict)

    # -- the PassManager's guard: which fields the running pass may read / assign ----------------
    def __getattribute__(self, name: str) -> Any:
        guard = object.__getattribute__(self, "__dict__").get("_guard")
        if guard is not None and name in FACT_NAMES and name not in guard[1]:
            raise FactAccessError(f"pass '{guard[0]}' reads graph fact '{name}' without declaring it: add "
                                  f"'{name}' to its reads (declared: {sorted(guard[1]) or 'none'})")
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        guard = self.__dict__.get("_guard")
        if guard is not None and name in FACT_NAMES and name not in guard[2]:
            raise FactAccessError(f"pass '{guard[0]}' assigns graph fact '{name}' without declaring it: add "
                                  f"'{name}' to its writes (declared: {sorted(guard[2]) or 'none'})")
        object.__setattr__(self, name, value)

    def guard(self, pass_name: Optional[str], reads: FrozenSet[str] = frozenset(),
              writes: FrozenSet[str] = frozenset()) -> None:
        """Restrict access to ``reads`` (plus ``writes``) and assignment to ``writes``; None lifts it."""
        value = None if pass_name is None else (pass_name, frozenset(reads) | frozenset(writes), frozenset(writes))
        self.__dict__["_guard"] = value

    def derived(self, name: str, derive: Callable[[], Any]) -> Any:
        """A derived fact, computed by ``derive`` (with the guard lifted) if missing. The guard still
        checks that a guarded caller declared ``name``."""
        value = getattr(self, name)
        if value is None:
            guard = self.__dict__.get("_guard")
            self.guard(None)
            try:
                value = derive()
                object.__setattr__(self, name, value)
            finally:
                self.__dict__["_guard"] = guard
        return value

    def snapshot(self) -> Dict[str, Any]:
        """The fields' values (containers copied), to tell afterwards which ones a pass changed."""
        self.guard(None)
        return {f: copy.copy(v) if isinstance(v, (list, dict)) else v
                for f in FACT_NAMES for v in (getattr(self, f),)}

    def changed_since(self, snap: Dict[str, Any]) -> List[str]:
        """Fields assigned or mutated since ``snap``; derived facts (re-discovered on demand) excluded."""
        return [f for f in sorted(FACT_NAMES - DERIVED_FACTS) if not _same(getattr(self, f), snap[f])]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return a is b or (isinstance(a, (bool, int, float, str)) and a == b)


FACT_NAMES: FrozenSet[str] = frozenset(f.name for f in dataclasses.fields(GraphFacts))
# Facts re-derived on demand when a reader finds them missing (analysis.blocks.get_structure for "structure").
DERIVED_FACTS: FrozenSet[str] = frozenset({"structure"})


def facts_of(gm: fx.GraphModule) -> GraphFacts:
    """The facts passes recorded on ``gm`` (created empty on first use)."""
    facts = gm.meta.get(META_KEY)
    if facts is None:
        facts = gm.meta[META_KEY] = GraphFacts()
    return facts


def check_fact_names(owner: str, kind: str, names: Sequence[str]) -> None:
    unknown = sorted(set(names) - FACT_NAMES)
    if unknown:
        raise TypeError(f"{owner}.{kind} names unknown graph fact(s) {unknown}; the facts are the fields of "
                        f"dit_passes.infra.facts.GraphFacts: {sorted(FACT_NAMES)}")


__all__ = ["GraphFacts", "StateIO", "CacheCut", "FusedLinear", "FactAccessError", "facts_of", "FACT_NAMES",
           "DERIVED_FACTS", "META_KEY"]
