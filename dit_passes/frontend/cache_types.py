"""cache-dit's cache-type names: the ``CacheType`` enum, ``cache_type(hint)``, ``BasicCacheConfig`` and
``block_range``, so code written against ``cache_dit`` imports them unchanged.

``DBCacheConfig(cache_type=CacheType.DBCache)`` and ``DBPruneConfig(cache_type=CacheType.DBPrune)`` are accepted
(the configs read the enum's value); ``CacheType.NONE`` is refused by the configs, naming the way to run uncached
(no ``enable_cache``, or ``disable_cache``).
"""
from __future__ import annotations

import enum
from typing import List, Union

from ..cache.config import DBCacheConfig

# cache-dit's BasicCacheConfig is DBCacheConfig's schema and DBCacheConfig its named alias: one class here
BasicCacheConfig = DBCacheConfig

_ALIASES = {"DBCache": ("DUAL_BLOCK_CACHE", "DB_CACHE", "DBCACHE", "DB"),
            "DBPrune": ("DYNAMIC_BLOCK_PRUNE", "DB_PRUNE", "DBPRUNE", "DBP"),
            "NONE": ("NONE", "NO_CACHE", "NOCACHE", "NC")}


class CacheType(enum.Enum):
    NONE = "NONE"
    DBCache = "DBCache"
    DBPrune = "DBPrune"

    def __str__(self) -> str:
        return self.value

    @staticmethod
    def type(hint: Union["CacheType", str, None]) -> "CacheType":
        return cache_type(hint)


def cache_type(hint: Union[CacheType, str, None]) -> CacheType:
    """The cache type a name means (the reference's aliases: ``"DB"``, ``"db_prune"``, ...). Unlike the reference,
    which reads a name it does not know as ``NONE`` (no cache, silently), an unknown name raises."""
    if hint is None:
        return CacheType.NONE
    if isinstance(hint, CacheType):
        return hint
    if not isinstance(hint, str):
        raise TypeError(f"cache_type: expected a CacheType or a name, got {type(hint).__name__}")
    for kind, names in _ALIASES.items():
        if hint.upper() in names:
            return CacheType(kind)
    raise ValueError(f"cache_type({hint!r}): unknown cache type; names: "
                     f"{sorted(n for names in _ALIASES.values() for n in names)} (any case)")


DBCache, DBPrune, NONE = CacheType.DBCache, CacheType.DBPrune, CacheType.NONE


def block_range(start: int, end: int, step: int = 1) -> List[int]:
    """Block ids from ``start`` to ``end`` every ``step``, with the first and last block always in (the reference's
    helper for ``DBPruneConfig.non_prune_block_ids``); empty when ``start > end``, ``end <= 0`` or ``step <= 1``,
    as there."""
    if start > end or end <= 0 or step <= 1:
        return []
    return sorted({0, *range(start, end, step), end - 1})

