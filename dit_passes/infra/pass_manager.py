"""PassManager: orders passes by phase, runs them, guards the graph facts, verifies the graph after each.

Contract
  requires: a GraphModule produced by :mod:`dit_passes.capture` (ATen ops, parameters as attributes) and
  passes that each declare a :class:`~dit_passes.infra.phases.Phase`.
  guarantees: passes run in phase order (the user's order within a phase); a pipeline that no order
  satisfies is rejected before anything runs, naming the passes and the facts. While a pass runs it can
  read and assign only the facts it declared; afterwards no undeclared fact has changed, the graph lints
  and recompiles, every ``call_function`` node still carries ``meta["val"]`` (shape propagation stays
  valid for the next pass), and the derived facts it invalidated are dropped (re-derived for the next
  reader).

Each run is recorded as a :class:`PassRecord` (timing, counts, report, and the graph's code before and
after: the string ``recompile`` produced anyway, so recording costs nothing) for ``explain()``;
``dump_dir`` writes the readable graph after every pass (like vLLM's per-pass dumps), built only then.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import time
from typing import List, Optional, Sequence, Tuple

import torch.fx as fx

from .facts import DERIVED_FACTS, FactAccessError, facts_of
from .pass_base import Pass, PassContext, PassCrashed, PassError, PassResult, Refusal
from .phases import Phase


@dataclasses.dataclass
class PassRecord:
    name: str
    description: str
    phase: str
    reads: tuple
    writes: tuple
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


def order_passes(passes: Sequence[Pass]) -> List[Pass]:
    """The passes in phase order (stable: the given order within a phase), after checking that the
    order serves every declared read and that no two passes of one phase write the same fact."""
    for p in passes:
        if p.phase is None:
            raise PassError(f"pass '{p.name}' ({type(p).__name__}) declares no phase: set its class attribute "
                            f"phase = Phase.<one of {', '.join(ph.name for ph in Phase)}> "
                            f"(from dit_passes.infra.phases import Phase)")
    ordered = sorted(passes, key=lambda p: p.phase)
    for i, p in enumerate(ordered):
        for q in ordered[i + 1:]:
            if q.phase == p.phase:
                both = sorted(set(p.writes) & set(q.writes))
                if both:
                    raise PassError(f"passes '{p.name}' and '{q.name}' are both of phase {p.phase.name} and both "
                                    f"write graph fact(s) {both}: one would overwrite the other. Keep one of them "
                                    f"(e.g. USP(ulysses=, ring=) instead of Ulysses + Ring)")
            late = sorted((set(p.reads) - DERIVED_FACTS) & set(q.writes))
            if late and q.phase > p.phase:
                raise PassError(f"pass '{p.name}' (phase {p.phase.name}) reads graph fact(s) {late}, which pass "
                                f"'{q.name}' writes in the later phase {q.phase.name}: no order serves both. "
                                f"Move '{p.name}' to a later phase, or drop one of them")
    return ordered


def verify_graph(gm: fx.GraphModule, after: str, recompiled: bool = False) -> None:
    """Lint + recompile + metadata check. Raises PassError naming the pass that broke the graph.
    ``recompiled``: the graph was recompiled after the pass's last edit (its ``ctx.recompile_at_end``): the code
    it has is the code a recompile would generate again, so it is not generated twice."""
    try:
        gm.graph.lint()
        if not recompiled:
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

    def _run_one(self, gm: fx.GraphModule, ctx: PassContext, p: Pass) -> Tuple[PassResult, bool]:
        """The pass's result, and whether ``gm`` was recompiled after its last edit (``ctx.recompile_at_end``)."""
        facts = facts_of(gm)
        snap = facts.snapshot()
        facts.guard(p.name, frozenset(p.reads), frozenset(p.writes))
        outer = (ctx._deferred_gm, ctx._recompile_asked)  # a pass may run a manager of its own on ctx
        ctx._deferred_gm, ctx._recompile_asked = gm, False
        try:
            result = p.run(gm, ctx)
            recompiled = ctx._recompile_asked
            if recompiled:  # the pass's closing recompile, where it would have run (its failure is the pass's crash)
                gm.recompile()
        except (PassError, FactAccessError):
            raise
        except Refusal as e:  # a refusal of what the pass relies on (sharding, mesh, block discovery, capture)
            raise PassError(f"pass '{p.name}' failed: {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001
            raise PassCrashed(f"pass '{p.name}' failed: {type(e).__name__}: {e}") from e
        finally:
            facts.guard(None)
            ctx._deferred_gm, ctx._recompile_asked = outer
        undeclared = sorted(set(facts.changed_since(snap)) - set(p.writes))
        if undeclared:
            raise PassError(f"pass '{p.name}' changed graph fact(s) {undeclared} without declaring them in its "
                            f"writes {list(p.writes)}")
        if not isinstance(result, PassResult):
            raise PassError(f"pass '{p.name}' returned {type(result).__name__}, expected PassResult")
        return result, recompiled

    def run(self, gm: fx.GraphModule, ctx: Optional[PassContext] = None) -> fx.GraphModule:
        ctx = ctx or PassContext()
        if self.dump_dir:
            os.makedirs(self.dump_dir, exist_ok=True)
            self._dump(gm, 0, "captured")
        for idx, p in enumerate(self.passes, start=1):
            before = gm.code
            t0 = time.perf_counter()
            result, recompiled = self._run_one(gm, ctx, p)
            seconds = time.perf_counter() - t0
            if self.verify:
                verify_graph(gm, p.name, recompiled)
            for fact in p.invalidates:
                object.__setattr__(facts_of(gm), fact, None)
            self.records.append(PassRecord(p.name, p.describe(), p.phase.name, tuple(p.reads), tuple(p.writes),
                                           result, seconds, before, gm.code))
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
            out.append(f"== {r.description}  [{r.phase}, {r.seconds * 1e3:.1f} ms]")
            out.append(f"   reads: {', '.join(r.reads) or '-'}; writes: {', '.join(r.writes) or '-'}")
            out.append(f"   result: {r.result}")
            d = r.diff()
            out.append("   diff:\n" + ("\n".join("   " + line for line in d.splitlines()) if d else "   (graph unchanged)"))
        return "\n".join(out)
