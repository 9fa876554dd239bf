"""The DBCache step decision, as pure tensor code (no host sync), equal to cache-dit 1.5.3's.

Reference: ``CachedContext.mark_step_begin`` (cache_context.py:146-221), ``CachedContextManager.can_cache``
(cache_manager.py:862-955) and ``similarity`` (cache_manager.py:553-626), called from
``CachedBlocks_Pattern_Base.forward`` (pattern_base.py:238-367). Checks, first match wins:

1. warm-up: ``step in range(0, W, warmup_interval)``, W cut to the mask's leading 1s when a mask is set -> compute
2. steps_computation_mask: slot 1 -> compute; slot 0 (or past the mask's end) with "static" -> cache
3. ``max_cached_steps >= 0`` and cached steps this generation ``>=`` it -> compute
4. ``max_continuous_cached_steps >= 0`` and the current run of cached steps ``>=`` it -> compute
5. ``max_accumulated_residual_diff_threshold > 0`` and the sum of positive diffs ``>=`` it -> compute
6. ``residual_diff_threshold <= 0`` -> compute
7. no stored Fn residual (nothing computed yet in this generation) -> compute
8. ``residual_diff_threshold >= 1`` -> cache (diff recorded as -1.0)
9. cache iff ``mean(|R_prev - R|) / mean(|R_prev|) < threshold`` (computed in R's dtype, compared in
   float64 like the reference's ``.item()`` floats); with separate CFG and ``cfg_diff_compute_separate=False``
   the CFG call reuses the non-CFG call's diff of the same step when there is one.

Only steps reaching 8/9 record a diff; positive recorded diffs add to the accumulated diff. ``R_prev`` is
written on computed steps only. Every state tensor is replaced with ``torch.where``; nothing is mutated.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .config import CalibratorConfig, DBCacheConfig
from .state import NO_STEP, SCALARS, stream_keys
from .dmd import dmd_after_call, dmd_predict
from .foca import foca_after_call, foca_predict
from .taylorseer import taylor_predict, taylor_update

State = Dict[str, torch.Tensor]
AllReduce = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]

# Scalars a new generation keeps; every other scalar returns to its initial value. Big tensors are not
# reset: has_prev=False and the always-computed step 0 guarantee they are written before being read.
_KEEP_ON_RESET = ("gen", "refreshed", "last_t")
_DIRECTIONS = ("decreasing", "increasing", "none")


def _scalar(value, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((), value, dtype=dtype, device=like.device)


Static = Union[bool, torch.Tensor]  # a check's answer: known when the graph is built (bool) or on device


def _as_tensor(value: Static, like: torch.Tensor) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.full((), value, dtype=torch.bool, device=like.device)


def _reset_to(t: torch.Tensor, reset: torch.Tensor, keep: torch.Tensor, init) -> torch.Tensor:
    """``init`` where ``reset``, else ``t`` (one kernel; a bool stays bool)."""
    if t.dtype == torch.bool:
        return t & keep if not init else t | reset
    return torch.where(reset, init, t)


def _timestep_value(timestep, like: torch.Tensor) -> Optional[torch.Tensor]:
    if timestep is None:
        return None
    if not isinstance(timestep, torch.Tensor):
        return _scalar(float(timestep), like, torch.float64)
    # A per-sample timestep vector: the samples share the schedule, the first one stands for all.
    return timestep.detach().reshape(-1)[0].to(device=like.device, dtype=torch.float64)


def _mask_slot_is_one(mask: Sequence[int], step: torch.Tensor) -> torch.Tensor:
    """``step < len(mask) and mask[step] == 1`` on device. The mask is packed into 62-bit words built with
    fill kernels: a ``torch.tensor(mask)`` would be a host-to-device copy on every call, and ``m[step]``
    reads ``step`` on the host."""
    out = torch.zeros((), dtype=torch.bool, device=step.device)
    for start in range(0, len(mask), 62):
        chunk = mask[start:start + 62]
        word = torch.full((), sum(1 << i for i, m in enumerate(chunk) if m == 1), dtype=torch.int64,
                          device=step.device)
        inside = (step >= start) & (step < start + len(chunk))
        bit = (word >> (step - start).clamp(0, len(chunk) - 1)) & 1
        out = out | (inside & (bit == 1))
    return out


def generation_starts(state: State, timestep, num_inference_steps: Optional[int] = None,
                      direction: str = "decreasing") -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(new_gen, t, calls_done)`` for this call: a new generation starts on the first call (``step < 0``),
    when the timestep ``t`` moves against the schedule (``direction``), or after ``num_inference_steps`` calls."""
    calls_done = state["step"] + 1
    new_gen = state["step"] < 0
    t = _timestep_value(timestep, state["step"])
    if t is not None and direction != "none":
        moved_back = (t > state["last_t"]) if direction == "decreasing" else (t < state["last_t"])
        new_gen = new_gen | moved_back  # NaN last_t (first call) compares False
    if num_inference_steps is not None:
        new_gen = new_gen | (calls_done >= num_inference_steps)
    return new_gen, t, calls_done


def start_call(state: State, timestep, config: DBCacheConfig,
               timestep_direction: str = "decreasing") -> Tuple[State, torch.Tensor]:
    """``(state, step)`` at the start of a call (the reference's ``mark_step_begin``): a new generation or a
    forced refresh resets every scalar of :data:`SCALARS` (but ``gen`` / ``refreshed`` / ``last_t``) and every
    ``*_valid`` flag (TaylorSeer ladders, DBPrune's stored block inputs); the step advances; a step that
    does not follow a cached one ends the run of cached steps."""
    s = dict(state)
    # -- new generation / forced refresh (the reference recreates its context: everything restarts) --------
    new_gen, t, calls_done = generation_starts(s, timestep, config.num_inference_steps, timestep_direction)
    reset = new_gen
    if config.force_refresh_step_hint is not None:
        due = calls_done == config.force_refresh_step_hint
        if config.force_refresh_step_policy == "once":
            due = due & ~s["refreshed"]
        refresh = due & ~new_gen
        reset = new_gen | refresh
        s["refreshed"] = torch.where(new_gen, torch.zeros_like(s["refreshed"]), s["refreshed"] | refresh)
    keep = ~reset
    for k, (dt, init) in SCALARS.items():
        if k not in _KEEP_ON_RESET and k != "step":
            s[k] = _reset_to(s[k], reset, keep, init)
    for k in state:
        if k.endswith("_valid"):  # nothing defined after a reset
            s[k] = torch.where(reset, 0, s[k])
    s["gen"] = s["gen"] + reset  # int64 + bool: int64
    step = torch.where(reset, 0, calls_done)
    s["step"] = step
    if t is not None:
        s["last_t"] = t

    # A compute step breaks the run of cached steps (mark_step_begin).
    s["continuous"] = torch.where(s["last_cached_step"] != step - 1, 0, s["continuous"])
    return s, step


def decide(state: State, fn_residual: torch.Tensor, timestep, config: DBCacheConfig, *,
           allreduce: Optional[AllReduce] = None, partner: Optional[State] = None,
           timestep_direction: str = "decreasing") -> Tuple[torch.Tensor, State, torch.Tensor]:
    """One call's cache decision. Returns ``(use_cache, new_state, diff)``.

    ``state``: this context's tensors (``CacheState.as_tensors()``). ``fn_residual``: R = (hidden after the
    Fn blocks) - (hidden entering the block range). ``timestep``: the call's timestep (tensor, number or
    None); a new generation starts on the first call, when the timestep moves against the schedule
    (``timestep_direction="decreasing"``: it rises; "increasing": it falls; "none": never), or when
    ``config.num_inference_steps`` calls are done; ``force_refresh_step_hint`` also restarts the state.
    ``allreduce(num, den) -> (num, den)``: averages both means over a parallel group before the division.
    ``partner``: the non-CFG context's state after its call of this step (only for separate CFG with
    ``cfg_diff_compute_separate=False``; ``CacheContexts.select`` gives it). ``diff``: float64, the diff
    recorded by this call (-1.0 for threshold >= 1), NaN when none was recorded.
    ``use_cache`` is a 0-dim bool tensor; ``new_state`` has the same keys, shapes and dtypes as ``state``.
    """
    if timestep_direction not in _DIRECTIONS:
        raise ValueError(f"decide: timestep_direction={timestep_direction!r} must be one of {_DIRECTIONS}")
    if partner is not None and not (config.enable_separate_cfg is not False and not config.cfg_diff_compute_separate):
        raise ValueError("decide: partner= is only meaningful with enable_separate_cfg=True (or None: branches "
                         "told apart in the graph) and cfg_diff_compute_separate=False")
    missing = [k for k in tuple(SCALARS) + ("R_prev",) if k not in state]
    if missing:
        raise KeyError(f"decide: state lacks {missing}; build it with CacheState.ensure(...).as_tensors()")
    s = dict(state)
    dev_like = s["step"]

    s, step = start_call(s, timestep, config, timestep_direction)

    # -- the checks, first match wins ----------------------------------------------------------------------
    # ``decided`` / ``result`` are Python bools while no check has answered on the device (most checks are
    # static for a given config: they fold away here instead of costing a kernel per call).
    decided: Static = False
    result: Static = False
    true = True

    def settle(cond: Static, value: bool) -> None:
        nonlocal decided, result
        if decided is True:
            return
        if value:
            take = cond if decided is False else (~decided & cond if cond is not True else ~decided)
            result = take if result is False else result | take
        decided = cond if decided is False or cond is True else decided | cond

    w = config.warmup_limit()
    if w > 0:
        settle((step < w) & (step % config.warmup_interval == 0), False)
    mask = config.steps_computation_mask
    if mask is not None:
        slot_is_one = _mask_slot_is_one(mask, step)
        settle(slot_is_one, False)
        if config.steps_computation_policy == "static":
            settle(true, True)
    if config.max_cached_steps >= 0:
        settle(s["cached_count"] >= config.max_cached_steps, False)
    if config.max_continuous_cached_steps >= 0:
        settle(s["continuous"] >= config.max_continuous_cached_steps, False)
    acc_cap = config.max_accumulated_residual_diff_threshold
    if acc_cap is not None and acc_cap > 0.0:
        settle(s["acc_diff"] >= acc_cap, False)
    threshold = float(config.residual_diff_threshold)
    if threshold <= 0.0:
        settle(true, False)
    settle(~s["has_prev"], False)

    r_prev = s["R_prev"]
    if decided is True:  # statically never reaches `similarity` (e.g. threshold <= 0): no diff to compute
        use_cache = _as_tensor(result, dev_like)
        s["cached_count"] = s["cached_count"] + use_cache
        s["continuous"] = s["continuous"] + use_cache
        s["last_cached_step"] = torch.where(use_cache, step, s["last_cached_step"])
        s["R_prev"] = torch.where(use_cache, r_prev, fn_residual.to(r_prev.dtype))
        s["has_prev"] = s["has_prev"] | ~use_cache
        s["use_cache"] = use_cache
        return use_cache, s, _scalar(float("nan"), dev_like, torch.float64)
    record = _as_tensor(True, dev_like) if decided is False else ~decided  # the call reaches `similarity`
    if threshold >= 1.0:
        diff = _scalar(-1.0, dev_like, torch.float64)
        similar = True
    else:
        num = (r_prev - fn_residual).abs().mean()
        den = r_prev.abs().mean()
        if allreduce is not None:
            num, den = allreduce(num, den)
        diff = (num / den).to(torch.float64)
        if partner is not None:
            # The non-CFG call of this very step recorded a diff (its step and diff_step both equal ours).
            same_step = (partner["step"] == step) & (partner["diff_step"] == step)
            diff = torch.where(same_step, partner["diff"], diff)
        similar = diff < threshold
    # Calls that reach the similarity test take its answer; the others keep the earlier check's answer.
    if similar is True:
        use_cache = record if result is False else record | result
    elif result is False:
        use_cache = record & similar
    else:
        use_cache = torch.where(record, similar, result)

    # -- bookkeeping ------------------------------------------------------------------------------------------
    s["diff"] = torch.where(record, diff, s["diff"])
    s["diff_step"] = torch.where(record, step, s["diff_step"])
    s["acc_diff"] = torch.where(record & (diff > 0.0), s["acc_diff"] + diff, s["acc_diff"])
    s["cached_count"] = s["cached_count"] + use_cache  # int64 + bool: int64
    s["continuous"] = s["continuous"] + use_cache
    s["last_cached_step"] = torch.where(use_cache, step, s["last_cached_step"])
    s["R_prev"] = torch.where(use_cache, r_prev, fn_residual.to(r_prev.dtype))
    s["has_prev"] = s["has_prev"] | ~use_cache
    s["use_cache"] = use_cache
    out_diff = torch.where(record, diff, float("nan"))
    return use_cache, s, out_diff


# -- the cached values: what a cache hit applies, and what a computed step stores ----------------------------
def _calibrated(calibrator: Optional[CalibratorConfig], stream: int) -> bool:
    return calibrator is not None and calibrator.stream_enabled(stream)


def stores_hidden_states(calibrator: Optional[CalibratorConfig], stream: int) -> bool:
    """Whether stream ``stream`` caches the middle blocks' output (else their residual), as the reference."""
    return _calibrated(calibrator, stream) and calibrator.calibrator_cache_type == "hidden_states"


def middle_cache_values(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                        calibrator: Optional[CalibratorConfig] = None) -> List[torch.Tensor]:
    """Per stream, what a computed step caches: ``after - before`` (residual) or ``after`` (hidden states)."""
    return [a if stores_hidden_states(calibrator, i) else a - b for i, (b, a) in enumerate(zip(before, after))]


def hit_values(state: State, num_streams: int,
               calibrator: Optional[CalibratorConfig] = None) -> List[torch.Tensor]:
    """Per stream, the cached value a cache hit uses: the stored one, or the calibrator's prediction (TaylorSeer,
    FoCa, DMD). ``state``: the state ``decide`` returned for this call (its step is this call's step), or the part
    of it the prediction reads (``DBCacheProgram.hit_keys``: the graph calls this in its cached arm only)."""
    out = []
    for i in range(num_streams):
        if _calibrated(calibrator, i) and calibrator.calibrator_type == "foca":
            out.append(foca_predict(state, i, state["step"] - state["last_compute_step"]))
        elif _calibrated(calibrator, i) and calibrator.calibrator_type == "dmd":
            out.append(dmd_predict(state, i, state["step"], state["last_compute_step"], calibrator.dmd_rank,
                                   calibrator.dmd_ridge, calibrator.dmd_svd_precision))
        elif _calibrated(calibrator, i):
            keys = stream_keys(i, calibrator)
            out.append(taylor_predict([state[k] for k in keys[:-1]], state[keys[-1]], state["step"],
                                      state["last_compute_step"]))
        else:
            out.append(state[f"res{i}"])
    return out


def apply_hit(fn_streams: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
              calibrator: Optional[CalibratorConfig] = None) -> List[torch.Tensor]:
    """The streams after a cache hit: ``value + h`` for residuals, ``value`` for cached hidden states."""
    return [v if stores_hidden_states(calibrator, i) else v + h for i, (h, v) in enumerate(zip(fn_streams, values))]


def update_after_branch(state: State, use_cache: torch.Tensor, values: Sequence[torch.Tensor],
                        calibrator: Optional[CalibratorConfig] = None) -> State:
    """The state after the branch. ``values``: per stream, what the branch produced: :func:`middle_cache_values`
    on a computed step, the :func:`hit_values` on a cached one (the cached arm forms or receives them and returns
    them; only FoCa reads them there; DMD records computed values only). Computed step: store them (or advance the
    calibrator); cached step: keep everything but FoCa's rolling pair, which takes the prediction."""
    s = dict(state)
    compute = ~use_cache
    for i, v in enumerate(values):
        if _calibrated(calibrator, i) and calibrator.calibrator_type == "foca":
            s.update(foca_after_call(s, i, use_cache, v))
        elif _calibrated(calibrator, i) and calibrator.calibrator_type == "dmd":
            s.update(dmd_after_call(s, i, use_cache, v, s["step"], s["last_compute_step"]))
        elif _calibrated(calibrator, i):
            keys = stream_keys(i, calibrator)
            ladder, valid = [s[k] for k in keys[:-1]], s[keys[-1]]
            new, new_valid = taylor_update(ladder, valid, v.to(ladder[0].dtype), s["step"], s["last_compute_step"])
            for k, old, nv in zip(keys[:-1], ladder, new):
                s[k] = torch.where(compute, nv, old)
            s[keys[-1]] = torch.where(compute, new_valid, valid)
        else:
            key = f"res{i}"
            if key not in s:
                raise KeyError(f"update_after_branch: state has no '{key}' (stream {i}); allocate the state with "
                               f"one example per cached stream")
            s[key] = torch.where(compute, v.to(s[key].dtype), s[key])
    s["last_compute_step"] = torch.where(compute, s["step"], s["last_compute_step"])
    return s


__all__ = ["decide", "start_call", "generation_starts", "middle_cache_values", "hit_values", "apply_hit", "update_after_branch",
           "stores_hidden_states", "NO_STEP"]
