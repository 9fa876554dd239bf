"""W4A4 arithmetic: int4 packing, per-group activation/weight quantization and the reference GEMM.

This module is the executable specification that the Triton kernels (kernels/w4a4_triton.py) must
reproduce. Every step is written out in plain PyTorch, in the order the spec gives it:

* group size ``GROUP_SIZE = 64`` along K (the input features);
* activations: ``x_s = x.float() * smooth_inv``; per token m and group g,
  ``ascale[m, g] = amax|x_s[m, g]| / 7`` (fp32, true division), a zero scale becomes 1.0,
  ``q_x = clamp(rint(x_s / ascale), -8, 7)``;
* weights (offline): per row n and group g, ``wscale[n, g] = bf16(amax|R[n, g]| / 7)``, a zero scale
  becomes 1, ``q_w = clamp(rint(R / wscale.float()), -8, 7)``;
* packing: int4 two's complement, two values per uint8 along K, the even index in the low nibble;
* GEMM: ``out[m, n] = sum_g (ascale[m, g] * wscale[n, g]) * float(int32 dot_g(q_x[m], q_w[n]))``,
  accumulated in fp32 in group order, plus the low-rank branch
  ``(x_s in act dtype).float() @ lora_down.float().T @ lora_up.float().T``, plus bias; cast to x.dtype.

``rint`` is ``torch.round`` (round half to even). Every division is IEEE true division (see
:func:`true_div`; a Triton kernel needs ``tl.math.div_rn``, its ``/`` on fp32 is approximate).
The zero-scale rule is applied to the computed scale (``scale == 0``), which is the same as
"amax == 0" except for groups whose amax is so small that ``amax / 7`` underflows to 0, where it
avoids 0/0.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

aten = torch.ops.aten
GROUP_SIZE = 64
INT4_MIN, INT4_MAX = -8, 7


def check_group_dim(k: int, what: str = "K (in_features)") -> None:
    """Raise if ``k`` is not a positive multiple of the group size."""
    if k <= 0 or k % GROUP_SIZE != 0:
        raise ValueError(
            f"W4A4 needs {what} to be a positive multiple of the group size {GROUP_SIZE}, got {k}; "
            f"exclude this linear from W4A4 quantization (or pad its input features)")


def pack_int4(q: torch.Tensor, check_range: bool = True) -> torch.Tensor:
    """Pack int4 values (an integer tensor with values in [-8, 7], last dim even) into uint8.

    ``byte[..., i] = (q[..., 2i] & 0xF) | ((q[..., 2i + 1] & 0xF) << 4)``; result shape [..., K/2].
    ``check_range=False`` skips the range check (a host sync) for values already clamped.
    """
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"pack_int4 expects an integer tensor, got {q.dtype}; round and cast first")
    if q.shape[-1] % 2 != 0:
        raise ValueError(f"pack_int4 needs an even last dimension, got shape {tuple(q.shape)}")
    if check_range and q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError(f"pack_int4 values must lie in [{INT4_MIN}, {INT4_MAX}], got "
                         f"[{int(q.min())}, {int(q.max())}]")
    q8 = q.to(torch.uint8)  # two's complement bits (the cast wraps): a byte per value, not four
    lo = q8[..., 0::2] & 0xF
    hi = (q8[..., 1::2] & 0xF) << 4
    return lo | hi


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [..., K/2] -> int8 [..., K] with values in [-8, 7]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 expects uint8 packed data, got {packed.dtype}")
    return int4_values(packed, torch.int8)


def int4_values(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int4 values of ``packed`` (uint8 [..., K/2], as :func:`pack_int4` writes them) as ``dtype`` [..., K].

    ATen ops only, with no Python on shapes or values, so that the graph forms (``graph_forms.py``) can call it and
    ``torch.fx.symbolic_trace`` of them yields ``call_function`` nodes: each nibble is split off in uint8 and
    flipped to offset binary (``v ^ 8 = v + 8`` for a two's complement nibble v in [-8, 7]), cast, and re-centred
    (``- 8``, exact in every signed integer and float dtype). The even index is the low nibble.
    """
    lo = aten.bitwise_xor.Scalar(aten.bitwise_and.Scalar(packed, 15), 8)
    hi = aten.bitwise_xor.Scalar(aten.bitwise_right_shift.Tensor_Scalar(packed, 4), 8)
    offset = aten.flatten.using_ints(aten.stack.default([lo, hi], -1), -2, -1)
    return aten.sub.Tensor(aten._to_copy.default(offset, dtype=dtype), 8)


def true_div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """IEEE (correctly rounded) ``a / divisor``.

    ``tensor / python_float`` is not that on CUDA: PyTorch turns a division by a CPU scalar into a
    multiplication by its reciprocal, which differs in the last bit (e.g. for ``amax / 7``). Dividing
    by a 0-dim tensor on a's device takes the true-division path on every device.
    """
    return a / torch.full((), divisor, dtype=a.dtype, device=a.device)


def _groups(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K/64, 64] view."""
    return t.reshape(t.shape[0], t.shape[1] // GROUP_SIZE, GROUP_SIZE)


def quantize_activation_w4(x: torch.Tensor, smooth_inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-group int4 activation quantization.

    x: [..., K] (any float dtype); smooth_inv: [K] fp32 (``1 / s``).
    Returns ``(packed uint8 [M, K/2], ascale fp32 [M, K/64])`` with M = prod(x.shape[:-1]).
    """
    k = x.shape[-1]
    check_group_dim(k)
    if smooth_inv.shape != (k,):
        raise ValueError(f"smooth_inv must have shape ({k},), got {tuple(smooth_inv.shape)}")
    x_s = x.reshape(-1, k).float() * smooth_inv.float()
    return _quantize_smoothed_activation(x_s)


def _quantize_smoothed_activation(x_s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    g = _groups(x_s)
    ascale = true_div(g.abs().amax(dim=-1), 7.0)
    ascale = torch.where(ascale == 0, torch.ones_like(ascale), ascale)
    q = torch.clamp(torch.round(g / ascale.unsqueeze(-1)), INT4_MIN, INT4_MAX).to(torch.int8)
    return pack_int4(q.reshape(x_s.shape), check_range=False), ascale


def fused_act_quant_reference(x: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of the kernel's fused activation step (same signature as ``fused_act_quant``).

    Returns ``(qx_packed uint8 [M, K/2], ascale fp32 [M, K/64], lora_act fp32 [M, r])`` where
    ``lora_act = (x_s cast to x.dtype).float() @ lora_down.float().T``.
    """
    k = x.shape[-1]
    check_group_dim(k)
    if smooth_inv.shape != (k,):
        raise ValueError(f"smooth_inv must have shape ({k},), got {tuple(smooth_inv.shape)}")
    if lora_down.dim() != 2 or lora_down.shape[1] != k:
        raise ValueError(f"lora_down must have shape [rank, {k}], got {tuple(lora_down.shape)}")
    x_s = x.reshape(-1, k).float() * smooth_inv.float()
    packed, ascale = _quantize_smoothed_activation(x_s)
    lora_act = x_s.to(x.dtype).float() @ lora_down.float().t()
    return packed, ascale, lora_act


CLIP_STEP = 0.02  # mse_clip: the candidate scales are amax * (1 - CLIP_STEP * i) / 7, i < mse_clip
CHUNK_ELEMENTS = 2 ** 22  # quantize_weight_w4 works on about this many weights at a time (16 MiB in fp32)


def _scale_w4(g: torch.Tensor, ratio: float) -> torch.Tensor:
    """bf16 group scales ``amax * ratio / 7`` of fp32 groups [R, G, 64], a zero scale made 1."""
    amax = g.abs().amax(dim=-1)
    wscale = true_div(amax * ratio if ratio != 1.0 else amax, 7.0).to(torch.bfloat16)
    return torch.where(wscale == 0, torch.ones_like(wscale), wscale)


def _round_w4(g: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    return (g / wscale.float().unsqueeze(-1)).round_().clamp_(INT4_MIN, INT4_MAX)  # in place: one temporary


def _w4_error(g: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """Per group, the squared error of rounding ``g`` to int4 at ``wscale``: ``(_round_w4(g, s) * s - g)^2`` summed,
    computed in one temporary of ``g``'s size (in place), so a candidate search holds two copies of the weight."""
    s = wscale.float().unsqueeze(-1)
    r = g / s
    return r.round_().clamp_(INT4_MIN, INT4_MAX).mul_(s).sub_(g).square_().sum(-1)


def _mse_scale_w4(g: torch.Tensor, candidates: int) -> torch.Tensor:
    """Per group, of the scales ``amax * (1 - CLIP_STEP * i) / 7`` (i < candidates), the one whose int4 rounding
    leaves the least squared error (ties: the larger scale)."""
    best = _scale_w4(g, 1.0)
    best_err = _w4_error(g, best)
    for i in range(1, candidates):
        s = _scale_w4(g, 1.0 - CLIP_STEP * i)
        err = _w4_error(g, s)
        better = err < best_err
        best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def quantize_weight_w4(residual: torch.Tensor, mse_clip: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Offline per-row, per-group int4 weight quantization of ``residual`` [N, K] (any float dtype).

    ``mse_clip`` > 1 (weight-only int4): each group's scale is the best for squared error of ``mse_clip``
    candidates clipping amax by 0, 2, 4, ... % (outliers then round to -8 / 7 and the rest more finely). Rows are
    quantized ``CHUNK_ELEMENTS // K`` at a time (each row on its own: the same values). Returns ``(packed uint8 [N, K/2], wscale bf16 [N, K/64])``.
    """
    if residual.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(residual.shape)}")
    n, k = residual.shape
    check_group_dim(k)
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=residual.device)
    wscale = torch.empty(n, k // GROUP_SIZE, dtype=torch.bfloat16, device=residual.device)
    step = _chunk_rows(n, k)
    for start in range(0, n, step):
        g = _groups(residual[start:start + step].float())
        ws = _mse_scale_w4(g, mse_clip) if mse_clip > 1 else _scale_w4(g, 1.0)
        packed[start:start + step] = pack_int4(_round_w4(g, ws).to(torch.int8).reshape(-1, k), check_range=False)
        wscale[start:start + step] = ws
    return packed, wscale


def _chunk_rows(n: int, k: int) -> int:
    """Rows of an [n, k] weight to quantize at a time: about CHUNK_ELEMENTS values, and at most a quarter of the
    weight, so the temporaries stay a few MiB for a large weight and a fraction of a small one (each row is
    quantized on its own: the chunking never changes a value)."""
    return max(1, min(CHUNK_ELEMENTS // k, -(-n // 4)))


def fake_quant_w4_(w: torch.Tensor, mse_clip: int = 0) -> torch.Tensor:
    """``w`` (fp32 [N, K]) replaced in place by ``dequantize_weight_w4(*quantize_weight_w4(w, mse_clip))``, a chunk
    of rows at a time (the same values): a refinement round holds no second full copy of the weight. Returns ``w``."""
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"fake_quant_w4_ takes an fp32 [N, K] weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    step = _chunk_rows(n, k)
    for start in range(0, n, step):
        w[start:start + step] = dequantize_weight_w4(*quantize_weight_w4(w[start:start + step], mse_clip))
    return w


def dequantize_weight_w4(packed: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] value of a quantized weight: ``q_w * wscale`` per group."""
    q = _groups(unpack_int4(packed).float())
    return q.mul_(wscale.float().unsqueeze(-1)).reshape(packed.shape[0], packed.shape[1] * 2)  # in place: one copy


def group_int_dots(qx: torch.Tensor, qw: torch.Tensor, g: int) -> torch.Tensor:
    """int32 [M, N] dot products over group ``g`` of int4 values qx [M, K] and qw [N, K] (int8).

    On CPU the products are accumulated in int32. Other devices have no integer matmul, so the dot
    runs in fp32, which is exact here: each product is at most 64 in magnitude and a group sums 64 of
    them, so every partial sum is an integer below 2**13, far inside fp32's exact-integer range
    (this also holds under TF32, whose 10-bit mantissa represents the int4 inputs exactly).
    """
    sl = slice(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
    a, b = qx[:, sl], qw[:, sl]
    if qx.device.type == "cpu":
        return a.to(torch.int32) @ b.to(torch.int32).t()
    return (a.float() @ b.float().t()).to(torch.int32)


def w4a4_gemm_reference(qx_packed: torch.Tensor, ascale: torch.Tensor, qw_packed: torch.Tensor,
                        wscale: torch.Tensor, lora_act: Optional[torch.Tensor] = None,
                        lora_up: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference W4A4 GEMM (same signature as the kernel's ``w4a4_gemm``).

    qx_packed uint8 [M, K/2], ascale fp32 [M, K/64], qw_packed uint8 [N, K/2], wscale bf16 [N, K/64],
    lora_act fp32 [M, r] and lora_up [N, r] (both or neither), bias [N] or None.
    ``acc = 0; for g: acc = acc + (ascale[:, g, None] * wscale[None, :, g]) * float(dot_g)``, all fp32,
    then ``acc + lora_act @ lora_up.float().T`` then ``+ bias.float()``; returned as ``out_dtype``.
    """
    m, kh = qx_packed.shape
    n = qw_packed.shape[0]
    k = kh * 2
    ng = k // GROUP_SIZE
    if qw_packed.shape[1] != kh:
        raise ValueError(f"packed activation has K/2={kh} but packed weight has {qw_packed.shape[1]}")
    if ascale.shape != (m, ng) or wscale.shape != (n, ng):
        raise ValueError(f"scale shapes must be ascale [{m}, {ng}] and wscale [{n}, {ng}], "
                         f"got {tuple(ascale.shape)} and {tuple(wscale.shape)}")
    if (lora_act is None) != (lora_up is None):
        raise ValueError("pass both lora_act and lora_up, or neither")
    qx, qw = unpack_int4(qx_packed), unpack_int4(qw_packed)
    a_s, w_s = ascale.float(), wscale.float()
    acc = torch.zeros(m, n, dtype=torch.float32, device=qx_packed.device)
    for g in range(ng):
        scale = a_s[:, g : g + 1] * w_s[:, g].unsqueeze(0)
        acc = acc + scale * group_int_dots(qx, qw, g).float()
    if lora_act is not None and lora_act.shape[1] > 0:
        acc = acc + lora_act.float() @ lora_up.float().t()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def w4a4_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                          lora_down: torch.Tensor, lora_up: torch.Tensor, smooth_inv: torch.Tensor,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The whole W4A4 linear on plain tensors: x [..., K] -> [..., N] in x.dtype.

    qweight uint8 [N, K/2], wscale bf16 [N, K/64], lora_down [r, K], lora_up [N, r] (r may be 0),
    smooth_inv fp32 [K], bias [N] or None.
    """
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.shape[1] * 2 != k:
        raise ValueError(f"input has K={k} features but qweight packs K={qweight.shape[1] * 2}")
    if lora_up.shape != (n, lora_down.shape[0]):
        raise ValueError(f"lora_up must have shape [{n}, {lora_down.shape[0]}], got {tuple(lora_up.shape)}")
    qx, ascale, lora_act = fused_act_quant_reference(x, smooth_inv, lora_down)
    out = w4a4_gemm_reference(qx, ascale, qweight, wscale, lora_act, lora_up, bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], n)
