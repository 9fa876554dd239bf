"""Configs of diffusers 0.42's caches, as ours: ``FirstBlockCacheConfig``, ``MagCacheConfig``,
``TaylorSeerCacheConfig``, ``PyramidAttentionBroadcastConfig``, ``FasterCacheConfig`` (``SeaCacheConfig`` and the
paper-defined ``TeaCacheConfig``: :mod:`.peer_configs_gating`, re-exported here).

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
from typing import Any, Callable, List, Optional, Tuple, Union

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


# diffusers' identifiers (``hooks/_common.py``, ``hooks/faster_cache.py``), matched with ``re.search``
PAB_SPATIAL_IDENTIFIERS = ("blocks", "transformer_blocks", "single_transformer_blocks", "layers",
                           "visual_transformer_blocks")
PAB_TEMPORAL_IDENTIFIERS = ("temporal_transformer_blocks",)
PAB_CROSS_IDENTIFIERS = ("blocks", "transformer_blocks", "layers")
FASTER_SPATIAL_IDENTIFIERS = ("^blocks.*attn", "^transformer_blocks.*attn", "^single_transformer_blocks.*attn")
FASTER_TEMPORAL_IDENTIFIERS = ("^temporal_transformer_blocks.*attn",)
_TIMESTEP_NOTE = ("the timestep ranges compare the pipeline's timestep (what diffusers' current_timestep_callback "
                  "returns) = the transformer's timestep input x timestep_scale")



def _check_range(cls: str, name: str, v: Any) -> Tuple[float, float]:
    if not (isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_number(x) for x in v)):
        raise ValueError(f"{cls}.{name}={v!r}: use a (low, high) pair of numbers")
    return (v[0], v[1])


def _check_skip(cls: str, name: str, v: Any, optional: bool = True) -> None:
    if (v is None and optional) or (_is_int(v) and v >= 1):
        return
    raise ValueError(f"{cls}.{name}={v!r}: use {'None or ' if optional else ''}an int >= 1")


def _check_common(cfg: Any, cls: str) -> None:
    if not _is_number(cfg.timestep_scale) or cfg.timestep_scale <= 0:
        raise ValueError(f"{cls}.timestep_scale={cfg.timestep_scale!r}: use a number > 0 ({_TIMESTEP_NOTE}; "
                         f"FluxPipeline passes t / 1000: use 1000)")
    callback = cfg.current_timestep_callback
    if callback is not None and not callable(callback):
        raise TypeError(f"{cls}.current_timestep_callback must be a function of no arguments returning the "
                        f"pipeline's timestep, got {callback!r}")
    if callback is not None and cfg.timestep_scale != 1.0:
        raise ValueError(f"{cls}: give current_timestep_callback or timestep_scale={cfg.timestep_scale!r}, not both "
                         f"(the callback's value sets the scale)")


@dataclasses.dataclass
class PyramidAttentionBroadcastConfig:
    """diffusers' Pyramid Attention Broadcast: each attention module of a kind (spatial / temporal / cross, by
    its module path, ``re.search`` of the kind's identifiers) reuses its last output on every call but each
    ``<kind>_attention_block_skip_range``-th (counted from the generation's first call) while the timestep lies
    strictly inside ``<kind>_attention_timestep_skip_range``. With no skip range given, spatial uses 2 (as
    diffusers). Cross attention is recognised in the graph (keys not computed from the queries' input).
    ``timestep_scale`` (ours): the pipeline's timestep = the transformer's ``timestep`` input x the scale, or
    ``current_timestep_callback`` (diffusers': the pipeline's timestep, e.g. ``lambda: pipe.current_timestep``)
    sets it: called once per lowering, at the first call (inside the pipeline's call), its value over the
    transformer's timestep input is the scale, so the graph keeps comparing its own timestep input (x that scale)
    with the ranges, with no host call per step. ``enable_cache(pipe, ...)`` gives the pipeline's
    ``current_timestep`` when neither field is set."""

    spatial_attention_block_skip_range: Optional[int] = None
    temporal_attention_block_skip_range: Optional[int] = None
    cross_attention_block_skip_range: Optional[int] = None
    spatial_attention_timestep_skip_range: Tuple[float, float] = (100, 800)
    temporal_attention_timestep_skip_range: Tuple[float, float] = (100, 800)
    cross_attention_timestep_skip_range: Tuple[float, float] = (100, 800)
    spatial_attention_block_identifiers: Tuple[str, ...] = PAB_SPATIAL_IDENTIFIERS
    temporal_attention_block_identifiers: Tuple[str, ...] = PAB_TEMPORAL_IDENTIFIERS
    cross_attention_block_identifiers: Tuple[str, ...] = PAB_CROSS_IDENTIFIERS
    current_timestep_callback: Optional[Callable[[], Any]] = None
    timestep_scale: float = 1.0

    KINDS = ("spatial", "temporal", "cross")

    def __post_init__(self) -> None:
        cls = type(self).__name__
        for kind in self.KINDS:
            _check_skip(cls, f"{kind}_attention_block_skip_range", getattr(self, f"{kind}_attention_block_skip_range"))
            name = f"{kind}_attention_timestep_skip_range"
            setattr(self, name, _check_range(cls, name, getattr(self, name)))
        if all(getattr(self, f"{k}_attention_block_skip_range") is None for k in self.KINDS):
            self.spatial_attention_block_skip_range = 2  # diffusers' default (it warns)
        _check_common(self, cls)

    def kind(self, name: str):
        """``(block_skip_range, (low, high), identifiers)`` of one kind."""
        return tuple(getattr(self, f"{name}_attention_{f}") for f in ("block_skip_range", "timestep_skip_range",
                                                                       "block_identifiers"))

    def strify(self) -> str:
        parts = [f"{k[0].upper()}{getattr(self, f'{k}_attention_block_skip_range')}" for k in self.KINDS
                 if getattr(self, f"{k}_attention_block_skip_range") is not None]
        return "PAB_" + "_".join(parts)


@dataclasses.dataclass
class FasterCacheConfig:
    """diffusers' FasterCache. Attention part: each spatial / temporal attention module (module paths matching
    the kind's identifiers, ``re.search``; cross attention excluded) whose call is skipped returns
    ``y1 + (y1 - y2) * attention_weight`` from its last two outputs, where skipped = timestep strictly inside the
    kind's range and the step is not a positive multiple of ``<kind>_attention_block_skip_range``, and the model
    is guidance distilled or the call approximates its unconditional half. CFG part (``is_guidance_distilled=
    False``; a batched CFG call, unconditional half first): on steps inside ``unconditional_batch_timestep_skip_
    range`` that are not multiples of ``unconditional_batch_skip_range`` the output's unconditional half is the
    conditional half plus the stored low / high frequency deltas (scaled by ``alpha_*`` inside their ranges),
    else the deltas are measured. The weight callbacks are refused (a Python call per step): ``attention_weight``
    (ours) replaces ``attention_weight_callback``; ``timestep_scale`` (ours) and ``current_timestep_callback`` (read
    once per lowering) as for PyramidAttentionBroadcastConfig."""

    spatial_attention_block_skip_range: int = 2
    temporal_attention_block_skip_range: Optional[int] = None
    spatial_attention_timestep_skip_range: Tuple[float, float] = (-1, 681)
    temporal_attention_timestep_skip_range: Tuple[float, float] = (-1, 681)
    low_frequency_weight_update_timestep_range: Tuple[float, float] = (99, 901)
    high_frequency_weight_update_timestep_range: Tuple[float, float] = (-1, 301)
    alpha_low_frequency: float = 1.1
    alpha_high_frequency: float = 1.1
    unconditional_batch_skip_range: int = 5
    unconditional_batch_timestep_skip_range: Tuple[float, float] = (-1, 641)
    spatial_attention_block_identifiers: Tuple[str, ...] = FASTER_SPATIAL_IDENTIFIERS
    temporal_attention_block_identifiers: Tuple[str, ...] = FASTER_TEMPORAL_IDENTIFIERS
    attention_weight_callback: Any = None
    low_frequency_weight_callback: Any = None
    high_frequency_weight_callback: Any = None
    tensor_format: str = "BCFHW"
    is_guidance_distilled: bool = False
    current_timestep_callback: Optional[Callable[[], Any]] = None
    attention_weight: float = 0.5
    timestep_scale: float = 1.0

    KINDS = ("spatial", "temporal")

    def __post_init__(self) -> None:
        cls = type(self).__name__
        _check_skip(cls, "spatial_attention_block_skip_range", self.spatial_attention_block_skip_range)
        _check_skip(cls, "temporal_attention_block_skip_range", self.temporal_attention_block_skip_range)
        _check_skip(cls, "unconditional_batch_skip_range", self.unconditional_batch_skip_range, optional=False)
        for name in ("spatial_attention_timestep_skip_range", "temporal_attention_timestep_skip_range",
                     "low_frequency_weight_update_timestep_range", "high_frequency_weight_update_timestep_range",
                     "unconditional_batch_timestep_skip_range"):
            setattr(self, name, _check_range(cls, name, getattr(self, name)))
        for name in ("alpha_low_frequency", "alpha_high_frequency", "attention_weight"):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"{cls}.{name} must be a float, got {getattr(self, name)!r}")
        given = [n for n in ("attention_weight_callback", "low_frequency_weight_callback",
                             "high_frequency_weight_callback") if getattr(self, n) is not None]
        if given:
            raise ValueError(f"{cls}: {given} are Python callbacks called every step, which a graph cannot run "
                             f"without a host call per step; give attention_weight= (a float) and the alpha_* / "
                             f"*_weight_update_timestep_range fields instead")
        if self.tensor_format not in ("BCFHW", "BFCHW", "BCHW"):
            raise ValueError(f"{cls}.tensor_format={self.tensor_format!r}: use 'BCFHW', 'BFCHW' or 'BCHW'")
        if not isinstance(self.is_guidance_distilled, bool):
            raise TypeError(f"{cls}.is_guidance_distilled must be a bool, got {self.is_guidance_distilled!r}")
        _check_common(self, cls)

    def kind(self, name: str):
        return tuple(getattr(self, f"{name}_attention_{f}") for f in ("block_skip_range", "timestep_skip_range",
                                                                       "block_identifiers"))

    def strify(self) -> str:
        cfg = "D" if self.is_guidance_distilled else f"U{self.unconditional_batch_skip_range}"
        spatial, temporal = self.spatial_attention_block_skip_range, self.temporal_attention_block_skip_range
        return f"FasterCache_S{spatial}_T{temporal}_{cfg}"


@dataclasses.dataclass
class TextKVCacheConfig:
    """diffusers' text K/V cache (``diffusers.hooks.TextKVCacheConfig``, no fields): NucleusMoE-Image's blocks
    compute their text keys / values once per prompt and hand them to the attention processor through
    ``attention_kwargs``. Not offered: ``enable_cache`` refuses it (:data:`TEXT_KV_REFUSAL`)."""


TEXT_KV_REFUSAL = ("TextKVCacheConfig is not offered by dit_passes: diffusers' text K/V cache is a hook of "
                   "NucleusMoE-Image's blocks that feeds precomputed keys / values to its attention processor, not a "
                   "rewrite of the traced graph; apply it with diffusers itself "
                   "(pipe.transformer.enable_cache(diffusers.hooks.TextKVCacheConfig())) without dit_passes' "
                   "enable_cache, or pick one of dit_passes' cache configs (DBCacheConfig, FirstBlockCacheConfig, ...)")


PEER_CONFIGS = (FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig, SeaCacheConfig, TeaCacheConfig,
                PyramidAttentionBroadcastConfig, FasterCacheConfig, TextKVCacheConfig)


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
           "PyramidAttentionBroadcastConfig", "FasterCacheConfig", "TextKVCacheConfig", "TEXT_KV_REFUSAL",
           "resample_nearest", "from_peer", "PEER_CONFIGS"]
