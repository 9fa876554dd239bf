"""Block-scaled fp8 (e4m3) linears: cache-dit's ``float8_per_block`` (torchao's ``PerBlock([1, 128])`` activations,
``PerBlock([128, 128])`` weights).

Weight [N, K]: one fp32 scale per tile of ``block x block`` (``wscale [N / block, K / block]``), activations: one
dynamic fp32 scale per token and per ``block`` consecutive input features (``sx [M, K / block]``). Each scale is
``amax / 448`` over its tile (a zero scale becomes 1), values ``e4m3(clamp(t / scale, -448, 448))``, as the per-row
form (``fp8_int8.quantize_fp8``). N and K must be multiples of ``block`` (cache-dit leaves the other linears in
their precision; so do the passes: ``Fp8Linear.cannot_quantize``).

Output (reference, any device): the dequantized operands multiplied in fp32, ``(qx * sx) @ (qw * sw).T + bias``, cast
to x.dtype: the same sum as the block-scaled GEMM (per K block ``dot(qx, qw) * sx[m, kb] * sw[nb, kb]``) up to
fp32 rounding order.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .fp8_int8 import FP8_DTYPE, FP8_MAX, Fp8Weight, _check_weight, _finish, _nonzero
from .int4 import true_div

BLOCK = 128  # cache-dit's (torchao's) only supported tile


def _blocks(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """2-D t [R, C] -> [R / rows, rows, C / cols, cols] (a view)."""
    r, c = t.shape
    if r % rows or c % cols:
        raise ValueError(f"a [{r}, {c}] tensor does not split into [{rows}, {cols}] blocks: both dims must be "
                         "multiples of the block")
    return t.reshape(r // rows, rows, c // cols, cols)


def quantize_fp8_blocks(t: torch.Tensor, rows: int, cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """2-D t [R, C] -> (e4m3 [R, C], fp32 scale [R / rows, C / cols]), one scale per ``rows x cols`` tile."""
    b = _blocks(t.float(), rows, cols)
    scale = _nonzero(true_div(b.abs().amax(dim=(1, 3)), FP8_MAX))                  # [R/rows, C/cols]
    q = (b / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(t.shape), scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor [R, C] of e4m3 values ``q`` and tile scales ``scale`` [R / rows, C / cols]."""
    r, c = q.shape
    rows, cols = r // scale.shape[0], c // scale.shape[1]
    return (_blocks(q.float(), rows, cols) * scale.float()[:, None, :, None]).reshape(r, c)


def prepare_fp8_block(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, block: int = BLOCK) -> Fp8Weight:
    """Quantize one linear's weight [N, K] (N, K multiples of ``block``) to e4m3 per ``block x block`` tile."""
    _check_weight(weight, bias)
    q, s = quantize_fp8_blocks(weight.detach(), block, block)
    return Fp8Weight(q.contiguous(), s, None if bias is None else bias.detach().clone(), "per_block")


def check_fp8_block_args(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                         bias: Optional[torch.Tensor], op: str = "fp8_block_linear") -> int:
    """The block size the tensors imply; ValueError naming the mismatch."""
    n, k = qweight.shape if qweight.dim() == 2 else (0, 0)
    problems = []
    if qweight.dim() != 2 or qweight.dtype != FP8_DTYPE or x.shape[-1] != k:
        problems.append(f"qweight must be float8_e4m3fn [N, {x.shape[-1]}], got {qweight.dtype} {list(qweight.shape)}")
    block = n // wscale.shape[0] if wscale.dim() == 2 and wscale.shape[0] else 0
    if wscale.dim() != 2 or not block or tuple(wscale.shape) != (n // block, k // block) or n % block or k % block:
        problems.append(f"wscale must be [N / block, K / block] for qweight {list(qweight.shape)}, "
                        f"got {list(wscale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        problems.append(f"bias must be [{n}], got {list(bias.shape)}")
    if problems:
        raise ValueError(f"dit_passes::{op}: " + "; ".join(problems))
    return block


def fp8_block_linear_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block-scaled fp8 linear: x [..., K] -> [..., N] in x.dtype, dynamic activation scales per token and block."""
    block = check_fp8_block_args(x, qweight, wscale, bias)
    n, k = qweight.shape
    qx, sx = quantize_fp8_blocks(x.reshape(-1, k), 1, block)
    acc = dequantize_fp8_blocks(qx, sx) @ dequantize_fp8_blocks(qweight, wscale).t()
    return _finish(acc, bias, x, n)


__all__ = ["BLOCK", "quantize_fp8_blocks", "dequantize_fp8_blocks", "prepare_fp8_block", "fp8_block_linear_reference"]
