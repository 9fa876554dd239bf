"""cache-dit's backend enums, ``ParallelismBackend`` and ``QuantizeBackend``, for ``ParallelismConfig.backend`` /
``QuantizeConfig.backend``: the same members and values, so the configs check them as they check the names
(:data:`~dit_passes.frontend.configs.PARALLEL_BACKENDS`, :data:`~dit_passes.frontend.configs.QUANT_BACKENDS`).
Every backend runs dit_passes' own passes; the name only says which sizes or quant types it takes, as there."""
from __future__ import annotations

import enum

from .configs import PARALLEL_BACKENDS, QUANT_BACKENDS


class ParallelismBackend(enum.Enum):
    AUTO = "Auto"
    CACHE_DIT = "CACHE_DIT"
    NATIVE_DIFFUSER = "Native_Diffuser"
    NATIVE_PYTORCH = "Native_PyTorch"
    NATIVE_HYBRID = "Native_Hybrid"
    NONE = "None"

    @classmethod
    def from_str(cls, name: str) -> "ParallelismBackend":
        canonical = PARALLEL_BACKENDS.get(str(name).lower())  # native_diffuser is cache_dit there too
        for member in cls:
            if canonical is not None and member.value.lower() == canonical:
                return member
        raise ValueError(f"ParallelismBackend {name!r}: use one of {sorted(PARALLEL_BACKENDS)}")


class QuantizeBackend(enum.Enum):
    AUTO = "AUTO"
    TORCHAO = "TORCHAO"
    CACHE_DIT = "CACHE_DIT"
    NONE = "NONE"

    @classmethod
    def from_str(cls, name: str) -> "QuantizeBackend":
        canonical = QUANT_BACKENDS.get(str(name).lower())
        for member in cls:
            if canonical is not None and member.value.lower() == canonical:
                return member
        raise ValueError(f"QuantizeBackend {name!r}: use one of {sorted(QUANT_BACKENDS)}")
