"""SVDQuant's stored tensors as W4A8: per-token e4m3 activations, the int4 weights on fp8 tensor cores, fused.

The executable specification of ``dit_passes.kernels.w4a8_triton`` (``dit_passes::svdq_w4a8_linear``). The weights
are SVDQuant's (``svdquant.SVDQuantWeight``: packed int4 [N, K/2], even k in the low nibble; bf16 group scales
[N, K/64]; low-rank factors; smoothing), unchanged; only the activations differ from W4A4 (e4m3 per token instead
of int4 per group of 64: finer)::

    xs = float(x.reshape(M, K)) * smooth_inv
    sx = amax|xs| / 448 per token [M, 1] (a zero scale becomes 1); qx = e4m3(clamp(xs * (1 / sx), -448, 448))
    fold=False:  acc = sum_g (float(qx_g) @ q_g.T) * wscale[:, g]      # int4 exact in e4m3, group scale in fp32
                 y = acc * sx
    fold=True:   sw = 8 * max_g wscale[:, g] / 448                       # per row [N]
                 w8 = e4m3(clamp(q * (wscale[:, g] / sw), -448, 448))   # the group scale rounded into e4m3
                 y = (float(qx) @ float(w8).T) * sx * sw
    y = y + float(x.dtype(xs)) @ float(lora_down).T @ float(lora_up).T + float(bias)    # all fp32, then x.dtype

``fold=False`` keeps the weights exact (the only rounding is the activations'); ``fold=True`` is the weight rounding
of ``graph_forms.w4_to_e4m3`` (one e4m3 rounding of each weight; its ``sw`` there divides by a Python scalar, which
CUDA turns into a multiplication, here a true division: at most the last bit of ``sw`` differs), which frees the GEMM
of its per-group fp32 epilogue. Every division is IEEE true division (the kernels use ``div_rn``); the activations
are multiplied by their scale's reciprocal (one division per token, as the fp8 graph forms and
``fp8_int8.quantize_fp8_act`` do it). Only the summation order differs from
the kernels.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .fp8_int8 import FP8_DTYPE, FP8_MAX
from .int4 import GROUP_SIZE, int4_values, true_div


def w4a8_quantize_activation(x: torch.Tensor, smooth_inv: torch.Tensor
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] -> ``(qx e4m3 [M, K], sx fp32 [M, 1], xs fp32 [M, K])`` (module docstring)."""
    xs = x.reshape(-1, x.shape[-1]).float() * smooth_inv.float()
    sx = true_div(xs.abs().amax(1, keepdim=True), FP8_MAX)
    sx = torch.where(sx == 0, torch.ones_like(sx), sx)
    inv = torch.ones_like(sx) / sx
    return torch.clamp(xs * inv, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), sx, xs


def fold_row_scale(wscale: torch.Tensor) -> torch.Tensor:
    """``sw[n] = 8 * max_g wscale[n, g] / 448`` (fp32 [N], true division): the per-row scale of ``fold=True``, which
    maps the largest possible value of a row (|q| <= 8) to e4m3's largest."""
    return true_div(wscale.float().amax(1) * 8.0, FP8_MAX)


def w4a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                          lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor] = None,
                          fold: bool = False) -> torch.Tensor:
    """The W4A8 linear (module docstring): x [..., K] -> [..., N] in x.dtype. Tensors as
    ``int4.w4a4_linear_reference`` takes them."""
    n, k = qweight.shape[0], x.shape[-1]
    if qweight.shape[1] * 2 != k or k % GROUP_SIZE:
        raise ValueError(f"w4a8: input has K={k} features but qweight packs K={qweight.shape[1] * 2} "
                         f"(K must be a multiple of {GROUP_SIZE})")
    qx, sx, xs = w4a8_quantize_activation(x, smooth_inv)
    a = qx.float()
    q, ws = int4_values(qweight, torch.float32), wscale.float()
    if fold:
        sw = fold_row_scale(wscale)
        ratio = (ws / sw[:, None]).repeat_interleave(GROUP_SIZE, dim=1)                      # [N, K]
        w8 = torch.clamp(q * ratio, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        acc = (a @ w8.float().t()) * sx * sw
    else:
        acc = torch.zeros(a.shape[0], n, dtype=torch.float32, device=x.device)
        for g in range(k // GROUP_SIZE):
            cols = slice(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
            acc = acc + (a[:, cols] @ q[:, cols].t()) * ws[:, g]
        acc = acc * sx
    if lora_down.shape[0]:
        acc = acc + (xs.to(x.dtype).float() @ lora_down.float().t()) @ lora_up.float().t()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], n)
