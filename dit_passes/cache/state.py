"""Per-generation residual-cache state as plain tensors, and the per-context holder the caller sees.

A cache graph takes the state as inputs and returns the next state as outputs (``torch.cond`` branches
must not mutate anything), so the state is a flat ``dict[str, Tensor]`` with fixed keys, shapes and dtypes
(see :func:`state_spec`). :class:`CacheState` holds one such dict between calls; :class:`CacheContexts`
holds one ``CacheState`` per cache context ("cond" / "uncond", or the separate-CFG call parity).

Nothing here reads a device value: resets are host-side writes of constants, everything else is done by
``decision.decide`` / ``decision.update_after_branch`` on device.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .config import CalibratorConfig, DBCacheConfig
from .dmd import dmd_keys, dmd_spec
from .foca import foca_keys

# Values no real step takes: "no cached step recorded" / "no diff recorded".
NO_STEP = -(2 ** 40)

# name -> (dtype, initial value) of the 0-dim per-generation scalars.
SCALARS: Dict[str, Tuple[torch.dtype, float]] = {
    "step": (torch.int64, -1),               # context step of the last call; -1 = next call starts a generation
    "gen": (torch.int64, -1),                # generation counter (for stats), +1 at each new generation
    "last_t": (torch.float64, float("nan")),  # timestep of the last call (new-generation detection)
    "has_prev": (torch.bool, 0),             # an Fn residual of a computed step is stored in R_prev
    "cached_count": (torch.int64, 0),        # cached steps this generation (len(cached_steps))
    "last_cached_step": (torch.int64, NO_STEP),  # cached_steps[-1]
    "continuous": (torch.int64, 0),          # continuous cached steps
    "acc_diff": (torch.float64, 0.0),        # sum of the positive diffs recorded this generation
    "diff": (torch.float64, float("nan")),   # diff recorded at step diff_step
    "diff_step": (torch.int64, NO_STEP),     # step whose diff is recorded (== step: recorded this call)
    "last_compute_step": (torch.int64, -1),  # TaylorSeer: step of the last computed step
    "since_refresh": (torch.int64, 0),       # calls since the generation began or the last forced refresh
    "refreshed": (torch.bool, 0),            # a 'once' forced refresh already happened this generation
    "use_cache": (torch.bool, 0),            # decision of the last call
}


def stream_keys(stream: int, calibrator: Optional[CalibratorConfig] = None) -> List[str]:
    """The state names of stream ``stream``: its stored residual, or its calibrator's state (TaylorSeer's ladder
    and flag, FoCa's four tensors and flags); names ending in ``_valid`` are 0-dim int64 flags."""
    if calibrator is None or not calibrator.stream_enabled(stream):
        return [f"res{stream}"]
    if calibrator.calibrator_type == "foca":
        return foca_keys(stream)
    if calibrator.calibrator_type == "dmd":
        return dmd_keys(stream)
    return [f"ts{stream}_{k}" for k in range(calibrator.taylorseer_order + 1)] + [f"ts{stream}_valid"]


def state_spec(config: DBCacheConfig, calibrator: Optional[CalibratorConfig],
               fn_residual: torch.Tensor, streams: Sequence[torch.Tensor]) -> Dict[str, Tuple[tuple, torch.dtype, float]]:
    """``name -> (shape, dtype, fill)`` of every state tensor, from example tensors (real or fake).

    ``fn_residual``: the Fn residual (image stream). ``streams``: one example per cached middle-block stream
    (image first, then encoder), shaped like the residual that is cached for it.
    """
    spec: Dict[str, Tuple[tuple, torch.dtype, float]] = {k: ((), dt, v) for k, (dt, v) in SCALARS.items()}
    spec["R_prev"] = (tuple(fn_residual.shape), fn_residual.dtype, 0.0)
    for i, s in enumerate(streams):
        spec.update(stream_spec(calibrator, i, s))
    return spec


def stream_spec(calibrator: Optional[CalibratorConfig], stream: int,
                example: torch.Tensor) -> Dict[str, Tuple[tuple, torch.dtype, float]]:
    """``name -> (shape, dtype, fill)`` of stream ``stream``'s entries (:func:`stream_keys`), ``example`` shaped
    like the value cached for it."""
    if calibrator is not None and calibrator.stream_enabled(stream) and calibrator.calibrator_type == "dmd":
        return dmd_spec(stream, example, calibrator.dmd_history)  # its snapshots: [history, *shape]
    return {k: ((), torch.int64, 0) if k.endswith("_valid") else (tuple(example.shape), example.dtype, 0.0)
            for k in stream_keys(stream, calibrator)}


class CacheState:
    """One cache context's tensors between calls. Allocated lazily by :meth:`ensure` from example shapes.

    ``as_tensors()`` / ``update(new)`` are the functional interface a graph uses (state in, state out);
    ``new_generation()`` is the explicit host-side reset (the next call is step 0 of a new generation).
    """

    def __init__(self, config: DBCacheConfig, calibrator: Optional[CalibratorConfig] = None):
        self.config = config
        self.calibrator = calibrator
        self._spec: Optional[Dict[str, Tuple[tuple, torch.dtype, float]]] = None
        self._device: Optional[torch.device] = None
        self._tensors: Optional[Dict[str, torch.Tensor]] = None
        self.num_streams = 0

    @property
    def allocated(self) -> bool:
        return self._tensors is not None

    def ensure(self, fn_residual: torch.Tensor, streams: Sequence[torch.Tensor]) -> "CacheState":
        """Allocate from examples on first use; afterwards check the examples still match."""
        spec = state_spec(self.config, self.calibrator, fn_residual, streams)
        if self._spec is None:
            self._spec, self._device, self.num_streams = spec, fn_residual.device, len(streams)
            self._tensors = self._initial()
        elif spec != self._spec or fn_residual.device != self._device:
            changed = sorted(k for k in set(spec) | set(self._spec) if spec.get(k) != self._spec.get(k))
            raise ValueError(f"CacheState: the cached tensors changed shape/dtype/device ({changed[:4]}); a new "
                             f"input shape needs its own CacheState (or call reallocate() to start over)")
        return self

    def reallocate(self) -> None:
        """Forget the allocation (the next :meth:`ensure` allocates afresh, as a new generation)."""
        self._spec = self._device = self._tensors = None

    def _initial(self) -> Dict[str, torch.Tensor]:
        assert self._spec is not None
        return {k: torch.full(shape, fill, dtype=dt, device=self._device) for k, (shape, dt, fill) in self._spec.items()}

    def new_generation(self) -> None:
        """Reset to the initial state, keeping the generation counter; the next call is step 0."""
        if self._tensors is None:
            return
        gen = self._tensors["gen"]
        self._tensors = self._initial()
        self._tensors["gen"] = gen.clone()

    def as_tensors(self) -> Dict[str, torch.Tensor]:
        if self._tensors is None:
            raise RuntimeError("CacheState: not allocated yet; call ensure(fn_residual, streams) first")
        return dict(self._tensors)

    def update(self, new: Dict[str, torch.Tensor]) -> None:
        """Replace the state with a decide/update output (same keys, shapes, dtypes; checked host-side only)."""
        if self._tensors is None:
            raise RuntimeError("CacheState: not allocated yet; call ensure(fn_residual, streams) first")
        if set(new) != set(self._tensors):
            raise KeyError(f"CacheState.update: keys differ: missing {sorted(set(self._tensors) - set(new))}, "
                           f"unexpected {sorted(set(new) - set(self._tensors))}")
        for k, v in new.items():
            old = self._tensors[k]
            if v.shape != old.shape or v.dtype != old.dtype:
                raise ValueError(f"CacheState.update: '{k}' is {tuple(v.shape)}/{v.dtype}, expected "
                                 f"{tuple(old.shape)}/{old.dtype}")
        self._tensors = dict(new)

    def names(self) -> List[str]:
        return list(self._spec) if self._spec is not None else []


class CacheContexts:
    """name -> :class:`CacheState`, one per cache context.

    ``select(name)`` picks the state for one transformer call. An explicit name (the pipeline's
    ``cache_context("cond")``) is used as is. Without one, and with ``enable_separate_cfg=True``, the
    reference's call-parity rule applies: counting calls from 0 in the generation, with
    ``cfg_compute_first=False`` the odd calls are the CFG branch ("cfg") and the even ones "non_cfg"; with
    ``cfg_compute_first=True`` the other way round. Otherwise the context is "default" (with ``None`` too: the
    graph passes tell the branches apart on the device, :mod:`dit_passes.cache.branches`; this host-side holder does
    not). The parity counter is a host-side call count (no device value), reset by :meth:`new_generation`.
    """

    CFG, NON_CFG, DEFAULT = "cfg", "non_cfg", "default"

    def __init__(self, config: DBCacheConfig, calibrator: Optional[CalibratorConfig] = None):
        self.config = config
        self.calibrator = calibrator
        self._states: Dict[str, CacheState] = {}
        self._calls = 0

    def resolve(self, name: Optional[str] = None) -> str:
        """The context name this call uses (advances the parity counter when parity decides)."""
        if name is not None:
            return name
        if not self.config.enable_separate_cfg:
            return self.DEFAULT
        n = self._calls
        self._calls += 1
        is_cfg = (n % 2 == 0) if self.config.cfg_compute_first else (n % 2 == 1)
        return self.CFG if is_cfg else self.NON_CFG

    def __getitem__(self, name: str) -> CacheState:
        if name not in self._states:
            self._states[name] = CacheState(self.config, self.calibrator)
        return self._states[name]

    def select(self, name: Optional[str] = None) -> Tuple[str, CacheState, Optional[CacheState]]:
        """``(name, state, partner)``: ``partner`` is the non-CFG state whose diff the CFG call reuses when
        ``cfg_diff_compute_separate=False`` (pass its tensors to ``decide(partner=...)``), else None."""
        ctx = self.resolve(name)
        partner = None
        if (ctx == self.CFG and self.config.enable_separate_cfg and not self.config.cfg_diff_compute_separate
                and self.NON_CFG in self._states and self._states[self.NON_CFG].allocated):
            partner = self._states[self.NON_CFG]
        return ctx, self[ctx], partner

    def new_generation(self) -> None:
        for s in self._states.values():
            s.new_generation()
        self._calls = 0

    def items(self) -> Iterator[Tuple[str, CacheState]]:
        return iter(list(self._states.items()))
