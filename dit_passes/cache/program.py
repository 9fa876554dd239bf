"""The small modules a residual-cache pass inserts into the graph around (and into) its ``torch.cond``.

``decide``: ``(fn_residual, timestep, *state, *partner) -> (use_cache, diff, *hit_values, *state')``
    The step decision of the program's rule (DBCache: :func:`~dit_passes.cache.decision.decide`; the
    diffusers methods: :mod:`~dit_passes.cache.peer_rules`) plus the values a cache hit adds to the
    streams (the stored middle residuals). A program with :attr:`~CacheProgram.hit_keys` (DBCache with a
    calibrator) returns ``(use_cache, diff, *state')`` instead: its hit values are a prediction (TaylorSeer,
    FoCa, DMD: up to a dozen small SVDs per stream), formed only when the step is cached, by
``hit``: ``(*state'[hit_keys]) -> (*hit_values)``
    Called inside the cached arm of the ``torch.cond``, so a computed step never pays for it.
``commit``: ``(use_cache, *middle_residuals, *state') -> (*state'')``
    After the branch: a computed step stores the middle blocks' residuals (or advances the TaylorSeer
    ladder); a cached step keeps the state (FoCa: takes the prediction the cached arm passed on).

All are pure tensor code (no ``.item()``, no in-place writes), so the rewritten graph traces under
``torch.compile(fullgraph=True)`` and captures in a CUDA graph. The state travels as graph inputs and
outputs, in the order of :attr:`CacheProgram.state_spec`; :class:`~dit_passes.cache.store.CacheStore`
keeps it between calls.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple

import torch

from .config import CalibratorConfig, DBCacheConfig
from .decision import decide, hit_values, update_after_branch
from .state import NO_STEP, state_spec, stream_keys

# The partner (non-CFG) values a CFG call reads when ``cfg_diff_compute_separate=False``.
PARTNER_KEYS = ("step", "diff_step", "diff")


@dataclasses.dataclass(frozen=True)
class StateSpec:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0.0
    values: Optional[Tuple[float, ...]] = None  # a constant table (MagCache's ratios) instead of one fill value

    def allocate(self, device: torch.device) -> torch.Tensor:
        if self.values is not None:  # once per context and generation: a host-to-device copy here is fine
            return torch.tensor(self.values, dtype=self.dtype).reshape(self.shape).to(device)
        return torch.full(self.shape, self.fill, dtype=self.dtype, device=device)


def _group_mean_pair(group):
    """``allreduce(num, den)`` for :func:`decide`: both means averaged over ``group`` in one collective, so
    every rank of a context- or tensor-parallel group takes the same decision."""
    from ..parallel.collectives import all_reduce

    def allreduce(num: torch.Tensor, den: torch.Tensor):
        both = all_reduce(torch.stack([num.to(torch.float32), den.to(torch.float32)]), group, "avg")
        return both[0], both[1]

    return allreduce


class Decide(torch.nn.Module):
    def __init__(self, program: "CacheProgram"):
        super().__init__()
        self.program = program

    def forward(self, fn_residual: torch.Tensor, timestep: torch.Tensor, *flat: torch.Tensor):
        return self.program.decide_call(fn_residual, timestep, flat)


class Hit(torch.nn.Module):
    def __init__(self, program: "CacheProgram"):
        super().__init__()
        self.program = program

    def forward(self, *flat: torch.Tensor):
        return tuple(self.program.hit_call(flat))


class Commit(torch.nn.Module):
    def __init__(self, program: "CacheProgram"):
        super().__init__()
        self.program = program

    def forward(self, use_cache: torch.Tensor, *flat: torch.Tensor):
        return self.program.commit_call(use_cache, flat)


@dataclasses.dataclass(eq=False, kw_only=True)
class CacheProgram:
    """One graph's cache program: the state it threads and its decision rule.

    A rule is a subclass implementing ``decide_call(fn_residual, timestep, flat)`` (``flat``: the state in
    :attr:`state_spec` order, then the partner's scalars when :attr:`uses_partner`) returning
    ``(use_cache, diff, *hit_values, *state')`` and ``commit_call(use_cache, flat)`` (``flat``: one
    :func:`~dit_passes.cache.decision.middle_cache_values` per stream, then the state) returning the state
    after the branch. The state must hold the scalars :class:`~dit_passes.cache.stats.CacheStats` records
    (``gen``, ``step``, ``diff``, ``diff_step``, ``use_cache``). ``reads_fn_residual=False``: the rule does not
    look at its first argument (the pass then inserts no Fn residual; MagCache caches the whole range).

    Hit values that cost more than reading the state (a calibrator's prediction) belong in the cached arm: such a
    rule sets :attr:`hit_keys` (the names of the state tensors the prediction reads), leaves the hit values out
    of ``decide_call``'s result and implements ``hit_call(flat)`` (``flat``: those tensors of the decided state,
    in :attr:`hit_keys` order) returning one value per stream.
    """

    state_spec: List[StateSpec]
    num_streams: int
    has_timestep: bool
    group: object = None  # torch.distributed ProcessGroup whose ranks must agree, or None
    reads_fn_residual: bool = True
    separate_cfg: bool = False  # the call parity picks the context when no context is named (CacheStore)
    cfg_compute_first: bool = False

    def __post_init__(self) -> None:
        self.names: Tuple[str, ...] = tuple(s.name for s in self.state_spec)  # state order, built once

    @property
    def uses_partner(self) -> bool:
        return False

    @property
    def input_spec(self) -> List[StateSpec]:
        """What the graph takes after the user's inputs: the state, then the partner's scalars if used."""
        if not self.uses_partner:
            return list(self.state_spec)
        by_name = {s.name: s for s in self.state_spec}
        return list(self.state_spec) + [dataclasses.replace(by_name[k], name=f"partner_{k}") for k in PARTNER_KEYS]

    def partner_default(self, device: torch.device) -> List[torch.Tensor]:
        """Partner values meaning "the non-CFG call recorded nothing this step"."""
        return [torch.full((), NO_STEP, dtype=torch.int64, device=device),
                torch.full((), NO_STEP, dtype=torch.int64, device=device),
                torch.full((), float("nan"), dtype=torch.float64, device=device)]

    def allreduce_means(self):
        """``allreduce(num, den)`` averaging both over :attr:`group`, or None on one rank."""
        return _group_mean_pair(self.group) if self.group is not None and self.group.size() > 1 else None

    @property
    def hit_keys(self) -> Optional[Tuple[str, ...]]:
        """None: ``decide_call`` returns the hit values. Else the decided state's tensors ``hit_call`` reads; the
        pass passes them into the ``torch.cond`` and calls :attr:`hit` in its cached arm."""
        return None

    def decide_call(self, fn_residual: torch.Tensor, timestep: torch.Tensor, flat: Sequence[torch.Tensor]):
        raise NotImplementedError

    def hit_call(self, flat: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} sets hit_keys but does not implement hit_call")

    def commit_call(self, use_cache: torch.Tensor, flat: Sequence[torch.Tensor]):
        raise NotImplementedError

    @property
    def decide(self) -> Decide:
        return Decide(self)

    @property
    def hit(self) -> Hit:
        return Hit(self)

    @property
    def commit(self) -> Commit:
        return Commit(self)


@dataclasses.dataclass(eq=False, kw_only=True)
class DBCacheProgram(CacheProgram):
    """cache-dit's DBCache rule (:func:`~dit_passes.cache.decision.decide`) with its calibrator; the calibrator's
    prediction (:func:`~dit_passes.cache.decision.hit_values`) runs in the cached arm (:attr:`hit_keys`)."""

    config: DBCacheConfig
    calibrator: Optional[CalibratorConfig] = None

    @functools.cached_property
    def hit_keys(self) -> Optional[Tuple[str, ...]]:  # read on every call by hit_call: built once
        if self.calibrator is None:  # the hit values are the stored residuals: decide passes them on
            return None
        return ("step", "last_compute_step") + tuple(
            k for i in range(self.num_streams) for k in stream_keys(i, self.calibrator))

    @property
    def uses_partner(self) -> bool:
        # None: the branches may be told apart in the graph (cache.branches), which then feeds the partner
        return self.config.enable_separate_cfg is not False and not self.config.cfg_diff_compute_separate

    def decide_call(self, fn_residual, timestep, flat):
        names = self.names
        state = dict(zip(names, flat[:len(names)]))
        partner = dict(zip(PARTNER_KEYS, flat[len(names):])) if self.uses_partner else None
        use_cache, new, diff = decide(state, fn_residual, timestep if self.has_timestep else None, self.config,
                                      allreduce=self.allreduce_means(), partner=partner)
        hits = hit_values(new, self.num_streams) if self.calibrator is None else ()  # else: hit_call, if cached
        return (use_cache, diff, *hits, *(new[n] for n in names))

    def hit_call(self, flat):
        return hit_values(dict(zip(self.hit_keys, flat)), self.num_streams, self.calibrator)

    def commit_call(self, use_cache, flat):
        names = self.names
        values, state = flat[:self.num_streams], dict(zip(names, flat[self.num_streams:]))
        new = update_after_branch(state, use_cache, values, self.calibrator)
        return tuple(new[n] for n in names)


def build_program(config: DBCacheConfig, calibrator: Optional[CalibratorConfig], *,
                  image_residual: torch.Tensor, stream_residuals: Sequence[torch.Tensor], has_timestep: bool,
                  group=None) -> CacheProgram:
    """The program for one graph. ``image_residual``: the Fn residual (real or fake tensor, for shapes);
    ``stream_residuals``: one example per stream leaving the middle blocks (image first)."""
    if calibrator is not None and calibrator.calibrator_cache_type != "residual":
        raise ValueError(f"DBCache pass: {type(calibrator).__name__}(calibrator_cache_type="
                         f"{calibrator.calibrator_cache_type!r}) is not supported by the graph pass; use "
                         "calibrator_cache_type='residual' (the default)")
    spec = state_spec(config, calibrator, image_residual, stream_residuals)
    specs = [StateSpec(name, tuple(shape), dtype, fill) for name, (shape, dtype, fill) in spec.items()]
    return DBCacheProgram(config=config, calibrator=calibrator, state_spec=specs, num_streams=len(stream_residuals),
                          has_timestep=has_timestep, group=group, separate_cfg=bool(config.enable_separate_cfg),
                          cfg_compute_first=config.cfg_compute_first)


__all__ = ["CacheProgram", "DBCacheProgram", "StateSpec", "build_program", "PARTNER_KEYS", "Hit"]
