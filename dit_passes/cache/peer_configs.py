"""Configs of diffusers 0.42's caches, as ours: ``FirstBlockCacheConfig``, ``MagCacheConfig``, ``TaylorSeerCacheConfig``
(``SeaCacheConfig`` and the paper-defined ``TeaCacheConfig``: :mod:`.peer_configs_gating`, re-exported here).

Same class names, field names and defaults as ``diffusers.hooks.FirstBlockCacheConfig`` /
``MagCacheConfig`` / ``TaylorSeerCacheConfig``, so a user's config carries over (:func:`from_peer` converts one of
diffusers' objects). Values are checked when the config is built, naming the field.

MagCache's ``mag_ratios`` are resampled to ``num_inference_steps`` entries by nearest index when their
length differs, as diffusers does (index ``round(i * (len - 1) / (steps - 1))``, rounded half to even in
float32); their dtype is kept (a list becomes float32), since the accumulated ratio and error are computed
in it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple, Union

import torch

from .peer_configs_gating import SeaCacheConfig, TeaCacheConfig


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass
class FirstBlockCacheConfig:
    """diffusers' First Block Cache: skip every block after the first while the first block's residual
    changes (relative mean absolute difference to the last computed step's) by at most ``threshold``."""

    threshold: float = 0.05

    def __post_init__(self) -> None:
        if not _is_number(self.threshold):
            raise TypeError(f"FirstBlockCacheConfig.threshold must be a float, got {self.threshold!r}")
        self.threshold = float(self.threshold)

    def strify(self) -> str:
        return f"FBCache_R{self.threshold}"


def resample_nearest(ratios: torch.Tensor, length: int) -> torch.Tensor:
    """``ratios`` resampled to ``length`` entries by nearest index (diffusers' rule for ``mag_ratios``)."""
    if length == 1:
        return ratios[-1:]
    scale = (len(ratios) - 1) / (length - 1)
    index = torch.round(torch.arange(length, dtype=torch.float32) * scale).long()
    return ratios[index]


@dataclasses.dataclass
class MagCacheConfig:
    """diffusers' MagCache: after the first ``retention_ratio`` of the steps, skip the whole block range
    (output = input + the last computed residual) while the accumulated error of the stored magnitude
    ratios stays ``<= threshold`` and at most ``max_skip_steps`` steps were skipped in a row.
    ``calibrate=True`` never skips and records the ratios of this model instead (``report("mag_cache")
    .mag_ratios()``)."""

    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    num_inference_steps: int = 28
    mag_ratios: Optional[Union[torch.Tensor, List[float]]] = None
    calibrate: bool = False

    def __post_init__(self) -> None:
        if not _is_number(self.threshold):
            raise TypeError(f"MagCacheConfig.threshold must be a float, got {self.threshold!r}")
        if not _is_int(self.max_skip_steps) or self.max_skip_steps < 0:
            raise ValueError(f"MagCacheConfig.max_skip_steps={self.max_skip_steps!r}: use an int >= 0")
        if not _is_number(self.retention_ratio) or not 0.0 <= self.retention_ratio <= 1.0:
            raise ValueError(f"MagCacheConfig.retention_ratio={self.retention_ratio!r}: use a float in [0, 1]")
        if not _is_int(self.num_inference_steps) or self.num_inference_steps < 1:
            raise ValueError(f"MagCacheConfig.num_inference_steps={self.num_inference_steps!r}: use an int >= 1")
        if not isinstance(self.calibrate, bool):
            raise TypeError(f"MagCacheConfig.calibrate must be a bool, got {self.calibrate!r}")
        if self.mag_ratios is None and not self.calibrate:
            raise ValueError("MagCacheConfig: mag_ratios are needed (they depend on the model and scheduler); run "
                             "once with MagCacheConfig(calibrate=True, num_inference_steps=N), read "
                             "compiled.report('mag_cache').mag_ratios() and pass them as mag_ratios=")
        if self.mag_ratios is not None and not self.calibrate:
            r = self.mag_ratios if torch.is_tensor(self.mag_ratios) else torch.tensor(self.mag_ratios)
            if r.dim() != 1 or len(r) == 0 or not r.is_floating_point():
                raise ValueError(f"MagCacheConfig.mag_ratios must be a non-empty 1-D list / tensor of floats, got "
                                 f"shape {tuple(r.shape)} {r.dtype}")
            self.mag_ratios = r if len(r) == self.num_inference_steps else resample_nearest(r, self.num_inference_steps)

    @property
    def retention_steps(self) -> int:
        """Steps at the start of a generation that never skip."""
        return int(self.retention_ratio * self.num_inference_steps + 0.5)

    def ratio_table(self) -> Tuple[Tuple[float, ...], torch.dtype]:
        """The ratios as host floats and their dtype (the state table the graph reads); ones when calibrating."""
        if self.calibrate:
            return (1.0,) * self.num_inference_steps, torch.float32
        r = self.mag_ratios.detach().cpu()
        return tuple(float(x) for x in r.tolist()), r.dtype

    def strify(self) -> str:
        if self.calibrate:
            return f"MagCache_calibrate_N{self.num_inference_steps}"
        return (f"MagCache_R{self.threshold}_K{self.max_skip_steps}_RR{self.retention_ratio}"
                f"_N{self.num_inference_steps}")


@dataclasses.dataclass
class TaylorSeerCacheConfig:
    """diffusers' TaylorSeer cache: each attention module (module names matching ``cache_identifiers``, by
    default diffusers' ``^transformer_blocks.*attn`` family of patterns) runs on the first
    ``disable_cache_before_step`` steps, then on every ``cache_interval``-th step (and on every step from
    ``disable_cache_after_step``); other steps predict its outputs by a Taylor series of order ``max_order`` from
    the factors stored (in ``taylor_factors_dtype``) at its computed steps. ``skip_predict_identifiers`` and
    ``use_lite_mode`` are not implemented by the pass (refused)."""

    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: Optional[int] = None
    max_order: int = 1
    taylor_factors_dtype: Optional[torch.dtype] = torch.bfloat16
    skip_predict_identifiers: Optional[List[str]] = None
    cache_identifiers: Optional[List[str]] = None
    use_lite_mode: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("cache_interval", 1), ("disable_cache_before_step", 0), ("max_order", 0)):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ValueError(f"TaylorSeerCacheConfig.{name}={v!r}: use an int >= {lo}")
        after = self.disable_cache_after_step
        if after is not None and (not _is_int(after) or after < 0):
            raise ValueError(f"TaylorSeerCacheConfig.disable_cache_after_step={after!r}: use None or an int >= 0")
        if self.disable_cache_before_step == 0 and (-1) % self.cache_interval != 0 and (after is None or after > 0):
            # step 0 would predict with nothing stored (diffusers raises there, mid-generation)
            raise ValueError("TaylorSeerCacheConfig: disable_cache_before_step=0 predicts step 0 from nothing; use "
                             "disable_cache_before_step >= 1 (or cache_interval=1)")
        if self.taylor_factors_dtype is not None and not isinstance(self.taylor_factors_dtype, torch.dtype):
            raise TypeError(f"TaylorSeerCacheConfig.taylor_factors_dtype must be a torch.dtype or None, got "
                            f"{self.taylor_factors_dtype!r}")

    def strify(self) -> str:
        return (f"TaylorSeer_I{self.cache_interval}_B{self.disable_cache_before_step}"
                f"_A{self.disable_cache_after_step}_O{self.max_order}")


PEER_CONFIGS = (FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig, SeaCacheConfig, TeaCacheConfig)


def from_peer(cfg: Any) -> Any:
    """Our config for ``cfg``: one of ours (copied), or diffusers' class of the same name (converted field by
    field); None when ``cfg`` is neither."""
    for cls in PEER_CONFIGS:
        if isinstance(cfg, cls):
            return dataclasses.replace(cfg)
        if type(cfg).__name__ == cls.__name__:
            return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})
    return None


__all__ = ["FirstBlockCacheConfig", "MagCacheConfig", "TaylorSeerCacheConfig", "SeaCacheConfig", "TeaCacheConfig",
           "resample_nearest", "from_peer", "PEER_CONFIGS"]
