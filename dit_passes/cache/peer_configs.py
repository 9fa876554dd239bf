"""Configs of diffusers 0.42's block-range caches, as ours: ``FirstBlockCacheConfig`` and ``MagCacheConfig``.

Same class names, field names and defaults as ``diffusers.hooks.FirstBlockCacheConfig`` /
``diffusers.hooks.MagCacheConfig``, so a user's config carries over (:func:`from_peer` converts one of
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


PEER_CONFIGS = (FirstBlockCacheConfig, MagCacheConfig)


def from_peer(cfg: Any) -> Any:
    """Our config for ``cfg``: one of ours (copied), or diffusers' class of the same name (converted field by
    field); None when ``cfg`` is neither."""
    for cls in PEER_CONFIGS:
        if isinstance(cfg, cls):
            return dataclasses.replace(cfg)
        if type(cfg).__name__ == cls.__name__:
            return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})
    return None


__all__ = ["FirstBlockCacheConfig", "MagCacheConfig", "resample_nearest", "from_peer", "PEER_CONFIGS"]
