"""The FoCa calibrator as pure tensor functions (cache-dit 1.5.3's ``FoCaState``, sync-free).

Per stream: ``F_k`` / ``F_km1`` (the two latest values, computed or predicted), ``F_full`` / ``F_full_prev`` (the
two latest computed ones), and flags saying which are defined (int64 0-dim, named ``*_valid`` so a new
generation clears them). A computed step stores ``Y`` in both pairs. A cached step predicts
``F_full + (e / 2) * ((F_full - F_full_prev) + (F_k - F_km1))`` with ``e`` the steps since the last computed one
(beyond ``e = 3`` the Heun value at 3 is blended toward ``F_full`` with weight ``3 / e``) and moves the
prediction into ``F_k``; while ``F_km1`` or ``F_full_prev`` is undefined it reuses ``F_full`` and moves nothing.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

TENSORS = ("k", "km1", "full", "full_prev")
FLAGS = ("k_valid", "km1_valid", "full_prev_valid")
MAX_HORIZON = 3.0  # steps the Heun extrapolation runs before it is damped toward the anchor


def foca_keys(stream: int) -> List[str]:
    """The state names of stream ``stream``: the four tensors, then the three flags."""
    return [f"fc{stream}_{p}" for p in TENSORS + FLAGS]


def _unpack(state: Dict[str, torch.Tensor], stream: int) -> Dict[str, torch.Tensor]:
    return dict(zip(TENSORS + FLAGS, (state[k] for k in foca_keys(stream))))


def _extrapolates(f: Dict[str, torch.Tensor]) -> torch.Tensor:
    return (f["km1_valid"] > 0) & (f["full_prev_valid"] > 0)


def foca_predict(state: Dict[str, torch.Tensor], stream: int, elapsed: torch.Tensor) -> torch.Tensor:
    """The value a cached step uses for ``stream``; ``elapsed``: steps since the last computed one (int64)."""
    f = _unpack(state, stream)
    e = elapsed.to(torch.float64)
    slope = (f["full"] - f["full_prev"]) + (f["k"] - f["km1"])
    near = f["full"] + (e / 2.0) * slope
    w = MAX_HORIZON / e
    far = w * (f["full"] + (MAX_HORIZON / 2.0) * slope) + (1.0 - w) * f["full"]
    return torch.where(_extrapolates(f), torch.where(e <= MAX_HORIZON, near, far), f["full"])


def foca_after_call(state: Dict[str, torch.Tensor], stream: int, use_cache: torch.Tensor,
                    value: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``stream``'s entries after the call: ``value`` is the computed value on a computed step, the prediction
    (:func:`foca_predict`) on a cached one."""
    f = _unpack(state, stream)
    compute = ~use_cache
    moves = compute | (use_cache & _extrapolates(f))  # the rolling pair advances
    value = value.to(f["k"].dtype)
    new: Tuple[torch.Tensor, ...] = (
        torch.where(moves, value, f["k"]), torch.where(moves, f["k"], f["km1"]),
        torch.where(compute, value, f["full"]), torch.where(compute, f["full"], f["full_prev"]),
        torch.where(compute, 1, f["k_valid"]), torch.where(moves, f["k_valid"], f["km1_valid"]),
        torch.where(compute, f["k_valid"], f["full_prev_valid"]))
    return dict(zip(foca_keys(stream), new))


__all__ = ["foca_keys", "foca_predict", "foca_after_call", "MAX_HORIZON"]
