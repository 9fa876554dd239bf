"""CacheStore: the caller-visible holder of residual-cache state, one per CompiledDiT.

The cache graph takes its state as extra inputs and returns the next state as extra outputs (see
:mod:`dit_passes.cache.program`); this object keeps those tensors per (graph, cache context) between
calls. A *context* is the pipeline's ``cache_context`` name ("cond" / "uncond"), or, with
``enable_separate_cfg=True`` and no named context, the call parity (the reference's rule: with
``cfg_compute_first=False`` the odd calls are the CFG branch).

Nothing here reads a device value during a step: decisions and diffs go to a device ring buffer
(:class:`~dit_passes.cache.stats.CacheStats`) and are read (one sync) only when a summary is asked for.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .program import PARTNER_KEYS, CacheProgram
from .stats import CacheStats

NON_CFG, CFG = "non_cfg", "cfg"


class CacheStore:
    drop_on_relower = True  # its buffers belong to the lowered graphs (Runtime.drop_lowering_state)

    def __init__(self, config: Any, calibrator: Any = None, stats_capacity: int = 4096):
        self.config = config
        self.calibrator = calibrator
        self.stats = CacheStats(stats_capacity)
        self._programs: Dict[int, Tuple[CacheProgram, torch.device]] = {}
        self._cuts: Dict[int, Any] = {}  # graph id -> infra.facts.CacheCut
        self._slots: Dict[Tuple[int, str], List[torch.Tensor]] = {}
        self._parity: Dict[int, int] = {}
        self._pending: Optional[Tuple[int, str]] = None

    # -- graph plumbing (called by CompiledDiT through the facts the pass registered) ------------
    def register_graph(self, graph_id: int, program: CacheProgram, device: torch.device, cut: Any = None) -> None:
        self._programs[graph_id] = (program, device)
        self._cuts[graph_id] = cut

    def forget_graph(self, graph_id: int) -> None:
        """The module evicted graph ``graph_id`` (Runtime.forget_graph): its program and state go; lowered again,
        its signature starts from the initial state, as at its first call."""
        self._programs.pop(graph_id, None)
        self._cuts.pop(graph_id, None)
        self._parity.pop(graph_id, None)
        for key in [k for k in self._slots if k[0] == graph_id]:
            del self._slots[key]
        if self._pending is not None and self._pending[0] == graph_id:
            self._pending = None

    def _context(self, graph_id: int, context: str) -> str:
        program = self._programs[graph_id][0]
        if context != "default" or not program.separate_cfg:
            return context
        n = self._parity.get(graph_id, 0)
        self._parity[graph_id] = n + 1
        cfg_call = (n % 2 == 0) if program.cfg_compute_first else (n % 2 == 1)
        return CFG if cfg_call else NON_CFG

    def inputs(self, graph_id: int, context: str) -> List[torch.Tensor]:
        program, device = self._programs[graph_id]
        key = (graph_id, self._context(graph_id, context))
        if key not in self._slots:
            self._slots[key] = [s.allocate(device) for s in program.state_spec]
        self._pending = key
        out = list(self._slots[key])
        if program.uses_partner:
            partner = self._slots.get((graph_id, NON_CFG)) if key[1] == CFG else None
            if partner is None:
                out += program.partner_default(device)
            else:
                names = [s.name for s in program.state_spec]
                out += [partner[names.index(k)] for k in PARTNER_KEYS]
        return out

    def outputs(self, graph_id: int, context: str, values: Sequence[torch.Tensor]) -> None:
        program, _ = self._programs[graph_id]
        key, self._pending = self._pending, None
        if key is None or key[0] != graph_id:
            raise RuntimeError("CacheStore.outputs without a matching inputs() call for this graph")
        n = len(program.state_spec)
        state, use_cache = list(values[:n]), values[n]
        self._slots[key] = state
        self.stats.record(key[1] if len(self._programs) == 1 else f"{key[1]}@g{graph_id}",
                          dict(zip(program.names, state)), use_cache)

    # -- caller API ----------------------------------------------------------------------------
    def state_of(self, context: str = "default",
                 graph_id: Optional[int] = None) -> Tuple[CacheProgram, Dict[str, torch.Tensor]]:
        """``(program, name -> tensor)``: the state kept for ``context`` (of ``graph_id``, else of the first graph
        that has one), as the last call left it."""
        for (gid, ctx), state in self._slots.items():
            if ctx == context and graph_id in (None, gid):
                program = self._programs[gid][0]
                return program, dict(zip(program.names, state))
        raise KeyError(f"CacheStore: no state for context {context!r} yet (run the model once)")

    def new_generation(self) -> None:
        """Start a new generation on the next call (serving: call between requests). Without it a new
        generation is still detected on the device, from the timestep rising again."""
        for (gid, ctx), state in self._slots.items():
            program, device = self._programs[gid]
            # everything back to its initial value but the generation counter, so stats keep counting
            self._slots[(gid, ctx)] = [t if s.name == "gen" else s.allocate(device)
                                       for s, t in zip(program.state_spec, state)]
        self._parity.clear()

    @contextlib.contextmanager
    def generation(self) -> Iterator["CacheStore"]:
        """``with store.generation(): pipe(...)``: a fresh generation inside the block."""
        self.new_generation()
        yield self

    def summary(self) -> List[Dict[str, Any]]:
        """Per generation: cached steps, residual diffs and their percentiles, per context (one sync)."""
        return self.stats.summary()

    def summary_string(self) -> str:
        return self.stats.summary_string()

    def last_generation(self) -> Dict[str, Any]:
        """The last generation's per-call decisions in call order: ``step_cached``, ``step_diffs``."""
        recs = self.stats.records()
        if not recs:
            return {"step_cached": [], "step_diffs": []}
        last = recs[-1]["generation"]
        mine = [r for r in recs if r["generation"] == last]
        return {"step_cached": [r["cached"] for r in mine], "step_diffs": [r["diff"] for r in mine]}

    def fidelity_stats(self) -> Dict[str, Any]:
        """The last generation's decisions, plus the fraction of block work executed and the cached steps
        (what :mod:`dit_passes.fidelity` reports beside the images)."""
        out = self.last_generation()
        cut = next((c for c in reversed(list(self._cuts.values())) if c is not None), None)
        if cut is not None and out["step_cached"]:
            executed = [cut.Fn + cut.Bn + (0 if c else cut.middle) for c in out["step_cached"]]
            out["executed_block_fraction"] = sum(executed) / (len(executed) * cut.blocks)
            out["cached_steps"] = sum(out["step_cached"])
        return out


__all__ = ["CacheStore"]
