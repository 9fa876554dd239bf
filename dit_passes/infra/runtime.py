"""Runtime: the per-module state a caller can see, reset and read reports from.

One per ``CompiledDiT`` (``compiled.runtime``), handed to every pass as ``ctx.runtime``. Passes keep
what must outlive one call under ``runtime.state[<pass name>]`` (cache buffers, process-group meshes,
quantized weights, compiled templates) and register what a user reads back with
``runtime.register_report(<pass name>, report)``; ``compiled.report(<pass name>)`` returns it. A pass that
replaces a weight records it in ``runtime.weights`` (:mod:`dit_passes.infra.ownership`). Two
compiled modules never share a Runtime, and nothing lives on a class.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator


class Runtime:
    def __init__(self) -> None:
        self.context: str = "default"   # the pipeline's cache context ("cond" / "uncond")
        self.state: Dict[str, Any] = {}
        self.reports: Dict[str, Any] = {}
        self.calls = 0
        from .ownership import WeightLedger  # here: ownership's PassError module imports this one
        self.weights = WeightLedger()    # what the passes replaced in the user's model (infra/ownership.py)

    @contextlib.contextmanager
    def in_context(self, name: str) -> Iterator[None]:
        """The calls inside run under cache context ``name`` (each named context keeps its own cache state)."""
        prev, self.context = self.context, name
        try:
            yield
        finally:
            self.context = prev

    def new_generation(self) -> None:
        """Tell every stateful pass that a new generation starts (serving: call between requests)."""
        for st in self.state.values():
            reset = getattr(st, "new_generation", None)
            if reset is not None:
                reset()

    def after_call(self) -> bool:
        """After each forward: every state entry with an ``after_call()`` method is told, and True when one of them
        answers True: the graphs must be lowered again (their state kept), e.g. few-shot quantization once it has
        observed its forwards."""
        again = False
        for st in list(self.state.values()):
            hook = getattr(st, "after_call", None)
            if hook is not None and hook():
                again = True
        return again

    def forget_graph(self, graph_id: int) -> None:
        """A lowered graph was evicted (the module's graph limit): every state entry with a ``forget_graph(graph_id)``
        method drops what it keeps for that graph (the residual cache's buffers). Graph ids are not reused while
        the module's graphs live, so nothing kept for another graph is touched."""
        for st in list(self.state.values()):
            forget = getattr(st, "forget_graph", None)
            if forget is not None:
                forget(graph_id)

    def register_report(self, name: str, report: Any) -> None:
        self.reports[name] = report

    def report(self, name: str) -> Any:
        if name not in self.reports:
            have = sorted(self.reports) or "none"
            raise KeyError(f"no runtime report named {name!r} (registered: {have}); a pass registers its report "
                           f"when it first lowers a graph: add the pass to passes=[...] and call the module once")
        return self.reports[name]

    def cache_report(self) -> Any:
        """The residual-cache pass's report (DBCache, FirstBlockCache, MagCache: the one report with a per-generation
        ``summary``), or None."""
        stores = [r for r in self.reports.values() if callable(getattr(r, "summary_string", None))]
        return stores[0] if stores else None

    def cache_summary(self, as_dict: bool = False, owner: str = "this module"):
        """Per generation: cached steps, residual diffs and their percentiles (one device sync)."""
        store = self.cache_report()
        if store is None:
            raise RuntimeError(f"{owner} has no residual cache: add passes.DBCache(...) (or FirstBlockCache / "
                               "MagCache) to passes=[...] (and call it once) before asking for a cache summary")
        return store.summary() if as_dict else store.summary_string()

    def drop_lowering_state(self) -> None:
        """Before the graphs are lowered again with other passes: drop the state (and report) of every
        entry whose object sets ``drop_on_relower = True`` (cache buffers tied to the old graphs); keep the
        rest (process groups, quantized weights)."""
        for name in [k for k, v in self.state.items() if getattr(v, "drop_on_relower", False)]:
            del self.state[name]
            self.reports.pop(name, None)


__all__ = ["Runtime"]
