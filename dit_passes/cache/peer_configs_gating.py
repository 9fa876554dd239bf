"""Configs of the two accumulated-distance gates: ``SeaCacheConfig`` (diffusers 0.42) and ``TeaCacheConfig`` (paper).

``SeaCacheConfig``: diffusers' class name, field names and defaults (``diffusers.hooks.SeaCacheConfig``), plus
two fields of ours that stand for what diffusers reads from the pipeline's ``cache_context(name, step_index=,
sigma=, num_inference_steps=)`` (the compiled module counts the steps on the device instead):
``num_inference_steps`` (needed when ``cache_end_steps > 0``) and ``timestep_scale`` (sigma = the
transformer's timestep input / ``timestep_scale``: 1.0 where the pipeline passes sigma itself, as Flux's
and QwenImage's do, 1000.0 for Wan's). ``raw_vision_callback`` (a host function) is refused: the pass builds
the indicator from the transformer's ``hidden_states`` input in the graph.

``TeaCacheConfig``: TeaCache (Liu et al. 2024, "Timestep Embedding Tells: It's Time to Cache for Video
Diffusion Model"). No diffusers hook exists; the fields are the paper's (``rel_l1_thresh`` is
``threshold``, the rescaling polynomial is ``coefficients``, highest degree first, default the paper's
FLUX.1 fit; ``num_inference_steps``: the last step always computes).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Tuple


def _number(cls: str, name: str, v: Any, lo: float = -math.inf, strict: bool = False) -> float:
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v > lo if strict else v >= lo))
    if not ok:
        raise ValueError(f"{cls}.{name}={v!r}: use a finite number {'>' if strict else '>='} {lo}")
    return float(v)


def _count(cls: str, name: str, v: Any, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{cls}.{name}={v!r}: use an int >= {lo}")
    return v


@dataclasses.dataclass
class SeaCacheConfig:
    """diffusers' SeaCache: skip the whole block range while the accumulated relative L1 change of the SEA
    indicator (the input latents through a sigma-dependent spectral filter) stays below ``threshold``; the
    skipped range adds the last computed residual (``residual_order=1``: extrapolated linearly from the last
    two). The first ``retention_steps`` and last ``cache_end_steps`` steps compute, and at most
    ``max_consecutive_cached`` steps in a row skip (0: no cap)."""

    threshold: float = 0.25
    residual_order: int = 1
    retention_steps: int = 1
    cache_end_steps: int = 1
    max_consecutive_cached: int = 2
    power_exp: float = 3.0
    raw_vision_callback: Optional[Callable] = None
    num_inference_steps: Optional[int] = None  # ours: diffusers reads it from the cache context
    timestep_scale: float = 1.0                # ours: sigma = timestep / timestep_scale

    def __post_init__(self) -> None:
        c = "SeaCacheConfig"
        self.threshold = _number(c, "threshold", self.threshold, 0.0)
        if self.residual_order not in (0, 1) or isinstance(self.residual_order, bool):
            raise ValueError(f"{c}.residual_order={self.residual_order!r}: use 0 or 1")
        for name in ("retention_steps", "cache_end_steps", "max_consecutive_cached"):
            _count(c, name, getattr(self, name))
        self.power_exp = _number(c, "power_exp", self.power_exp, 0.0, strict=True)
        self.timestep_scale = _number(c, "timestep_scale", self.timestep_scale, 0.0, strict=True)
        if self.num_inference_steps is not None:
            _count(c, "num_inference_steps", self.num_inference_steps, 1)
        if self.raw_vision_callback is not None:
            raise ValueError(f"{c}.raw_vision_callback: a host callback cannot run inside the graph; the pass builds "
                             f"the indicator from the transformer's hidden_states input (5-D [B, C, T, H, W] as "
                             f"diffusers' Wan adapter, 4-D [B, C, H, W], or 3-D [B, L, D] tokens on a square grid)")
        if self.cache_end_steps > 0 and self.num_inference_steps is None:
            raise ValueError(f"{c}: cache_end_steps={self.cache_end_steps} needs num_inference_steps=N (diffusers "
                             f"reads N from the pipeline's cache_context; the compiled module counts steps on the "
                             f"device): use dit_passes.SeaCacheConfig(..., num_inference_steps=N), or "
                             f"cache_end_steps=0")

    def strify(self) -> str:
        return (f"SeaCache_R{self.threshold}_O{self.residual_order}_W{self.retention_steps}_E{self.cache_end_steps}"
                f"_M{self.max_consecutive_cached}_N{self.num_inference_steps}")


# TeaCache's FLUX.1 rescaling polynomial (the paper's repository, TeaCache4FLUX), highest degree first.
TEACACHE_FLUX_COEFFICIENTS = (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01)


@dataclasses.dataclass
class TeaCacheConfig:
    """TeaCache (paper): skip the whole block range while the accumulated rescaled relative L1 change of the
    first block's timestep-modulated input stays below ``threshold``; the first and the last of
    ``num_inference_steps`` steps always compute."""

    threshold: float = 0.25
    num_inference_steps: int = 28
    coefficients: Tuple[float, ...] = TEACACHE_FLUX_COEFFICIENTS

    def __post_init__(self) -> None:
        c = "TeaCacheConfig"
        self.threshold = _number(c, "threshold", self.threshold)
        _count(c, "num_inference_steps", self.num_inference_steps, 1)
        coeffs = tuple(self.coefficients) if isinstance(self.coefficients, (list, tuple)) else None
        if not coeffs:
            raise ValueError(f"{c}.coefficients={self.coefficients!r}: use a non-empty list of floats "
                             f"(highest degree first; [1.0, 0.0]: no rescaling)")
        self.coefficients = tuple(_number(c, "coefficients", v) for v in coeffs)

    def rescale(self, rel_l1: float) -> float:
        """The polynomial at ``rel_l1`` (Horner, highest degree first, as ``numpy.poly1d``)."""
        out = 0.0
        for c in self.coefficients:
            out = out * rel_l1 + c
        return out

    def strify(self) -> str:
        return f"TeaCache_R{self.threshold}_N{self.num_inference_steps}"


__all__ = ["SeaCacheConfig", "TeaCacheConfig", "TEACACHE_FLUX_COEFFICIENTS"]
