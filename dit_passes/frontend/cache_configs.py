"""Which cache pass a front-end ``cache_config`` asks for.

``enable_cache(pipe, cache_config=...)`` takes cache-dit's ``DBCacheConfig`` (-> ``passes.DBCache``) or
``DBPruneConfig`` (-> ``passes.DBPrune``), or
diffusers' ``FirstBlockCacheConfig`` / ``MagCacheConfig`` / ``TaylorSeerCacheConfig`` / ``SeaCacheConfig`` /
``PyramidAttentionBroadcastConfig`` / ``FasterCacheConfig`` -- diffusers' own classes or ours of the same name
(``dit_passes.FirstBlockCacheConfig`` ...) -> ``passes.FirstBlockCache`` / ``passes.MagCache`` /
``passes.TaylorSeerCache`` / ``passes.SeaCache`` / ``passes.PyramidAttentionBroadcast`` / ``passes.FasterCache``;
ours only: ``TeaCacheConfig`` -> ``passes.TeaCache``. A config of
another class with DBCacheConfig's field names (cache-dit's) is converted field by field (to DBPruneConfig when
its ``cache_type`` is DBPrune).
"""
from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any, Optional

from ..cache.config import (CalibratorConfig, DBCacheConfig, DBPruneConfig, DMDCalibratorConfig, FoCaCalibratorConfig,
                            TaylorSeerCalibratorConfig, full_tag)
from ..cache.peer_configs import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig,
                                  PyramidAttentionBroadcastConfig, SeaCacheConfig, TaylorSeerCacheConfig,
                                  TeaCacheConfig, TEXT_KV_REFUSAL, TextKVCacheConfig, from_peer)
from ..passes import (DBCache, DBPrune, FasterCache, FirstBlockCache, MagCache, PyramidAttentionBroadcast, SeaCache,
                      TaylorSeerCache, TeaCache)

_PASS_OF = {FirstBlockCacheConfig: FirstBlockCache, MagCacheConfig: MagCache, TaylorSeerCacheConfig: TaylorSeerCache,
            SeaCacheConfig: SeaCache, TeaCacheConfig: TeaCache,
            PyramidAttentionBroadcastConfig: PyramidAttentionBroadcast, FasterCacheConfig: FasterCache}
CACHE_PASSES = tuple(dict.fromkeys((DBCache, DBPrune, *_PASS_OF.values())))


def convert(cfg: Any, cls: type, probe: str) -> Any:
    """A copy of ``cfg`` as ``cls``; an object with the same field names (e.g. cache-dit's config) is converted."""
    if cfg is None or isinstance(cfg, cls):
        return copy.deepcopy(cfg)
    if not hasattr(cfg, probe):
        raise TypeError(f"expected a {cls.__name__}, got {type(cfg).__name__}")
    return cls(**{f.name: copy.deepcopy(getattr(cfg, f.name)) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)})


def resolve_cache_config(cache_config: Any, others_given: bool) -> Any:
    """Our config for ``cache_config`` (None: the default ``DBCacheConfig()`` unless another optimisation is
    asked for, as the reference)."""
    if cache_config is None:
        if others_given:  # the reference: a default DBCache only when no other optimisation is asked for
            return None
        cache_config = DBCacheConfig()
    peer = from_peer(cache_config)
    if isinstance(peer, TextKVCacheConfig):
        raise ValueError(f"cache_config={type(cache_config).__name__}(): {TEXT_KV_REFUSAL}")
    if peer is not None:
        return peer
    kind = getattr(cache_config, "cache_type", "DBCache")
    prune = str(getattr(kind, "value", kind)) == "DBPrune"
    cfg = convert(cache_config, DBPruneConfig if prune else DBCacheConfig, "Fn_compute_blocks")
    if not isinstance(cfg.cache_type, str):  # cache-dit's CacheType enum
        cfg = dataclasses.replace(cfg, cache_type=str(getattr(cfg.cache_type, "value", cfg.cache_type)))
    # enable_separate_cfg=None stays None: the cache passes tell the CFG branches apart from the calls
    return cfg


class PipelineTimestep:
    """``current_timestep_callback`` read from a pipeline: its ``current_timestep`` (the scheduler's timestep of the
    step running, which diffusers' pipelines set before calling the transformer). Holds the pipeline weakly (the
    pipeline holds the config through its transformer's wrapper)."""

    def __init__(self, pipe: Any):
        self._pipe = weakref.ref(pipe)

    def __call__(self) -> Any:
        pipe = self._pipe()
        return None if pipe is None else pipe.current_timestep

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipelineTimestep) and other._pipe() is self._pipe()

    __hash__ = None  # mutable referent: not a dict key

    def __repr__(self) -> str:
        return "pipe.current_timestep"


def with_pipeline_timestep(cfg: Any, pipe: Any) -> Any:
    """``cfg`` with the pipeline's timestep as ``current_timestep_callback`` where it is an attention-reuse config
    (PAB / FasterCache: ranges in the pipeline's timestep units) that gives neither the callback nor a
    ``timestep_scale``, and the pipeline says its timestep (diffusers' ``current_timestep`` property)."""
    if (isinstance(cfg, (PyramidAttentionBroadcastConfig, FasterCacheConfig)) and pipe is not None
            and cfg.current_timestep_callback is None and cfg.timestep_scale == 1.0
            and hasattr(type(pipe), "current_timestep")):
        return dataclasses.replace(cfg, current_timestep_callback=PipelineTimestep(pipe))
    return cfg


_CALIBRATORS = {c.CALIBRATOR_TYPE: c for c in (TaylorSeerCalibratorConfig, FoCaCalibratorConfig, DMDCalibratorConfig)}


_FIELD_OF_KWARG = {"taylorseer": {"n_derivatives": "taylorseer_order"},
                   "dmd": {"history": "dmd_history", "rank": "dmd_rank", "ridge": "dmd_ridge",
                           "svd_precision": "dmd_svd_precision"}}


def resolve_calibrator(calibrator: Any) -> Optional[CalibratorConfig]:
    """Our calibrator config for ``calibrator`` (ours, or cache-dit's of the same ``calibrator_type``: converted
    field by field), or None."""
    if calibrator is None:
        return None
    kind = getattr(calibrator, "calibrator_type", None)
    if kind not in _CALIBRATORS:
        raise ValueError(f"calibrator_config: calibrator_type={kind!r} is not one of {sorted(_CALIBRATORS)}")
    cls = _CALIBRATORS[kind]
    if isinstance(calibrator, cls):
        return copy.deepcopy(calibrator)
    # cache-dit's base CalibratorConfig has none of the subclass's fields: its calibrator_kwargs reach the
    # calibrator's constructor as they are, so a key a subclass's field sets becomes that field
    kwargs = dict(getattr(calibrator, "calibrator_kwargs", None) or {})
    from_kwargs = {f: kwargs.pop(k) for k, f in _FIELD_OF_KWARG.get(kind, {}).items()
                   if k in kwargs and not hasattr(calibrator, f)}
    cfg = convert(calibrator, cls, "calibrator_type")
    return dataclasses.replace(cfg, calibrator_kwargs=kwargs, **from_kwargs) if from_kwargs else cfg


def cache_pass(cfg: Any, calibrator: Optional[Any] = None):
    """The pass for a resolved config (``calibrator``: TaylorSeer / FoCa / DMD, for DBCache and DBPrune only)."""
    if isinstance(cfg, DBPruneConfig):
        return DBPrune(cfg, calibrator=calibrator)
    for cls, pass_cls in _PASS_OF.items():
        if isinstance(cfg, cls):
            if calibrator is not None:
                raise ValueError(f"calibrator_config applies to DBCacheConfig / DBPruneConfig only, not {cls.__name__}")
            return pass_cls(cfg)
    return DBCache(cfg, calibrator=calibrator)


def cache_tag(cfg: Any, calibrator: Optional[Any] = None, pruned_ratio: Optional[float] = None) -> str:
    """The config's tag for ``strify``: cache-dit's ``<config>[_P<pruned %>]_<calibrator or T0O0>``, or the peer
    config's."""
    if not isinstance(cfg, DBCacheConfig):
        return cfg.strify()
    tag = full_tag(cfg, calibrator)
    if isinstance(cfg, DBPruneConfig) and pruned_ratio is not None:
        head = cfg.strify()
        tag = f"{head}_P{round(pruned_ratio * 100, 2)}{tag[len(head):]}"
    return tag


__all__ = ["convert", "resolve_cache_config", "PipelineTimestep", "with_pipeline_timestep", "resolve_calibrator", "cache_pass", "cache_tag", "CACHE_PASSES"]
