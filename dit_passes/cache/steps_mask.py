"""Step computation masks (SCM): cache-dit 1.5.3's ``steps_mask`` presets, same signature and lists.

A mask holds one entry per step, 1 = the step must compute, 0 = it may be cached. It is built from
alternating runs ``compute_bins[0]`` ones, ``cache_bins[0]`` zeros, ``compute_bins[1]`` ones, ... cut to
``total_steps``. The presets are defined for 28 steps and rescaled to other step counts by the reference's
rules (widened above 28, shortened from 16 to 27, dedicated tables for 8 to 15 and for 4 / 6 steps); a
preset's last step always computes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

Bins = Tuple[List[int], List[int]]
POLICIES = ("slow", "medium", "fast", "ultra")


def _presets_28() -> Dict[str, Bins]:
    # Sums: compute 18/15/11/8 and cache 10/13/17/20 of 28 steps.
    return {"slow": ([8, 3, 3, 2, 1, 1], [1, 2, 2, 2, 3]), "medium": ([6, 2, 2, 2, 2, 1], [1, 3, 3, 3, 3]),
            "fast": ([6, 1, 1, 1, 1, 1], [1, 3, 4, 5, 4]), "ultra": ([4, 1, 1, 1, 1], [2, 5, 6, 7])}


def _presets_9_to_15() -> Dict[str, Bins]:
    return {"slow": ([4, 2, 2, 2, 1], [1, 1, 1, 1]), "medium": ([4, 2, 1, 1, 1], [1, 1, 2, 2]),
            "fast": ([3, 1, 1, 1, 1], [1, 2, 2, 3]), "ultra": ([2, 1, 1, 1, 1], [1, 2, 3, 3])}


def _presets_9() -> Dict[str, Bins]:  # the reference's table for 9-step distilled models (Z-Image-Turbo)
    return {"slow": ([5, 2, 1], [1]), "medium": ([5, 1, 1], [1, 1]), "fast": ([4, 1, 1], [1, 2]),
            "ultra": ([3, 1, 1], [2, 2])}


def _presets_8() -> Dict[str, Bins]:
    return {"slow": ([5, 1, 1], [1]), "medium": ([4, 1, 1], [1, 1]), "fast": ([3, 1, 1], [1, 2]),
            "ultra": ([2, 1, 1], [2, 2])}


def _total(bins: Bins) -> int:
    return sum(bins[0]) + sum(bins[1])


def _shrink(bins: Bins, target: int) -> Bins:
    """Trim the last cache run, then the last compute run, alternately, until the bins fit ``target``."""
    compute, cache = list(bins[0]), list(bins[1])
    while sum(compute) + sum(cache) > target:
        for runs in (cache, compute):
            if runs:
                runs[-1] -= 1
                if runs[-1] == 0:
                    runs.pop()
            if sum(compute) + sum(cache) <= target:
                break
    return compute, cache


def _widen(bins: Bins, target: int) -> Bins:
    """Grow each run pair by a step proportional to its 28-step size until the bins cover ``target``."""
    base_compute, base_cache = list(bins[0]), list(bins[1])
    compute, cache = list(bins[0]), list(bins[1])
    pairs = min(len(compute), len(cache))
    scale = (target / 28) * 0.5
    while sum(compute) + sum(cache) < target:
        covered = False
        for i in range(pairs):
            compute[i] += max(int(base_compute[i] * scale), 1)
            if sum(compute) + sum(cache) >= target:
                covered = True
                break
            cache[i] += max(int(base_cache[i] * scale), 1)
            if sum(compute) + sum(cache) >= target:
                covered = True
                break
        if covered:
            break
        compute[-1] += 1  # the compute list is one run longer; its tail grows by one per round
    return compute, cache


def _presets_for(total_steps: int) -> Dict[str, Bins]:
    if total_steps > 28:
        return {k: _shrink(_widen(b, total_steps), total_steps) for k, b in _presets_28().items()}
    if total_steps == 28:
        return _presets_28()
    if total_steps >= 16:
        return {k: _shrink(b, total_steps) for k, b in _presets_28().items()}
    if total_steps >= 8:
        table = _presets_8() if total_steps == 8 else _presets_9() if total_steps == 9 else _presets_9_to_15()
        return {k: _shrink(b, total_steps) for k, b in table.items()}
    if total_steps == 4:
        bins: Bins = ([2, 1], [1])
    elif total_steps == 6:
        bins = ([3, 1], [2])
    else:
        raise ValueError(f"steps_mask: presets exist for total_steps >= 8 and for 4 or 6 steps, got {total_steps}; "
                         f"pass compute_bins / cache_bins for other step counts")
    return {k: (list(bins[0]), list(bins[1])) for k in POLICIES}


def _check_bins(name: str, bins: Sequence[int]) -> List[int]:
    if not isinstance(bins, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                                      for b in bins):
        raise ValueError(f"steps_mask: {name} must be a list of ints >= 0, got {bins!r}")
    return list(bins)


def bins_to_mask(compute_bins: Sequence[int], cache_bins: Sequence[int],
                 total_steps: Optional[int] = None) -> List[int]:
    """Alternate ``compute_bins[i]`` ones and ``cache_bins[i]`` zeros, cut to ``total_steps`` (default: all)."""
    compute, cache = _check_bins("compute_bins", compute_bins), _check_bins("cache_bins", cache_bins)
    covered = sum(compute) + sum(cache)
    if total_steps is None:
        total_steps = covered
    elif covered < total_steps:
        raise ValueError(f"steps_mask: compute_bins + cache_bins cover {covered} steps, fewer than "
                         f"total_steps={total_steps}; lengthen the bins")
    mask: List[int] = []
    for i in range(max(len(compute), len(cache))):
        if i < len(compute):
            mask += [1] * compute[i]
        if i < len(cache):
            mask += [0] * cache[i]
        if len(mask) >= total_steps:
            break
    return mask[:total_steps]


def steps_mask(compute_bins: Optional[List[int]] = None, cache_bins: Optional[List[int]] = None,
               total_steps: Optional[int] = None, mask_policy: Optional[str] = "medium") -> List[int]:
    """The reference's ``cache_dit.steps_mask``: explicit bins (both given) or a preset for ``total_steps``.

    Differences, all on input the reference mishandles: exactly one of the two bin lists raises (the
    reference silently ignores it and uses the preset); bad values raise ``ValueError`` instead of
    ``AssertionError``.
    """
    if (compute_bins is None) != (cache_bins is None):
        raise ValueError("steps_mask: give both compute_bins and cache_bins, or neither (to use mask_policy)")
    if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool)
                                    or total_steps < 1):
        raise ValueError(f"steps_mask: total_steps must be an int >= 1, got {total_steps!r}")
    if compute_bins is not None:
        return bins_to_mask(compute_bins, cache_bins, total_steps)
    if total_steps is None:
        raise ValueError("steps_mask: total_steps is required with a mask_policy preset")
    if mask_policy not in POLICIES:
        raise ValueError(f"steps_mask: mask_policy={mask_policy!r} is not one of {list(POLICIES)}")
    compute, cache = _presets_for(total_steps)[mask_policy]
    mask = bins_to_mask(compute, cache, total_steps)
    mask[-1] = 1  # the last step always computes
    return mask
