"""CacheStore: the caller-visible holder of residual-cache state, one per CompiledDiT.

The cache graph takes its state as extra inputs and returns the next state as extra outputs (see
:mod:`dit_passes.cache.program`); this object keeps those tensors per (graph, cache context) between
calls. A *context* is the pipeline's ``cache_context`` name ("cond" / "uncond"), or, with
``enable_separate_cfg=True`` and no named context, the call parity (the reference's rule: with
``cfg_compute_first=False`` the odd calls are the CFG branch). With ``enable_separate_cfg=None`` the graph picks the
branch itself (:mod:`dit_passes.cache.branches`): the store keeps one routed state per context and passes
``route_on`` (False for a named context, whose other branches then alias its first: no memory).

Nothing here reads a device value during a step: decisions and diffs go to a device ring buffer
(:class:`~dit_passes.cache.stats.CacheStats`) and are read (one sync) only when a summary is asked for.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .branches import ROUTE_OVER, RoutedProgram, slot_name
from .program import PARTNER_KEYS, CacheProgram
from .stats import CacheStats

NON_CFG, CFG = "non_cfg", "cfg"
RECORDED = ("gen", "step", "diff", "diff_step", "use_cache")  # the scalars CacheStats records per call


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
        self._flags: Dict[Tuple[torch.device, bool], torch.Tensor] = {}  # route_on, allocated once per device
        self._parity_checked: set = set()  # graphs whose first CFG-parity pair was checked (one read, once)

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

    def _allocate(self, program: CacheProgram, device: torch.device, context: str,
                  keep: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        """A fresh state (``keep``: the old one, whose generation counters stay). A routed state of a named
        context allocates its first branch only; the others alias it (:meth:`_realias`)."""
        counters = {"gen"}
        if isinstance(program, RoutedProgram):
            counters = {slot_name(k, "gen") for k in range(program.split.branches)}
        old = keep if keep is not None else [None] * len(program.state_spec)
        out = [t if t is not None and s.name in counters else s.allocate(device)
               for s, t in zip(program.state_spec, old)]
        return self._realias(program, context, out)

    @staticmethod
    def _realias(program: CacheProgram, context: str, state: List[torch.Tensor]) -> List[torch.Tensor]:
        if not isinstance(program, RoutedProgram) or context == "default":
            return state
        r, n = len(program.router_names), len(program.inner.names)
        first = state[r:r + n]
        return state[:r] + first * program.split.branches

    def _route_on(self, device: torch.device, on: bool) -> torch.Tensor:
        key = (device, on)
        if key not in self._flags:
            self._flags[key] = torch.full((), on, dtype=torch.bool, device=device)
        return self._flags[key]

    def inputs(self, graph_id: int, context: str) -> List[torch.Tensor]:
        program, device = self._programs[graph_id]
        key = (graph_id, self._context(graph_id, context))
        if key not in self._slots:
            self._slots[key] = self._allocate(program, device, key[1])
        self._pending = key
        out = list(self._slots[key])
        if isinstance(program, RoutedProgram):
            out.append(self._route_on(device, key[1] == "default"))
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
        self._slots[key] = self._realias(program, key[1], state)
        suffix = "" if len(self._programs) == 1 else f"@g{graph_id}"
        if isinstance(program, RoutedProgram):
            branch, recorded = program.active(state, RECORDED)
            names = tuple(c + suffix for c in program.split.branch_names(key[1]))
            self.stats.record(names, recorded, use_cache, branch=branch)
        else:
            self.stats.record(key[1] + suffix, dict(zip(program.names, state)), use_cache)
            if program.separate_cfg and key[1] in (CFG, NON_CFG):
                self._check_parity(graph_id, key[1])

    def _check_parity(self, graph_id: int, context: str) -> None:
        """``enable_separate_cfg=True`` on a pipeline that calls the transformer once per step would run every other
        step through each branch's state: the first time both parity states hold a call, their timesteps (the two
        calls of one step, if the setting is right) are compared, one device read for the graph's lifetime."""
        other = (graph_id, NON_CFG if context == CFG else CFG)
        if graph_id in self._parity_checked or other not in self._slots:
            return
        self._parity_checked.add(graph_id)
        program = self._programs[graph_id][0]
        if not program.has_timestep:
            return
        i = program.names.index("last_t")
        a, b = self._slots[other][i], self._slots[(graph_id, context)][i]
        if bool(torch.isnan(a)) or bool(a == b):
            return
        raise ValueError(f"enable_separate_cfg=True, but the transformer's first two calls ran at different "
                         f"timesteps ({float(a):g}, then {float(b):g}): this pipeline calls it once per step (or runs "
                         f"CFG batched), so every other step would go to the CFG branch's cache state. Use "
                         f"enable_separate_cfg=None (the branches are told apart from the calls) or False")

    def view(self, graph_id: int, values: Sequence[torch.Tensor], names: Sequence[str]) -> Dict[str, torch.Tensor]:
        """``name -> tensor`` of the state a call returned (``values``), for the branch that call ran."""
        program = self._programs[graph_id][0]
        if isinstance(program, RoutedProgram):
            return program.active(values, names)[1]
        return {n: values[program.names.index(n)] for n in names}

    # -- caller API ----------------------------------------------------------------------------
    def state_of(self, context: str = "default",
                 graph_id: Optional[int] = None) -> Tuple[CacheProgram, Dict[str, torch.Tensor]]:
        """``(program, name -> tensor)``: the state kept for ``context`` (of ``graph_id``, else of the first graph
        that has one), as the last call left it."""
        for (gid, ctx), state in self._slots.items():
            if graph_id not in (None, gid):
                continue
            program = self._programs[gid][0]
            if isinstance(program, RoutedProgram):
                names = program.split.branch_names(ctx)
                if context in names:
                    slot = program.slots(state)[names.index(context)]
                    return program.inner, dict(zip(program.inner.names, slot))
            elif ctx == context:
                return program, dict(zip(program.names, state))
        raise KeyError(f"CacheStore: no state for context {context!r} yet (run the model once)")

    def new_generation(self) -> None:
        """Start a new generation on the next call (serving: call between requests). Without it a new
        generation is still detected on the device, from the timestep rising again."""
        for (gid, ctx), state in self._slots.items():
            program, device = self._programs[gid]
            # everything back to its initial value but the generation counters, so stats keep counting
            self._slots[(gid, ctx)] = self._allocate(program, device, ctx, keep=state)
        self._parity.clear()

    @contextlib.contextmanager
    def generation(self) -> Iterator["CacheStore"]:
        """``with store.generation(): pipe(...)``: a fresh generation inside the block."""
        self.new_generation()
        yield self

    def summary(self) -> List[Dict[str, Any]]:
        """Per generation: cached steps, residual diffs and their percentiles, per context (one sync)."""
        self._warn_overflow()
        return self.stats.summary()

    def _warn_overflow(self) -> None:
        """A step with more calls at one timestep and latents than the branches kept shares the last branch's
        state from its third call on: said here, where the records are read anyway."""
        for (gid, ctx), state in self._slots.items():
            program = self._programs[gid][0]
            if isinstance(program, RoutedProgram) and bool(state[program.router_names.index(ROUTE_OVER)]):
                warnings.warn(f"cache context {ctx!r}: a step called the transformer more than "
                              f"{program.split.branches} times at one timestep with the same latents; the calls after "
                              f"the {program.split.branches}th shared the last branch's cache state. Name each "
                              f"branch with transformer.cache_context(name) to give each its own", stacklevel=3)

    def summary_string(self) -> str:
        self._warn_overflow()
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
