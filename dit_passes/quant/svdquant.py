"""SVDQuant W4A4 weight preparation (arXiv 2411.05007): smoothing, low-rank branch, int4 residual.

For a linear ``y = x @ W.T + b`` with W [N, K]:

1. smoothing vector ``s`` [K] > 0: ``x_s = x / s`` (stored as ``smooth_inv = 1 / s``) and
   ``W_s = W * s`` per input channel, so ``x_s @ W_s.T == x @ W.T``. PTQ uses activation statistics,
   ``s = act_absmax**alpha / w_absmax**(1 - alpha)``; DQ (no calibration) uses the same formula with
   flat activation statistics (``smooth="weight"``), its inverse (``smooth="weight_inv"``: ``s = w_absmax**(1 -
   alpha)``, normalised to geometric mean 1 and clamped to [1/4, 4]: cache-dit's ``weight_inv``, which moves the
   difficulty into the weight so that the activations quantize more easily) or no smoothing (``smooth="none"``);
2. low-rank branch from a seeded randomized SVD: ``W_s ~= lora_up @ lora_down`` (rank r, factors stored
   in the activation dtype); the outliers that smoothing migrated into the weight land here;
3. the residual ``R = W_s - lora_up.float() @ lora_down.float()`` (computed from the *stored* factors,
   so the int4 part also absorbs their rounding) is quantized to int4 per row and group of 64
   (:func:`dit_passes.quant.int4.quantize_weight_w4`).

The plain W4A4 baseline is rank 0 with ``s = 1`` (:func:`prepare_w4a4_plain`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .int4 import (GROUP_SIZE, check_group_dim, dequantize_weight_w4, fake_quant_w4_, quantize_weight_w4,
                   w4a4_linear_reference)

SMOOTH_MODES = ("act", "weight", "weight_inv", "none")
WEIGHT_INV_CLAMP = (0.25, 4.0)  # cache-dit's range for its weight-only smoothing heuristics
_TINY = 1e-5  # floor for abs-max statistics so that s stays finite and positive
TENSOR_FIELDS = ("qweight", "wscale", "lora_down", "lora_up", "smooth_inv", "bias")


class TensorTable:
    """The tensor fields of a quantized linear's dataclass (``_tensor_fields``, ``bias`` last and optional): by name,
    moved, counted."""

    _tensor_fields: Tuple[str, ...] = ()

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors by field name (``bias`` only when present), for serialization."""
        out = {name: getattr(self, name) for name in self._tensor_fields}
        if out.get("bias", 0) is None:
            del out["bias"]
        return out

    def to(self, device):
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in self._tensor_fields:
            if kw[name] is not None:
                kw[name] = kw[name].to(device)
        return type(self)(**kw)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def check_fields(self, expect: Dict[str, Tuple[tuple, Optional[torch.dtype]]], what: str) -> None:
        """ValueError unless each named field has its ``(shape, dtype)`` (dtype None: any float)."""
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                raise ValueError(f"{type(self).__name__}.{name} must be {dtype or 'float'} {list(shape)} for {what}; "
                                 f"got {t.dtype} {list(t.shape)}")


@dataclass
class SVDQuantWeight(TensorTable):
    """The quantized form of one linear. Shapes: qweight uint8 [N, K/2], wscale bf16 [N, K/group],
    lora_down [rank, K] and lora_up [N, rank] (activation dtype), smooth_inv fp32 [K], bias [N] or None.
    """

    qweight: torch.Tensor
    wscale: torch.Tensor
    lora_down: torch.Tensor
    lora_up: torch.Tensor
    smooth_inv: torch.Tensor
    bias: Optional[torch.Tensor]
    N: int
    K: int
    rank: int
    group: int = GROUP_SIZE
    _tensor_fields = TENSOR_FIELDS  # not annotated: a class constant, not a field

    def __post_init__(self) -> None:
        n, k, r = self.N, self.K, self.rank
        if self.group != GROUP_SIZE:
            raise ValueError(f"only group size {GROUP_SIZE} is implemented, got {self.group}")
        expect = {
            "qweight": ((n, k // 2), torch.uint8), "wscale": ((n, k // self.group), torch.bfloat16),
            "lora_down": ((r, k), None), "lora_up": ((n, r), None), "smooth_inv": ((k,), torch.float32),
        }
        if self.bias is not None:
            expect["bias"] = ((n,), None)
        self.check_fields(expect, f"N={n}, K={k}, rank={r}")
        if self.lora_down.dtype != self.lora_up.dtype:
            raise ValueError(f"lora_down ({self.lora_down.dtype}) and lora_up ({self.lora_up.dtype}) "
                             "must share the activation dtype")

    @classmethod
    def from_tensors(cls, t: Dict[str, torch.Tensor]) -> "SVDQuantWeight":
        """Rebuild from :meth:`tensors`' dict; N, K and rank are read from the shapes."""
        missing = [f for f in TENSOR_FIELDS[:-1] if f not in t]
        if missing:
            raise KeyError(f"SVDQuantWeight.from_tensors: missing tensors {missing}")
        n, kh = t["qweight"].shape
        return cls(t["qweight"], t["wscale"], t["lora_down"], t["lora_up"], t["smooth_inv"], t.get("bias"),
                   N=n, K=kh * 2, rank=t["lora_down"].shape[0])

    def effective_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight this quantization stands for (ignoring activation quantization):
        ``(dequant(R) + lora_up @ lora_down) / s``."""
        w_s = dequantize_weight_w4(self.qweight, self.wscale)
        if self.rank:
            w_s = w_s + self.lora_up.float() @ self.lora_down.float()
        return w_s * self.smooth_inv.unsqueeze(0)


def randomized_svd(a: torch.Tensor, rank: int, seed: int = 0, oversample: int = 8, niter: int = 4
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Truncated SVD of a 2-D fp32 matrix: ``(U [N, r], S [r], Vh [r, K])`` with r = min(rank, N, K).

    Halko et al. range finder with ``niter`` QR-stabilised power iterations and a private, seeded
    generator (the global RNG is left alone). For rank >= min(N, K) the exact SVD is returned.
    """
    n, k = a.shape
    full = min(n, k)
    if rank >= full:
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return u, s, vh
    gen = torch.Generator(device=a.device).manual_seed(seed)
    width = min(rank + oversample, full)
    omega = torch.randn(k, width, generator=gen, device=a.device, dtype=a.dtype)
    q, _ = torch.linalg.qr(a @ omega)
    for _ in range(niter):
        z, _ = torch.linalg.qr(a.t() @ q)
        q, _ = torch.linalg.qr(a @ z)
    ub, s, vh = torch.linalg.svd(q.t() @ a, full_matrices=False)
    return (q @ ub)[:, :rank], s[:rank], vh[:rank]


def smoothing_vector(weight: torch.Tensor, act_absmax: Optional[torch.Tensor] = None, alpha: float = 0.5,
                     smooth: str = "act") -> torch.Tensor:
    """The smoothing vector s [K] (fp32, > 0) for ``smooth`` in ``SMOOTH_MODES``.

    act: ``act_absmax**alpha / w_absmax**(1 - alpha)`` (w_absmax per input channel over the rows);
    weight: the same with flat activations, ``1 / w_absmax**(1 - alpha)``; weight_inv: ``w_absmax**(1 - alpha)``
    divided by its geometric mean, clamped to ``WEIGHT_INV_CLAMP``; none: ones.
    Abs-max values are floored at 1e-5 so that s is finite and positive.
    """
    if smooth not in SMOOTH_MODES:
        raise ValueError(f"smooth must be one of {SMOOTH_MODES}, got {smooth!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    k = weight.shape[1]
    if smooth == "none":
        return torch.ones(k, dtype=torch.float32, device=weight.device)
    w_absmax = weight.detach().float().abs().amax(dim=0).clamp_min(_TINY)
    if smooth == "weight":
        return w_absmax.pow(-(1.0 - alpha))
    if smooth == "weight_inv":
        # no floor here: an all-zero input channel gets 1 (cache-dit's repair), not a tiny value that would move the
        # geometric mean. A global factor changes nothing (the group scales absorb it); the mean centres the clamp.
        s = weight.detach().float().abs().amax(dim=0).pow(1.0 - alpha)
        s = torch.where((s == 0) | ~torch.isfinite(s), torch.ones_like(s), s)
        return (s / s.log().mean().exp()).clamp(*WEIGHT_INV_CLAMP)
    if act_absmax is None:
        raise ValueError("smooth='act' (PTQ) needs act_absmax, the per-input-channel abs-max of the "
                         "activations; calibrate with ActAbsMaxObserver, or use smooth='weight' or 'none' (DQ)")
    if tuple(act_absmax.shape) != (k,):
        raise ValueError(f"act_absmax must have shape ({k},) (one value per input channel), got "
                         f"{tuple(act_absmax.shape)}")
    a = act_absmax.detach().float().to(weight.device).clamp_min(_TINY)
    if not torch.isfinite(a).all():
        raise ValueError("act_absmax contains inf/nan; check the calibration run")
    return a.pow(alpha) / w_absmax.pow(1.0 - alpha)


def given_smoothing(smooth_scale: torch.Tensor, k: int) -> torch.Tensor:
    """An explicit smoothing vector checked: fp32 [K], finite and > 0 (x / s and W * s must stay exact inverses)."""
    if smooth_scale.dim() != 1 or smooth_scale.shape[0] != k:
        raise ValueError(f"smooth_scale must have shape ({k},), got {tuple(smooth_scale.shape)}")
    s = smooth_scale.detach().float()
    if not (torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError("smooth_scale must be finite and positive in every channel")
    return s


def prepare_svdquant(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     act_absmax: Optional[torch.Tensor] = None, rank: int = 32, alpha: float = 0.5,
                     smooth: str = "act", seed: int = 0, dtype: Optional[torch.dtype] = None,
                     calib_x: Optional[torch.Tensor] = None,
                     alpha_grid: Optional[Sequence[float]] = None, svd: str = "low",
                     refine_iters: int = 0, smooth_scale: Optional[torch.Tensor] = None) -> SVDQuantWeight:
    """Quantize one linear's weight [N, K] (and bias [N]) to SVDQuant W4A4.

    ``dtype`` is the activation dtype the factors are stored in (default: the weight's dtype).
    With ``alpha_grid`` the smoothing exponent is chosen by :func:`search_alpha` on ``calib_x``
    (activations [..., K]), and ``alpha`` is ignored. ``svd`` / ``refine_iters``: :func:`low_rank_split`.
    ``smooth_scale``: the smoothing vector s [K] given explicitly (few-shot DQ computes it from its observed spans,
    ``quant/few_shot.py``); ``act_absmax`` / ``alpha`` / ``smooth`` are then unused. Computation runs on the
    weight's device in fp32.
    """
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D float tensor [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    check_group_dim(k)
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    dtype = dtype or weight.dtype
    if alpha_grid is not None:
        if calib_x is None:
            raise ValueError("alpha_grid needs calib_x, calibration activations to measure the output error on")
        alpha, _ = search_alpha(weight, bias, calib_x, act_absmax=act_absmax, rank=rank, alphas=alpha_grid,
                                smooth=smooth, seed=seed, dtype=dtype)
    # one fp32 copy of the weight, smoothed in place; dropped once the residual is split off (preparing a model from
    # a checkpoint holds the tables so far plus one linear's weight and these few [N, K] temporaries)
    w_s = weight.detach().to(torch.float32, copy=True)
    s = smoothing_vector(w_s, act_absmax, alpha, smooth) if smooth_scale is None else given_smoothing(smooth_scale, k)
    w_s.mul_(s.unsqueeze(0))
    lora_up, lora_down, residual = low_rank_split(w_s, rank, seed, dtype, svd, refine_iters,
                                                  fake_quant_w4_)  # in place: the residual is low_rank_split's own
    del w_s
    qweight, wscale = quantize_weight_w4(residual)
    del residual
    b = None if bias is None else bias.detach().clone()
    return SVDQuantWeight(qweight, wscale, lora_down, lora_up, (1.0 / s).contiguous(), b, N=n, K=k,
                          rank=lora_down.shape[0])


SVD_PRECISIONS = ("low", "medium", "high")


def low_rank_split(w: torch.Tensor, rank: int, seed: int, dtype: torch.dtype, svd: str = "low",
                   refine_iters: int = 0, fake_quant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SVDQuant's low-rank branch of an fp32 weight [N, K]: ``(lora_up [N, r], lora_down [r, K], residual [N, K])``
    with r = min(rank, N, K), ``lora_up = U * S`` and ``lora_down = Vh`` of the SVD stored in ``dtype``, and
    ``residual = w - lora_up.float() @ lora_down.float()`` (from the *stored* factors, so whatever quantizes the
    residual also absorbs their rounding). Rank 0: empty factors, the residual is ``w``.

    ``svd`` (cache-dit's ``calibrate_precision``): ``"low"`` the seeded randomized SVD, ``"medium"`` the full SVD in
    fp32, ``"high"`` the full SVD in fp64. ``refine_iters`` rounds (cache-dit's ``svd_refine_iters``) refit the factors
    to ``w - fake_quant(residual)`` (the residual quantized and dequantized; ``fake_quant`` may overwrite the residual,
    which is this function's own), so the branch absorbs the error the residual's quantization leaves; the residual
    stays anchored on ``w``."""
    if svd not in SVD_PRECISIONS:
        raise ValueError(f"svd must be one of {SVD_PRECISIONS}, got {svd!r}")
    if refine_iters and fake_quant is None:
        raise ValueError("refine_iters needs fake_quant, the residual's quantize-dequantize")
    n, k = w.shape
    rank = min(rank, n, k)
    if rank == 0:
        return (torch.zeros(n, 0, dtype=dtype, device=w.device), torch.zeros(0, k, dtype=dtype, device=w.device), w)
    target, residual = w, None
    for _ in range(1 + int(refine_iters)):
        if residual is not None:  # w - fake_quant(residual), written over the dequantized copy (one [N, K] less)
            dequantized = fake_quant(residual)
            del residual
            target = torch.sub(w, dequantized, out=dequantized)
            del dequantized  # target's other name: `del target` below must free it before the product is made
        if svd == "low":
            u, sv, vh = randomized_svd(target, rank, seed=seed)
        else:
            u, sv, vh = torch.linalg.svd(target.double() if svd == "high" else target, full_matrices=False)
            u, sv, vh = u[:, :rank].float(), sv[:rank].float(), vh[:rank].float()
        lora_up = (u * sv.unsqueeze(0)).to(dtype).contiguous()
        lora_down = vh.to(dtype).contiguous()
        del target
        product = lora_up.float() @ lora_down.float()
        residual = torch.sub(w, product, out=product)  # w - product, in the product's memory
        del product  # the residual's other name: the next round overwrites the residual and frees it
    return lora_up, lora_down, residual


def prepare_w4a4_plain(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       dtype: Optional[torch.dtype] = None) -> SVDQuantWeight:
    """Plain W4A4 baseline: no smoothing (s = 1), no low-rank branch (rank 0)."""
    return prepare_svdquant(weight, bias, rank=0, smooth="none", dtype=dtype)


def svdq_w4a4_linear_reference(x: torch.Tensor, qweight: SVDQuantWeight) -> torch.Tensor:
    """Reference SVDQuant W4A4 linear: x [..., K] -> [..., N] in x.dtype."""
    if x.shape[-1] != qweight.K:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized linear expects K={qweight.K}")
    return w4a4_linear_reference(x, qweight.qweight, qweight.wscale, qweight.lora_down, qweight.lora_up,
                                 qweight.smooth_inv, qweight.bias)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Frobenius-norm relative error ``||out - ref|| / ||ref||`` in fp64."""
    ref64 = ref.double()
    return float((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-300))


def search_alpha(weight: torch.Tensor, bias: Optional[torch.Tensor], calib_x: torch.Tensor,
                 act_absmax: Optional[torch.Tensor] = None, rank: int = 32,
                 alphas: Iterable[float] = (0.3, 0.4, 0.5, 0.6, 0.7), smooth: str = "act", seed: int = 0,
                 dtype: Optional[torch.dtype] = None) -> Tuple[float, Dict[float, float]]:
    """Grid search of the smoothing exponent: the alpha whose quantized linear has the lowest relative
    output error on ``calib_x`` (against the fp32 linear). Returns ``(best_alpha, {alpha: error})``.
    ``act_absmax`` defaults to the abs-max of ``calib_x`` per input channel."""
    if smooth == "none":
        raise ValueError("searching alpha is meaningless with smooth='none'")
    x = calib_x.detach().reshape(-1, weight.shape[1])
    if act_absmax is None and smooth == "act":
        act_absmax = x.float().abs().amax(dim=0)
    ref = F.linear(x.float(), weight.detach().float(), None if bias is None else bias.detach().float())
    x_in = x.to(dtype or weight.dtype)
    errors: Dict[float, float] = {}
    for a in alphas:
        q = prepare_svdquant(weight, bias, act_absmax=act_absmax, rank=rank, alpha=float(a), smooth=smooth,
                             seed=seed, dtype=dtype)
        errors[float(a)] = relative_error(svdq_w4a4_linear_reference(x_in, q), ref)
    if not errors:
        raise ValueError("alphas is empty")
    best = min(errors, key=errors.get)
    return best, errors
