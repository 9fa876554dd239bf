"""cache-dit's backend enums, ``ParallelismBackend`` and ``QuantizeBackend``, for ``ParallelismConfig.backend`` /
``QuantizeConfig.backend``: the same members and values, so the configs check them as they check the names
(:data:`~dit_passes.frontend.configs.PARALLEL_BACKENDS`, :data:`~dit_passes.frontend.configs.QUANT_BACKENDS`).
Every backend runs dit_passes' own passes; the name only says which sizes or quant types it takes, as there."""
from __future__ import annotations

import enum

from .configs import PARALLEL_BACKENDS, QUANT_BACKENDS



def _member(cls: type, names: dict, name: str) -> enum.Enum:
    """The member of ``cls`` whose value is the canonical name ``names`` gives ``name`` (case-insensitive)."""
    canonical = names.get(str(name).lower())
    for member in cls:
        if canonical is not None and member.value.lower() == canonical:
            return member
    raise ValueError(f"{cls.__name__} {name!r}: use one of {sorted(names)}")

class ParallelismBackend(enum.Enum):
    AUTO = "Auto"
    CACHE_DIT = "CACHE_DIT"
    NATIVE_DIFFUSER = "Native_Diffuser"
    NATIVE_PYTORCH = "Native_PyTorch"
    NATIVE_HYBRID = "Native_Hybrid"
    NONE = "None"

    @classmethod
    def from_str(cls, name: str) -> "ParallelismBackend":
        return _member(cls, PARALLEL_BACKENDS, name)  # native_diffuser is cache_dit there too


class QuantizeBackend(enum.Enum):
    AUTO = "AUTO"
    TORCHAO = "TORCHAO"
    CACHE_DIT = "CACHE_DIT"
    NONE = "NONE"

    @classmethod
    def from_str(cls, name: str) -> "QuantizeBackend":
        return _member(cls, QUANT_BACKENDS, name)
