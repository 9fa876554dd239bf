"""NVFP4 as data: SVDQuant with FP4 (e2m1) weights and activations in blocks of 16, the executable specification.

The NVFP4 layout (NVIDIA's, as Blackwell's tensor cores read it and as TensorRT-ModelOpt writes it) of a weight
[N, K] (here the SVDQuant residual, after smoothing and the low-rank branch, as in ``svdquant.py``):

* ``qweight`` uint8 [N, K/2]: e2m1 codes (sign bit 3, magnitude code 0..7 for 0, .5, 1, 1.5, 2, 3, 4, 6), two per
  byte, the even k in the low nibble;
* ``wscale`` float8_e4m3fn [N, K/16]: one scale per row and block of 16 along K;
* ``wglobal`` fp32 [1]: the global scale, ``amax|W| / (6 * 448)``, so the largest block scale is 448.

Value: ``W[n, k] = e2m1(q[n, k]) * float(wscale[n, k // 16]) * wglobal``. Quantizing (:func:`nvfp4_quantize`):
``blk = e4m3(min(amax|W[n, b]| / 6 / g, 448))``, ``q = round_e2m1(W / (float(blk) * g))`` (round to nearest,
ties to the even code, saturating at 6); a zero global (an all-zero tensor) becomes 1, a zero block scale divides
by 1 (its values then round to 0 or are multiplied by 0).

Activations are quantized the same way at run time, per token: the global is per row, ``gx[m] = amax|x_s[m]| /
2688``, so the reference W4A4 linear (:func:`nvfp4_linear_reference`) is

    x_s = x.float() * smooth_inv;  (vx, sx, gx) = nvfp4_quantize(x_s, per row)
    out = ((vx * sx) @ (vw * sw).T) * gx * wglobal  +  (x_s cast to x.dtype) @ lora_down.T @ lora_up.T  +  bias

with ``v * s`` (an e2m1 value times an e4m3 scale: at most 2 + 4 significant bits) exact in fp32, so the only
rounding after quantization is fp32 accumulation.

Hopper (no FP4 tensor cores): :func:`nvfp4_fp8_operands` writes both operands for the fp8 tensor cores so that
every product is the reference's exactly. ``v * s`` has up to 5 significant bits, one more than e4m3 holds; split
each block scale by its bits into ``s_hi`` (sign, exponent and the first mantissa bit) and ``s_lo = s - s_hi`` (the
last two mantissa bits): ``v * s_hi`` and ``v * s_lo`` have at most 2 + 2 significant bits each, exact in e4m3
after a fixed ``2**-3`` (6 * 448 / 8 = 336 <= 448). With ``A = [x_hi | x_hi | x_lo | x_lo]`` [M, 4K] and
``B = [w_hi | w_lo | w_hi | w_lo]`` [N, 4K], ``A @ B.T = (x_hi + x_lo) @ (w_hi + w_lo).T``, one GEMM on 4K; the row
scales ``8 * gx`` and ``8 * wglobal`` go into ``_scaled_mm``'s scales. Exact except where a product falls below
e4m3's subnormal step 2**-9: blocks whose scale is under 1/4 (block abs-max under 1/1792 of the row's / tensor's
largest), whose products then round at 2**-9 * 8 * g, 2**-18 of the row's largest value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .fp8_int8 import FP8_DTYPE, FP8_MAX
from .svdquant import TensorTable, given_smoothing, low_rank_split, smoothing_vector

aten = torch.ops.aten
BLOCK = 16
FP4_MAX = 6.0
GLOBAL_DIV = FP4_MAX * FP8_MAX  # 2688: the global scale maps the largest block scale to 448
SPLIT_SHIFT = 0.125  # 2**-3: 6 * 448 * 2**-3 = 336 fits e4m3
_F32 = torch.float32
TENSOR_FIELDS = ("qweight", "wscale", "wglobal", "lora_down", "lora_up", "smooth_inv", "bias")


def check_block_dim(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"NVFP4 quantizes K in blocks of {BLOCK}: K={k} is not a multiple")


# ------------------------------------------------------------------------------------------ e2m1
def e2m1_round(a: torch.Tensor) -> torch.Tensor:
    """fp32 magnitudes (>= 0) -> the nearest e2m1 value (ties to the even code), saturating at 6. The grid's step is
    0.5 below 2, 1 below 4, 2 up to 6; ``round(a / step)`` is half-to-even on an integer whose parity is the code's."""
    a = aten.clamp.default(a, 0.0, FP4_MAX)
    step = aten.where.Scalar(aten.lt.Scalar(a, 2.0), 0.5, 1.0)
    step = aten.where.ScalarSelf(aten.ge.Scalar(a, 4.0), 2.0, step)
    return aten.mul.Tensor(aten.round.default(aten.div.Tensor(a, step)), step)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Signed e2m1 values (fp32, on the grid) -> uint8 codes 0..15 (bit 3: the sign)."""
    a = aten.abs.default(v)
    code = aten.where.self(aten.lt.Scalar(a, 2.0), aten.mul.Tensor(a, 2.0),
                           aten.where.self(aten.lt.Scalar(a, 4.0), aten.add.Tensor(a, 2.0),
                                           aten.add.Tensor(aten.mul.Tensor(a, 0.5), 4.0)))
    code = aten.add.Tensor(code, aten.mul.Tensor(aten._to_copy.default(aten.lt.Scalar(v, 0.0), dtype=_F32), 8.0))
    return aten._to_copy.default(code, dtype=torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> fp32 e2m1 values."""
    c = aten._to_copy.default(aten.bitwise_and.Scalar(codes, 7), dtype=_F32)
    mag = aten.where.self(aten.lt.Scalar(c, 4.0), aten.mul.Tensor(c, 0.5),
                          aten.where.self(aten.lt.Scalar(c, 6.0), aten.sub.Tensor(c, 2.0),
                                          aten.mul.Tensor(aten.sub.Tensor(c, 4.0), 2.0)))
    neg = aten.ne.Scalar(aten.bitwise_and.Scalar(codes, 8), 0)
    return aten.where.self(neg, aten.neg.default(mag), mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, K] -> [R, K/2], the even k in the low nibble."""
    r, k = codes.shape
    pairs = aten.view.default(codes, [r, k // 2, 2])
    lo = aten.select.int(pairs, 2, 0)
    hi = aten.select.int(pairs, 2, 1)
    return aten.bitwise_or.Tensor(lo, aten.bitwise_left_shift.Tensor_Scalar(hi, 4))


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] -> codes [R, K]."""
    lo = aten.bitwise_and.Scalar(packed, 15)
    hi = aten.bitwise_right_shift.Tensor_Scalar(packed, 4)
    return aten.flatten.using_ints(aten.stack.default([lo, hi], -1), -2, -1)


# ------------------------------------------------------------------------------------ quantization
def nvfp4_quantize(t: torch.Tensor, per_row: bool, dims: Optional[Tuple[int, int]] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [R, K] -> ``(values fp32 [R, K] on the signed e2m1 grid, block scales e4m3 [R, K/16], global fp32)``
    with ``t ~= values * float(scales) * global`` per block; the global is one per row ([R, 1]) or over the tensor
    ([1]). Plain ATen ops, so the graph forms run the very same arithmetic; ``dims`` (R, K) as Python ints where
    ``t`` is traced (default: ``t.shape``)."""
    r, k = dims or t.shape
    a = aten.abs.default(t)
    amax = aten.amax.default(a, [1], True) if per_row else aten.view.default(aten.amax.default(a), [1])
    g = aten.div.Tensor(amax, GLOBAL_DIV)
    g = aten.where.ScalarSelf(aten.eq.Scalar(g, 0.0), 1.0, g)
    bamax = aten.amax.default(aten.view.default(a, [r, k // BLOCK, BLOCK]), [2])          # [R, K/16]
    # g is [R, 1] or [1]: it broadcasts over the blocks either way
    raw = aten.div.Tensor(aten.div.Tensor(bamax, FP4_MAX), g)
    scale8 = aten._to_copy.default(aten.clamp.default(raw, 0.0, FP8_MAX), dtype=FP8_DTYPE)
    s = aten._to_copy.default(scale8, dtype=_F32)
    denom = aten.mul.Tensor(aten.where.ScalarSelf(aten.eq.Scalar(s, 0.0), 1.0, s), g)
    scaled = aten.div.Tensor(aten.view.default(t, [r, k // BLOCK, BLOCK]), aten.unsqueeze.default(denom, 2))
    mag = e2m1_round(aten.abs.default(scaled))
    values = aten.where.self(aten.lt.Scalar(scaled, 0.0), aten.neg.default(mag), mag)
    return aten.view.default(values, [r, k]), scale8, g


def block_dequant(values: torch.Tensor, scale8: torch.Tensor, dims: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """``values * float(scale)`` per block, [R, K] fp32 (exact: at most 2 + 4 significant bits)."""
    return _times_block(values, aten._to_copy.default(scale8, dtype=_F32), dims or values.shape)


def quantize_weight_nvfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Offline: a float weight [N, K] -> ``(qweight uint8 [N, K/2], wscale e4m3 [N, K/16], wglobal fp32 [1])``."""
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    check_block_dim(w.shape[1])
    values, scale8, g = nvfp4_quantize(w.detach().float(), per_row=False)
    return pack_fp4(e2m1_encode(values)).contiguous(), scale8.contiguous(), g.contiguous()


def dequantize_weight_nvfp4(qweight: torch.Tensor, wscale: torch.Tensor, wglobal: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] value of a stored NVFP4 weight (exact)."""
    return aten.mul.Tensor(block_dequant(e2m1_decode(unpack_fp4(qweight)), wscale),
                           aten._to_copy.default(wglobal, dtype=_F32))


def nvfp4_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wglobal: torch.Tensor,
                           lora_down: torch.Tensor, lora_up: torch.Tensor, smooth_inv: torch.Tensor,
                           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The NVFP4 W4A4 SVDQuant linear (module docstring) on plain tensors: x [..., K] -> [..., N] in x.dtype."""
    k, n = x.shape[-1], qweight.shape[0]
    x_s = x.reshape(-1, k).float() * smooth_inv.float()
    vx, sx, gx = nvfp4_quantize(x_s, per_row=True)
    wv = block_dequant(e2m1_decode(unpack_fp4(qweight)), wscale)
    acc = (block_dequant(vx, sx) @ wv.t()) * gx * wglobal.float()
    if lora_down.shape[0]:
        acc = acc + (x_s.to(x.dtype).float() @ lora_down.float().t()) @ lora_up.float().t()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], n)


# ------------------------------------------------------------------------------- fp8 (Hopper) operands
def split_scale(scale8: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """e4m3 block scales -> fp32 ``(s_hi, s_lo)``, ``s_hi + s_lo == s``: s_hi keeps the sign, the exponent and the
    first mantissa bit (the bits of the byte masked by 0xFC), s_lo the last two mantissa bits."""
    bits = aten.view.dtype(scale8, torch.uint8)
    hi = aten._to_copy.default(aten.view.dtype(aten.bitwise_and.Scalar(bits, 0xFC), FP8_DTYPE), dtype=_F32)
    return hi, aten.sub.Tensor(aten._to_copy.default(scale8, dtype=_F32), hi)


def nvfp4_fp8_operand(values: torch.Tensor, scale8: torch.Tensor, weight_side: bool,
                      dims: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """e2m1 values [R, K] and their block scales -> the e4m3 operand [R, 4K] of the exact split GEMM (module
    docstring): ``[hi | hi | lo | lo]`` for the activations, ``[hi | lo | hi | lo]`` for the weight, each part
    ``values * s_part * 2**-3``."""
    hi_s, lo_s = split_scale(scale8)
    parts = []
    for s in (hi_s, lo_s):
        p = aten.mul.Tensor(_times_block(values, s, dims or values.shape), SPLIT_SHIFT)
        parts.append(aten._to_copy.default(p, dtype=FP8_DTYPE))
    hi, lo = parts
    order = [hi, lo, hi, lo] if weight_side else [hi, hi, lo, lo]
    return aten.cat.default(order, 1)


def _times_block(values: torch.Tensor, s: torch.Tensor, dims: Tuple[int, int]) -> torch.Tensor:
    r, k = dims
    return aten.view.default(aten.mul.Tensor(aten.view.default(values, [r, k // BLOCK, BLOCK]),
                                             aten.unsqueeze.default(s, 2)), [r, k])


@dataclass
class SVDQuantNVFP4Weight(TensorTable):
    """The NVFP4 SVDQuant form of one linear. Shapes: qweight uint8 [N, K/2], wscale e4m3 [N, K/16], wglobal fp32
    [1], lora_down [rank, K] and lora_up [N, rank] (activation dtype), smooth_inv fp32 [K], bias [N] or None."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    wglobal: torch.Tensor
    lora_down: torch.Tensor
    lora_up: torch.Tensor
    smooth_inv: torch.Tensor
    bias: Optional[torch.Tensor]
    N: int
    K: int
    rank: int
    _tensor_fields = TENSOR_FIELDS  # not annotated: a class constant, not a field

    def __post_init__(self) -> None:
        n, k, r = self.N, self.K, self.rank
        check_block_dim(k)
        expect = {"qweight": ((n, k // 2), torch.uint8), "wscale": ((n, k // BLOCK), FP8_DTYPE),
                  "wglobal": ((1,), _F32), "lora_down": ((r, k), None), "lora_up": ((n, r), None),
                  "smooth_inv": ((k,), _F32)}
        if self.bias is not None:
            expect["bias"] = ((n,), None)
        self.check_fields(expect, f"N={n}, K={k}, rank={r}")

    def effective_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight this stands for (ignoring activation quantization)."""
        w_s = dequantize_weight_nvfp4(self.qweight, self.wscale, self.wglobal)
        if self.rank:
            w_s = w_s + self.lora_up.float() @ self.lora_down.float()
        return w_s * self.smooth_inv.unsqueeze(0)


def prepare_svdquant_nvfp4(weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                           act_absmax: Optional[torch.Tensor] = None, rank: int = 32, alpha: float = 0.5,
                           smooth: str = "act", seed: int = 0, dtype: Optional[torch.dtype] = None,
                           svd: str = "low", refine_iters: int = 0,
                           smooth_scale: Optional[torch.Tensor] = None) -> SVDQuantNVFP4Weight:
    """SVDQuant's smoothing and low-rank branch exactly as :func:`svdquant.prepare_svdquant` (``smooth_scale``: an
    explicit smoothing vector), the residual in NVFP4."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D float tensor [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    check_block_dim(k)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    dtype = dtype or weight.dtype
    w = weight.detach().float()
    s = smoothing_vector(w, act_absmax, alpha, smooth) if smooth_scale is None else given_smoothing(smooth_scale, k)
    lora_up, lora_down, residual = low_rank_split(w * s.unsqueeze(0), rank, seed, dtype, svd, refine_iters,
                                                  lambda r: dequantize_weight_nvfp4(*quantize_weight_nvfp4(r)))
    qweight, wscale, wglobal = quantize_weight_nvfp4(residual)
    b = None if bias is None else bias.detach().clone()
    return SVDQuantNVFP4Weight(qweight, wscale, wglobal, lora_down, lora_up, (1.0 / s).contiguous(), b, N=n, K=k,
                               rank=lora_down.shape[0])
