"""fp8 (e4m3) and int8 linears with dynamic activation scales, as reference code plus CUDA fast paths.

fp8, granularity ``"per_row"``: activation scale per token, weight scale per output row;
granularity ``"per_tensor"``: one scale each. Scale = amax / 448 (e4m3fn's largest finite value),
a zero scale becomes 1; weights are ``(t / scale).clamp(-448, 448)`` cast to ``float8_e4m3fn``, activations
``(t * (1 / scale)).clamp(-448, 448)`` (:func:`quantize_fp8_act`: one division per token, as the graph form and the
row-quantization kernel compute it; it differs from ``t / scale`` in the last fp32 bit at times, so in e4m3 only
where that bit decides a rounding tie).
int8, granularity ``"per_row"`` (activation per token, weight per output row) or ``"per_tensor"`` (one scale
each): scale = amax / 127, ``q = clamp(rint(t / scale), -127, 127)`` (symmetric).
Output: ``dot(q_x, q_w) * sx[m] * sw[n] + bias`` in fp32, cast to x.dtype (per tensor: ``sx * sw``).

The CUDA paths (fp8: ``torch._scaled_mm``, int8: ``torch._int_mm``) run where ``dit_passes.quant.dispatch``
allows them (fp8: sm_89+, K and N multiples of 16, row-wise scales only with bf16 output); every other
case runs the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .int4 import true_div

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127
FP8_GRANULARITIES = ("per_row", "per_tensor")
INT8_GRANULARITIES = ("per_row", "per_tensor")


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_fp8(t: torch.Tensor, granularity: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """2-D t [R, C] -> (fp8 [R, C], fp32 scale [R] for per_row or [] for per_tensor)."""
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"fp8 granularity must be one of {FP8_GRANULARITIES}, got {granularity!r}")
    tf = t.float()
    if granularity == "per_row":
        scale = _nonzero(true_div(tf.abs().amax(dim=1), FP8_MAX))
        q = tf / scale.unsqueeze(1)
    else:
        scale = _nonzero(true_div(tf.abs().amax(), FP8_MAX))
        q = tf / scale
    # clamped in place: preparing holds two fp32 copies of the weight at most, not three
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_fp8_act(t: torch.Tensor, granularity: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Activations 2-D t [R, C] -> (fp8 [R, C], fp32 scale [R, 1] per_row or [] per_tensor): the scale as
    :func:`quantize_fp8`'s, the values multiplied by its reciprocal (module docstring). The specification of
    ``dit_passes::fp8_quantize_rows`` (per_row) and of ``graph_forms.fp8_quantize``."""
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"fp8 granularity must be one of {FP8_GRANULARITIES}, got {granularity!r}")
    tf = t.float()
    amax = tf.abs().amax(dim=1, keepdim=True) if granularity == "per_row" else tf.abs().amax()
    scale = _nonzero(true_div(amax, FP8_MAX))
    inv = torch.ones_like(scale) / scale
    return (tf * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_int8_rows(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """2-D t [R, C] -> (int8 [R, C], fp32 scale [R]), symmetric per row."""
    return quantize_int8(t, "per_row")


def quantize_int8(t: torch.Tensor, granularity: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """2-D t [R, C] -> (int8 [R, C], fp32 scale [R] for per_row or [] for per_tensor), symmetric."""
    if granularity not in INT8_GRANULARITIES:
        raise ValueError(f"int8 granularity must be one of {INT8_GRANULARITIES}, got {granularity!r}")
    tf = t.float()
    if granularity == "per_row":
        scale = _nonzero(true_div(tf.abs().amax(dim=1), INT8_MAX))
        q = tf / scale.unsqueeze(1)
    else:
        scale = _nonzero(true_div(tf.abs().amax(), INT8_MAX))
        q = tf / scale
    # rounded and clamped in place: preparing holds two fp32 copies of the weight at most, not three
    return q.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@dataclass
class Fp8Weight:
    """fp8 weight [N, K] with scale fp32 [N] (per_row) or [] (per_tensor), bias [N] or None."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    bias: Optional[torch.Tensor]
    granularity: str = "per_row"

    def tensors(self) -> dict:
        out = {"qweight": self.qweight, "wscale": self.wscale}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


@dataclass
class Int8Weight:
    """int8 weight [N, K] with scale fp32 [N] (per_row) or [] (per_tensor), bias [N] or None."""

    qweight: torch.Tensor
    wscale: torch.Tensor
    bias: Optional[torch.Tensor]
    granularity: str = "per_row"

    def tensors(self) -> dict:
        out = {"qweight": self.qweight, "wscale": self.wscale}
        if self.bias is not None:
            out["bias"] = self.bias
        return out


def _check_weight(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a 2-D float tensor [N, K], got {weight.dtype} {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def prepare_fp8(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, granularity: str = "per_row") -> Fp8Weight:
    _check_weight(weight, bias)
    q, s = quantize_fp8(weight.detach(), granularity)
    return Fp8Weight(q.contiguous(), s, None if bias is None else bias.detach().clone(), granularity)


def prepare_int8(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, granularity: str = "per_row") -> Int8Weight:
    _check_weight(weight, bias)
    q, s = quantize_int8(weight.detach(), granularity)
    return Int8Weight(q.contiguous(), s, None if bias is None else bias.detach().clone(), granularity)


def _check_linear_args(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, per_row: bool) -> None:
    if qweight.dim() != 2 or x.shape[-1] != qweight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features but the weight is {tuple(qweight.shape)} [N, K]")
    want = (qweight.shape[0],) if per_row else ()
    if tuple(wscale.shape) != want and not (not per_row and wscale.numel() == 1):
        raise ValueError(f"wscale must have shape {want}, got {tuple(wscale.shape)}")


def _finish(acc: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor, n: int) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, granularity: str = "per_row") -> torch.Tensor:
    """Reference fp8 linear: x [..., K] -> [..., N] in x.dtype, dynamic activation scales."""
    per_row = granularity == "per_row"
    _check_linear_args(x, qweight, wscale, per_row)
    n, k = qweight.shape
    qx, sx = quantize_fp8_act(x.reshape(-1, k), granularity)
    acc = qx.float() @ qweight.float().t()
    if per_row:
        acc = acc * sx * wscale.float().unsqueeze(0)
    else:
        acc = acc * (sx * wscale.float().reshape(()))
    return _finish(acc, bias, x, n)


def fp8_linear_scaled_mm(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, granularity: str = "per_row") -> torch.Tensor:
    """fp8 linear through ``torch._scaled_mm`` (cuBLASLt), for the inputs ``dispatch.fp8_backend`` sends here."""
    per_row = granularity == "per_row"
    _check_linear_args(x, qweight, wscale, per_row)
    n, k = qweight.shape
    qx, sx = quantize_fp8_act(x.reshape(-1, k), granularity)
    if per_row:
        sa, sb = sx.contiguous(), wscale.float().reshape(1, n).contiguous()
    else:
        sa, sb = sx.reshape(()), wscale.float().reshape(())
    # qweight [N, K] row-major: its transpose is the column-major [K, N] operand cuBLASLt wants.
    out = torch._scaled_mm(qx, qweight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32 if not per_row
                           else torch.bfloat16)
    return _finish(out.float(), bias, x, n)


def _int_dot(qx: torch.Tensor, qw: torch.Tensor, int_mm: bool) -> torch.Tensor:
    """Exact int32 [M, N] = qx [M, K] int8 @ qw [N, K].T (``torch._int_mm`` when ``int_mm``)."""
    if int_mm:
        return torch._int_mm(qx, qw.t())
    if qx.device.type == "cpu":
        return qx.to(torch.int32) @ qw.to(torch.int32).t()
    # fp64 is exact here: |sum| <= 127**2 * K < 2**53 for any realistic K.
    return (qx.double() @ qw.double().t()).to(torch.int32)


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, *, int_mm: bool = False,
                          granularity: str = "per_row") -> torch.Tensor:
    """int8 dynamic linear (per row, or per tensor: one scale for x, one for the weight): x [..., K] -> [..., N] in
    x.dtype; int32 accumulation, through ``torch._int_mm`` with ``int_mm`` (CUDA; ``dispatch.int8_backend``)."""
    per_row = granularity == "per_row"
    _check_linear_args(x, qweight, wscale, per_row=per_row)
    if qweight.dtype != torch.int8:
        raise TypeError(f"int8 linear needs an int8 weight, got {qweight.dtype}")
    n, k = qweight.shape
    qx, sx = quantize_int8(x.reshape(-1, k), granularity)
    acc = _int_dot(qx, qweight, int_mm).float()
    if per_row:
        acc = acc * sx.unsqueeze(1) * wscale.float().unsqueeze(0)
    else:
        acc = acc * (sx * wscale.float().reshape(()))
    return _finish(acc, bias, x, n)
