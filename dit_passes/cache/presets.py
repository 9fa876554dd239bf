"""Named residual-cache configurations (the demo's and ``dit-passes fidelity``'s presets).

A preset is the cache-dit-compatible configuration pair the ``DBCache`` pass takes,
``DBCache(config=preset.config, calibrator=preset.calibrator)``; this module holds only cache/ code, so
any layer may list them. The step masks depend on the number of denoising steps, hence
``cache_presets(steps)``. Tuned on the trained digits DiT (12 blocks, see ``dit_passes.models.digits``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from .config import DBCacheConfig, TaylorSeerCalibratorConfig
from .steps_mask import steps_mask


@dataclasses.dataclass(frozen=True)
class CachePreset:
    config: DBCacheConfig
    calibrator: Optional[TaylorSeerCalibratorConfig]
    summary: str  # one line: what the preset is, for tables and --list


# the demo's default selection: the reference's defaults, a static step mask, and the mask + TaylorSeer
DEMO_PRESETS = ("dbcache", "fast_mask", "fast_mask_taylorseer")


def cache_presets(steps: int) -> Dict[str, CachePreset]:
    """name -> preset for a run of ``steps`` denoising steps, in the order the demo lists them."""
    taylor = TaylorSeerCalibratorConfig(taylorseer_order=1)

    def mask(policy: str) -> dict:
        return dict(Fn_compute_blocks=1, steps_computation_mask=steps_mask(total_steps=steps, mask_policy=policy),
                    steps_computation_policy="static")

    return {
        "dbcache": CachePreset(DBCacheConfig(), None, "cache-dit defaults F8B0, W8, R0.08"),
        "dbcache_F1B0_R0.24": CachePreset(
            DBCacheConfig(Fn_compute_blocks=1, residual_diff_threshold=0.24, max_warmup_steps=4), None,
            "F1B0, W4, R0.24"),
        "fast_mask": CachePreset(DBCacheConfig(**mask("fast")), None, 'steps mask "fast", static, F1B0'),
        "fast_mask_taylorseer": CachePreset(DBCacheConfig(**mask("fast")), taylor, "fast_mask + TaylorSeer order 1"),
        "ultra_mask_taylorseer": CachePreset(DBCacheConfig(**mask("ultra")), taylor,
                                             'steps mask "ultra" + TaylorSeer order 1'),
    }


__all__ = ["CachePreset", "DEMO_PRESETS", "cache_presets"]
