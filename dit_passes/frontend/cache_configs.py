"""Which cache pass a front-end ``cache_config`` asks for.

``enable_cache(pipe, cache_config=...)`` takes cache-dit's ``DBCacheConfig`` (-> ``passes.DBCache``), or
diffusers' ``FirstBlockCacheConfig`` / ``MagCacheConfig`` / ``TaylorSeerCacheConfig`` / ``SeaCacheConfig`` /
``PyramidAttentionBroadcastConfig`` / ``FasterCacheConfig`` -- diffusers' own classes or ours of the same name
(``dit_passes.FirstBlockCacheConfig`` ...) -> ``passes.FirstBlockCache`` / ``passes.MagCache`` /
``passes.TaylorSeerCache`` / ``passes.SeaCache`` / ``passes.PyramidAttentionBroadcast`` / ``passes.FasterCache``;
ours only: ``TeaCacheConfig`` -> ``passes.TeaCache``. A config of
another class with DBCacheConfig's field names (cache-dit's) is converted field by field.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from ..cache.config import DBCacheConfig, full_tag
from ..cache.peer_configs import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig,
                                  PyramidAttentionBroadcastConfig, SeaCacheConfig, TaylorSeerCacheConfig,
                                  TeaCacheConfig, from_peer)
from ..passes import (DBCache, FasterCache, FirstBlockCache, MagCache, PyramidAttentionBroadcast, SeaCache,
                      TaylorSeerCache, TeaCache)

_PASS_OF = {FirstBlockCacheConfig: FirstBlockCache, MagCacheConfig: MagCache, TaylorSeerCacheConfig: TaylorSeerCache,
            SeaCacheConfig: SeaCache, TeaCacheConfig: TeaCache,
            PyramidAttentionBroadcastConfig: PyramidAttentionBroadcast, FasterCacheConfig: FasterCache}
CACHE_PASSES = tuple(dict.fromkeys((DBCache, *_PASS_OF.values())))


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
    if peer is not None:
        return peer
    cfg = convert(cache_config, DBCacheConfig, "Fn_compute_blocks")
    if not isinstance(cfg.cache_type, str):  # cache-dit's CacheType enum
        cfg = dataclasses.replace(cfg, cache_type=str(getattr(cfg.cache_type, "value", cfg.cache_type)))
    if cfg.enable_separate_cfg is None:
        cfg = dataclasses.replace(cfg, enable_separate_cfg=False)  # see frontend.api's module docstring
    return cfg


def cache_pass(cfg: Any, calibrator: Optional[Any] = None):
    """The pass for a resolved config (``calibrator``: cache-dit's TaylorSeer, DBCache only)."""
    for cls, pass_cls in _PASS_OF.items():
        if isinstance(cfg, cls):
            if calibrator is not None:
                raise ValueError(f"calibrator_config (TaylorSeer) applies to DBCacheConfig only, not {cls.__name__}")
            return pass_cls(cfg)
    return DBCache(cfg, calibrator=calibrator)


def cache_tag(cfg: Any, calibrator: Optional[Any] = None) -> str:
    """The config's tag for ``strify``: cache-dit's ``<config>_<calibrator or T0O0>``, or the peer config's."""
    return full_tag(cfg, calibrator) if isinstance(cfg, DBCacheConfig) else cfg.strify()


__all__ = ["convert", "resolve_cache_config", "cache_pass", "cache_tag", "CACHE_PASSES"]
