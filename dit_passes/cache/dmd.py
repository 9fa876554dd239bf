"""The DMD calibrator as pure tensor functions (cache-dit 1.5.3's ``DMDState``: Dynamic Mode Decomposition, an
exponential-basis forecast of the cached residual), with fixed shapes and no host sync.

Per stream: ``snap`` ``[H, *shape]`` the last ``H = dmd_history`` computed values (oldest first) and ``steps`` ``[H]``
their steps, ``n_valid`` how many of the last slots are filled; the warm-up Taylor fallback's ``cur0`` / ``cur1`` (the
newest value and its difference) and ``prev0`` (the value before it), flags ``cur1_valid`` / ``prev0_valid``.

A computed step at ``c`` (``w = c -`` the previous computed step) appends ``Y`` and moves the ladder as the reference
does: ``cur1 = (Y - prev0) / w`` when ``prev0`` is defined, ``c >= 3`` and ``w > 0`` (``prev0``: the value two computed
steps back, the reference's order of its shift), then ``prev0 = cur0``, ``cur0 = Y``. Steps are the cache context's: the
reference's counter runs one behind (its state is created at the first computed step with the counter at -1, as
TaylorSeer's: ``taylorseer.FIRST_DIFFERENCE_STEP``), so its "``current_step > 1``" is ``c >= 3`` here; spacings and
horizons are differences of steps and do not depend on the frame. A cached step forecasts: the
longest run of equally spaced snapshots ending at the newest (spacing ``s``, length ``L``); with ``L >= 4``, per batch
item, the economy SVD of the first ``L - 1`` snapshots, its rank ``r`` (``dmd_rank``, or the singular values above
``1e-4`` of the largest), the propagator ``Ã = U_r^H X' V_r S_r^-1`` (ridge added to ``S_r``), its eigenpairs
``(λ, W)``, modes ``Φ = X' V_r S_r^-1 W``, amplitudes ``b`` the least-squares fit of ``Φ b`` to the newest value and the forecast
``Re(Φ (λ^k b))`` at ``k = (step - newest step) / s``, in the value's dtype; a non-finite forecast reuses the newest
value. With ``L < 4``: ``cur0 + cur1 * elapsed`` (``cur0`` alone while ``cur1`` is undefined).

The data-dependent choices (``L``, ``r``) are made on device: every ``(L, r)`` form is evaluated on its static shapes
(``L`` in ``4..H``, ``r`` in ``1..L - 1``: one SVD per ``L``) and the one that applies is selected, so each fit is the
reference's own ``r x r`` problem. A fit the reference catches as an exception (an SVD that does not converge on
non-finite values) raises here instead.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .taylorseer import FIRST_DIFFERENCE_STEP

TENSORS = ("snap", "steps", "cur0", "cur1", "prev0")
FLAGS = ("n_valid", "cur1_valid", "prev0_valid")
MIN_SNAPSHOTS = 4  # the reference's identifiability floor for one oscillatory mode
_RANK_FLOOR = 1e-4  # automatic rank: singular values above this fraction of the largest
_LOWRANK_SEED, _LOWRANK_NITER = 0, 1  # svd_precision="low": the reference's randomized SVD settings


def dmd_keys(stream: int) -> List[str]:
    """The state names of stream ``stream``: the tensors, then the flags."""
    return [f"dmd{stream}_{p}" for p in TENSORS + FLAGS]


def dmd_spec(stream: int, example: torch.Tensor, history: int) -> Dict[str, Tuple[tuple, torch.dtype, float]]:
    """``name -> (shape, dtype, fill)`` of stream ``stream``'s state, ``example`` shaped like its cached value."""
    shape, dt = tuple(example.shape), example.dtype
    shapes = {"snap": ((history, *shape), dt), "steps": ((history,), torch.int64), "cur0": (shape, dt),
              "cur1": (shape, dt), "prev0": (shape, dt)}
    out = {k: (*shapes[p], 0.0) for k, p in zip(dmd_keys(stream), TENSORS)}
    out.update({k: ((), torch.int64, 0) for k in dmd_keys(stream)[len(TENSORS):]})
    return out


def _unpack(state: Dict[str, torch.Tensor], stream: int) -> Dict[str, torch.Tensor]:
    return dict(zip(TENSORS + FLAGS, (state[k] for k in dmd_keys(stream))))


def dmd_after_call(state: Dict[str, torch.Tensor], stream: int, use_cache: torch.Tensor, value: torch.Tensor,
                   step: torch.Tensor, last_compute_step: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``stream``'s entries after the call: a computed step (``~use_cache``) records ``value`` at ``step``;
    ``last_compute_step``: the computed step before this call's."""
    f = _unpack(state, stream)
    compute = ~use_cache
    value = value.to(f["cur0"].dtype)
    history = f["steps"].shape[0]
    window = step - last_compute_step
    # context step >= 3: the reference's calibrator step > 1 (its counter runs one behind; module docstring)
    has_diff = (f["prev0_valid"] > 0) & (step >= FIRST_DIFFERENCE_STEP) & (window > 0)
    cur1 = torch.where(has_diff, (value - f["prev0"]) / window.clamp(min=1), torch.zeros_like(value))
    new = {
        "snap": torch.where(compute, torch.cat([f["snap"][1:], value.unsqueeze(0)]), f["snap"]),
        "steps": torch.where(compute, torch.cat([f["steps"][1:], step.reshape(1)]), f["steps"]),
        "cur0": torch.where(compute, value, f["cur0"]),
        "cur1": torch.where(compute, cur1, f["cur1"]),
        "prev0": torch.where(compute, f["cur0"], f["prev0"]),
        "n_valid": torch.where(compute, (f["n_valid"] + 1).clamp(max=history), f["n_valid"]),
        "cur1_valid": torch.where(compute, has_diff.to(torch.int64), f["cur1_valid"]),
        "prev0_valid": torch.where(compute, (f["n_valid"] > 0).to(torch.int64), f["prev0_valid"]),
    }
    return {k: new[p] for k, p in zip(dmd_keys(stream), TENSORS + FLAGS)}


def _uniform_tail(steps: torch.Tensor, n_valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(L, spacing)``: the length of the longest equally spaced run of filled slots ending at the newest (0 when
    fewer than 2 are filled or the spacing is not positive) and its spacing."""
    history = steps.shape[0]
    if history < 2:
        return torch.zeros_like(n_valid), torch.ones_like(n_valid)
    spacing = steps[-1] - steps[-2]
    gaps = steps[1:] - steps[:-1]  # gaps[j]: slot j + 1 minus slot j
    slot = torch.arange(1, history, device=steps.device)
    same = (gaps == spacing) & (slot - 1 >= history - n_valid)  # both ends filled
    run = torch.flip(torch.cumprod(torch.flip(same.to(torch.int64), [0]), 0), [0]).sum()  # trailing equal gaps
    ok = (n_valid >= 2) & (spacing > 0)
    return torch.where(ok, run + 1, 0), torch.where(spacing > 0, spacing, 1)


def _svd(x: torch.Tensor, precision: str):
    if precision != "low":  # "high": the gesvd driver where it is offered (CUDA), as the reference
        driver = "gesvd" if precision == "high" and x.device.type == "cuda" else None
        return torch.linalg.svd(x, full_matrices=False, driver=driver)
    # torch.svd_lowrank(x, q=n, niter=1) after manual_seed(0), per batch item (the reference's setting), written out
    # so that its random start is drawn from a generator of its own, not the global one
    n = x.shape[-1]
    r = torch.randn(n, n, dtype=x.dtype, generator=torch.Generator().manual_seed(_LOWRANK_SEED)).to(x.device)
    q = torch.linalg.qr(x @ r).Q
    for _ in range(_LOWRANK_NITER):
        q = torch.linalg.qr(x.mH @ q).Q
        q = torch.linalg.qr(x @ q).Q
    u, s, vh = torch.linalg.svd(q.mH @ x, full_matrices=False)
    return q @ u, s, vh


def _forecast(traj: torch.Tensor, k: torch.Tensor, rank: int, ridge: float, precision: str) -> torch.Tensor:
    """The DMD forecast ``[B, d]`` (float64) from trajectories ``traj`` ``[B, d, L]`` (oldest first) at horizon ``k``:
    every rank's fit, the one the spectrum (or ``rank``) picks selected per batch item."""
    x, xp = traj[..., :-1], traj[..., 1:]
    u, s, vh = _svd(x, precision)
    n = s.shape[-1]
    if rank > 0:
        pick = torch.full(s.shape[:-1], max(1, min(rank, n)), dtype=torch.int64, device=s.device)
    else:
        pick = (s > s[..., :1] * _RANK_FLOOR).sum(-1).clamp(min=1)
    newest = traj[..., -1:].to(torch.complex128)
    out = torch.zeros(traj.shape[:-1], dtype=torch.float64, device=traj.device)
    for r in (range(1, n + 1) if rank <= 0 else [max(1, min(rank, n))]):
        ur, vr = u[..., :r], vh[..., :r, :].mH
        sinv = (1.0 / (s[..., :r] + ridge)).to(torch.complex128).unsqueeze(-2)
        a = (ur.mH @ xp @ vr).to(torch.complex128) * sinv
        evals, w = torch.linalg.eig(a)
        phi = ((xp @ vr).to(torch.complex128) * sinv) @ w
        q, upper = torch.linalg.qr(phi)  # least squares by QR (lstsq's output shapes are data-dependent to export)
        b = torch.linalg.solve_triangular(upper, q.mH @ newest, upper=True)
        pred = (phi @ (evals.pow(k.to(torch.float64)).unsqueeze(-1) * b)).real.squeeze(-1)
        out = torch.where((pick == r).unsqueeze(-1), pred, out)
    return out


def dmd_predict(state: Dict[str, torch.Tensor], stream: int, step: torch.Tensor, last_compute_step: torch.Tensor,
                rank: int = 0, ridge: float = 1e-8, precision: str = "medium") -> torch.Tensor:
    """The value a cached step at ``step`` uses for ``stream`` (see the module docstring)."""
    f = _unpack(state, stream)
    snap, newest = f["snap"], f["snap"][-1]
    history = snap.shape[0]
    length, spacing = _uniform_tail(f["steps"], f["n_valid"])
    elapsed = step - last_compute_step
    taylor = torch.where(f["cur1_valid"] > 0, f["cur0"] + f["cur1"] * elapsed, f["cur0"])
    if history < MIN_SNAPSHOTS:
        return taylor
    batch = newest.shape[0] if newest.dim() > 1 else 1
    k = (step - f["steps"][-1]).to(torch.float64) / spacing.to(torch.float64)
    series = snap.reshape(history, batch, -1).permute(1, 2, 0).to(torch.float64)  # [B, d, H]
    dmd: Optional[torch.Tensor] = None
    for n in range(MIN_SNAPSHOTS, history + 1):
        pred = _forecast(series[..., history - n:], k, rank, ridge, precision).reshape(newest.shape).to(newest.dtype)
        dmd = pred if dmd is None else torch.where(length == n, pred, dmd)
    dmd = torch.where(torch.isfinite(dmd).all(), dmd, newest)
    return torch.where(length >= MIN_SNAPSHOTS, dmd, taylor)


__all__ = ["dmd_keys", "dmd_spec", "dmd_predict", "dmd_after_call", "MIN_SNAPSHOTS"]
