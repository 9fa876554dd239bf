"""PassManager: orders passes, runs them, verifies the graph after each, and keeps snapshots.

Contract
  requires: a GraphModule produced by :mod:`dit_passes.capture` (ATen ops, parameters as attributes).
  guarantees: after each pass the graph lints, recompiles, every ``call_function`` node still carries
  ``meta["val"]`` (shape propagation stays valid for the next pass), and every fact the next pass
  requires is present (``structure`` is re-derived by block discovery when a pass invalidated it).

Each run is recorded as a :class:`PassRecord` (timing, counts, report, graph text before/after) so that
``CompiledDiT.explain()`` can print what each pass required, what it changed and a unified diff, and
``dump_dir`` writes the graph after every pass to disk (like vLLM's per-pass dumps).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch.fx as fx

from .pass_base import Pass, PassContext, PassError, PassResult, graph_facts


@dataclasses.dataclass
class PassRecord:
    name: str
    description: str
    requires: tuple
    provides: tuple
    result: PassResult
    seconds: float
    before: str
    after: str

    def diff(self, context: int = 1, max_lines: int = 60) -> str:
        lines = list(difflib.unified_diff(self.before.splitlines(), self.after.splitlines(),
                                          "before", "after", n=context, lineterm=""))
        if len(lines) > max_lines:
            lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more diff lines)"]
        return "\n".join(lines)


# Fact name -> function that (re)derives it on a graph. Block discovery registers "structure".
_FACT_PROVIDERS: Dict[str, Callable[[fx.GraphModule, PassContext], None]] = {}


def register_fact_provider(fact: str, fn: Callable[[fx.GraphModule, PassContext], None]) -> None:
    _FACT_PROVIDERS[fact] = fn


def order_passes(passes: Sequence[Pass]) -> List[Pass]:
    """Stable topological order honouring ``run_after`` / ``run_before`` between the given passes.

    A constraint naming a pass that is not in the list is ignored (it only orders passes present).
    A cycle is an error naming the passes involved.
    """
    names = [p.name for p in passes]
    edges = {i: set() for i in range(len(passes))}  # i must run before every j in edges[i]
    for j, p in enumerate(passes):
        for i, q in enumerate(passes):
            if i == j:
                continue
            if q.name in p.run_after or p.name in q.run_before:
                edges[i].add(j)
    indeg = {j: 0 for j in edges}
    for i in edges:
        for j in edges[i]:
            indeg[j] += 1
    ready = [i for i in range(len(passes)) if indeg[i] == 0]
    out: List[int] = []
    while ready:
        ready.sort()
        i = ready.pop(0)
        out.append(i)
        for j in sorted(edges[i]):
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    if len(out) != len(passes):
        stuck = [names[i] for i in range(len(passes)) if i not in out]
        raise PassError(f"pass ordering constraints form a cycle between {stuck}: check their "
                        f"run_after / run_before declarations")
    return [passes[i] for i in out]


def verify_graph(gm: fx.GraphModule, after: str) -> None:
    """Lint + recompile + metadata check. Raises PassError naming the pass that broke the graph."""
    try:
        gm.graph.lint()
        gm.recompile()
    except Exception as e:  # noqa: BLE001 - re-raised with the pass's name
        raise PassError(f"graph is invalid after pass '{after}': {type(e).__name__}: {e}. "
                        f"The pass produced a malformed graph; fix the pass or remove it from passes=[...]") from e
    missing = [n.name for n in gm.graph.nodes
               if n.op == "call_function" and "val" not in n.meta and not n.meta.get("dit_no_val")]
    if missing:
        raise PassError(f"after pass '{after}', {len(missing)} node(s) lack meta['val'] (first: {missing[:5]}): "
                        f"passes must propagate shapes for the nodes they insert (see infra.graph_utils)")


class PassManager:
    def __init__(self, passes: Sequence[Pass], dump_dir: Optional[str] = None, verify: bool = True):
        for p in passes:
            if not isinstance(p, Pass):
                raise TypeError(f"passes=[...] must hold dit_passes Pass instances, got {type(p).__name__}: "
                                f"{p!r}. Build one from dit_passes.passes (e.g. passes.DBCache())")
        self.passes = order_passes(list(passes))
        self.dump_dir = dump_dir
        self.verify = verify
        self.records: List[PassRecord] = []

    def _ensure_facts(self, gm: fx.GraphModule, ctx: PassContext, p: Pass) -> None:
        facts = graph_facts(gm)
        for fact in p.requires:
            if fact in facts:
                continue
            provider = _FACT_PROVIDERS.get(fact)
            if provider is None:
                raise PassError(f"pass '{p.name}' requires graph fact '{fact}', which no earlier pass "
                                f"provided (have: {sorted(facts)}); add the pass that provides it first")
            provider(gm, ctx)

    def run(self, gm: fx.GraphModule, ctx: Optional[PassContext] = None) -> fx.GraphModule:
        ctx = ctx or PassContext()
        if self.dump_dir:
            os.makedirs(self.dump_dir, exist_ok=True)
            self._dump(gm, 0, "captured")
        for idx, p in enumerate(self.passes, start=1):
            self._ensure_facts(gm, ctx, p)
            before = gm.print_readable(print_output=False, include_stride=False, include_device=False)
            t0 = time.perf_counter()
            try:
                result = p.run(gm, ctx)
            except PassError:
                raise
            except Exception as e:  # noqa: BLE001
                raise PassError(f"pass '{p.name}' failed: {type(e).__name__}: {e}") from e
            seconds = time.perf_counter() - t0
            if not isinstance(result, PassResult):
                raise PassError(f"pass '{p.name}' returned {type(result).__name__}, expected PassResult")
            if self.verify:
                verify_graph(gm, p.name)
            facts = graph_facts(gm)
            for fact in p.invalidates:
                facts.pop(fact, None)
            for fact in p.provides:
                facts.setdefault(fact, True)
            after = gm.print_readable(print_output=False, include_stride=False, include_device=False)
            self.records.append(PassRecord(p.name, p.describe(), p.requires, p.provides, result,
                                           seconds, before, after))
            if self.dump_dir:
                self._dump(gm, idx, p.name)
        return gm

    def _dump(self, gm: fx.GraphModule, idx: int, name: str) -> None:
        path = os.path.join(self.dump_dir, f"{idx:02d}_{name}.py")
        with open(path, "w") as f:
            f.write(gm.print_readable(print_output=False))

    def explain(self) -> str:
        if not self.records:
            return "no passes ran (passes=[]): the graph is the captured graph"
        out = []
        for r in self.records:
            out.append(f"== {r.description}  [{r.seconds * 1e3:.1f} ms]")
            out.append(f"   requires: {', '.join(r.requires) or '-'}; provides: {', '.join(r.provides) or '-'}")
            out.append(f"   result: {r.result}")
            d = r.diff()
            out.append("   diff:\n" + ("\n".join("   " + line for line in d.splitlines()) if d else "   (graph unchanged)"))
        return "\n".join(out)
