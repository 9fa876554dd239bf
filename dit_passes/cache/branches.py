"""CFG branches told apart on the device: one cache state per branch, chosen by each call itself.

cache-dit 1.5.3 resolves ``enable_separate_cfg=None`` from a per-pipeline table: where a pipeline calls the
transformer twice per step (conditional, then unconditional) without naming a ``cache_context``, it keeps two
states (the CFG and non-CFG "branches"), each counting steps, not calls. Here the calls say it themselves: a call
whose ``timestep`` **and** ``hidden_states`` equal the previous call's is the next branch of the same step (the
branches of one step see the same latents at the same time; a new step, or a second evaluation of a Heun-type
sampler at a repeated timestep, sees other latents); any other call is branch 0 of a new step. Branch ``k`` keeps
its own state of the wrapped program's spec (``s<k>_<name>``), so its step counter, warm-up, masks, caps and
``num_inference_steps`` count steps of that branch, as the reference's separate-CFG contexts do.

This is device code, like the decision it wraps (no ``.item()``, no in-place writes): reading the timestep on the
host would stop the host at every call until the device has caught up (pipelines keep their timesteps on the
device), which costs the launch overlap the cache graphs rely on. The price: the state is kept ``branches`` times
(the CFG branch's, allocated also where a pipeline turns out to call once per step), and each call selects its
branch's tensors (``route``: one ``where`` per state tensor) and writes them back (``merge``), a few reads and
writes of the state per call, small beside a transformer call.

A named context (``with transformer.cache_context("uncond")``) is a branch already: the store passes ``route_on =
False`` there, branch 0 is used, and the other slots alias slot 0 (no memory).

``route``: ``(timestep, hidden_states | None, route_on, *router, *slots) -> (branch, *router', *working,
*partner)``: ``working`` in the wrapped spec's order, ``partner`` (when the wrapped rule reads one:
``cfg_diff_compute_separate=False``) the non-CFG branch's step, diff step and diff for the CFG branch's call.
``merge``: ``(branch, *working', *slots) -> (*slots')``.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from .program import PARTNER_KEYS, CacheProgram, StateSpec
from .state import NO_STEP

# The router's own state: the previous call's timestep, its branch, its hidden_states, and whether a call found
# more branches than kept (it then shares the last branch's state; reported by the store's summary).
ROUTE_T, ROUTE_B, ROUTE_H, ROUTE_OVER = "route_t", "route_b", "route_h", "route_overflow"


def slot_name(k: int, name: str) -> str:
    return f"s{k}_{name}"


@dataclasses.dataclass(frozen=True)
class BranchSplit:
    """How many branches a step may have (``branches``) and which one is cache-dit's CFG branch (``cfg_branch``:
    1 with ``cfg_compute_first=False``, the second call of a step; 0 with ``cfg_compute_first=True``)."""

    branches: int = 2
    cfg_branch: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.branches, int) or self.branches < 2:
            raise ValueError(f"BranchSplit.branches must be an int >= 2, got {self.branches!r}")
        if self.cfg_branch not in (0, 1):
            raise ValueError(f"BranchSplit.cfg_branch must be 0 or 1, got {self.cfg_branch!r}")

    @property
    def non_cfg_branch(self) -> int:
        return 1 - self.cfg_branch

    def branch_names(self, context: str) -> Tuple[str, ...]:
        """The names the branches of ``context`` report under: the non-CFG branch keeps the context's name, the CFG
        branch is ``"cfg"`` (the reference's ``cfg_`` fields), further ones ``"<context>/branch<k>"``."""
        names = [f"{context}/branch{k}" for k in range(self.branches)]
        names[self.non_cfg_branch] = context
        names[self.cfg_branch] = "cfg" if context == "default" else f"{context}/cfg"
        return tuple(names)


def split_for(config) -> Optional[BranchSplit]:
    """The split a cache config asks for: ``enable_separate_cfg=None`` -> two branches, the CFG one second (first
    with ``cfg_compute_first=True``); True (the reference's call parity, kept by the store) or False -> None."""
    if getattr(config, "enable_separate_cfg", False) is not None:
        return None
    return BranchSplit(2, cfg_branch=0 if config.cfg_compute_first else 1)


def _select(b: torch.Tensor, values: Sequence[torch.Tensor]) -> torch.Tensor:
    out = values[0]
    for k in range(1, len(values)):
        out = torch.where(b == k, values[k], out)
    return out


def _timestep_value(timestep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # a per-sample timestep vector: the samples share the schedule, the first one stands for all (as decide)
    return timestep.detach().reshape(-1)[0].to(device=like.device, dtype=torch.float64)


class Route(torch.nn.Module):
    def __init__(self, program: "RoutedProgram"):
        super().__init__()
        self.program = program

    def forward(self, timestep: torch.Tensor, *flat: torch.Tensor):
        return self.program.route_call(timestep, flat)


class Merge(torch.nn.Module):
    def __init__(self, program: "RoutedProgram"):
        super().__init__()
        self.program = program

    def forward(self, branch: torch.Tensor, *flat: torch.Tensor):
        return self.program.merge_call(branch, flat)


@dataclasses.dataclass(eq=False, kw_only=True)
class RoutedProgram(CacheProgram):
    """``inner``'s state kept once per branch, and the router's. Its :attr:`state_spec` is the router's scalars
    (and the previous ``hidden_states`` when ``hidden`` is given) then ``split.branches`` copies of ``inner``'s
    spec; :attr:`input_spec` adds the ``route_on`` flag the store passes."""

    inner: CacheProgram
    split: BranchSplit
    hidden: Optional[StateSpec] = None  # shape / dtype of the hidden_states input, compared with the previous call's

    @staticmethod
    def build(inner: CacheProgram, split: BranchSplit, hidden: Optional[torch.Tensor]) -> "RoutedProgram":
        router = [StateSpec(ROUTE_T, (), torch.float64, float("nan")), StateSpec(ROUTE_B, (), torch.int64, -1),
                  StateSpec(ROUTE_OVER, (), torch.bool, 0)]
        hspec = None
        if hidden is not None:
            hspec = StateSpec(ROUTE_H, tuple(hidden.shape), hidden.dtype,
                              float("nan") if hidden.dtype.is_floating_point else 0)
            router.append(hspec)
        slots = [dataclasses.replace(s, name=slot_name(k, s.name)) for k in range(split.branches)
                 for s in inner.state_spec]
        return RoutedProgram(inner=inner, split=split, hidden=hspec, state_spec=router + slots,
                             num_streams=inner.num_streams, has_timestep=True, group=inner.group,
                             reads_fn_residual=inner.reads_fn_residual)

    @property
    def router_names(self) -> List[str]:
        return [s.name for s in self.state_spec[:len(self.state_spec) - self.split.branches * len(self.inner.names)]]

    @property
    def input_spec(self) -> List[StateSpec]:
        return list(self.state_spec) + [StateSpec("route_on", (), torch.bool, 1)]

    @property
    def route(self) -> Route:
        return Route(self)

    @property
    def merge(self) -> Merge:
        return Merge(self)

    def slots(self, flat: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
        """The per-branch lists (inner order) of a flat routed state."""
        n, r = len(self.inner.names), len(self.router_names)
        return [list(flat[r + k * n:r + (k + 1) * n]) for k in range(self.split.branches)]

    def route_call(self, timestep: torch.Tensor, flat: Sequence[torch.Tensor]):
        """``flat``: ``(hidden_states if hidden, route_on, *router, *slots)``."""
        flat = list(flat)
        hidden = flat.pop(0) if self.hidden is not None else None
        route_on = flat.pop(0)
        router = dict(zip(self.router_names, flat))
        slots = self.slots(flat)
        t = _timestep_value(timestep, router[ROUTE_B])
        same = t == router[ROUTE_T]  # NaN (no previous call) compares False
        if hidden is not None:
            same = same & (hidden == router[ROUTE_H]).all()
        nxt = torch.where(same & route_on, router[ROUTE_B] + 1, 0)
        last = self.split.branches - 1
        new_router = {ROUTE_T: t, ROUTE_B: nxt.clamp(max=last), ROUTE_OVER: router[ROUTE_OVER] | (nxt > last)}
        if hidden is not None:
            new_router[ROUTE_H] = hidden.detach().to(router[ROUTE_H].dtype)
        b = new_router[ROUTE_B]
        working = [_select(b, [slots[k][i] for k in range(self.split.branches)]) for i in range(len(self.inner.names))]
        partner = []
        if self.inner.uses_partner:
            # the CFG branch's call reads what the non-CFG branch recorded this step (decide checks the step);
            # any other call reads "nothing recorded"
            mine = b == self.split.cfg_branch
            other = dict(zip(self.inner.names, slots[self.split.non_cfg_branch]))
            for key in PARTNER_KEYS:
                none = torch.full((), float("nan") if key == "diff" else NO_STEP, dtype=other[key].dtype,
                                  device=other[key].device)
                partner.append(torch.where(mine, other[key], none))
        return (b, *(new_router[n] for n in self.router_names), *working, *partner)

    def merge_call(self, branch: torch.Tensor, flat: Sequence[torch.Tensor]):
        n = len(self.inner.names)
        working, slots = list(flat[:n]), self.slots([None] * len(self.router_names) + list(flat[n:]))
        return tuple(torch.where(branch == k, w, s) for k in range(self.split.branches) for w, s in zip(working, slots[k]))

    # the decision is the wrapped program's: the graph calls inner.decide / commit on the routed working state
    def decide_call(self, fn_residual, timestep, flat):
        raise NotImplementedError("RoutedProgram wraps a program already in the graph; route/merge surround it")

    def commit_call(self, use_cache, flat):
        raise NotImplementedError("RoutedProgram wraps a program already in the graph; route/merge surround it")

    def active(self, flat: Sequence[torch.Tensor], names: Sequence[str]) -> Tuple[torch.Tensor, dict]:
        """``(branch, name -> tensor)``: the branch the call that returned ``flat`` ran, and its state's ``names``
        (device ops only: a ``where`` per name)."""
        router = dict(zip(self.router_names, flat))
        slots = self.slots(flat)
        b = router[ROUTE_B]
        idx = [self.inner.names.index(n) for n in names]
        return b, {n: _select(b, [slots[k][i] for k in range(self.split.branches)]) for n, i in zip(names, idx)}


__all__ = ["BranchSplit", "split_for", "RoutedProgram", "Route", "Merge", "slot_name", "ROUTE_T", "ROUTE_B", "ROUTE_H",
           "ROUTE_OVER"]
