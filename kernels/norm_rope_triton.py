"""q / k RMSNorm and interleaved rotary embedding in one read and one write.

:func:`rms_norm_rope_into` is the CUDA implementation of ``dit_passes::rms_norm_rope`` (its specification: the
ATen ops it replaces, ``dit_passes.passes.norm_rope.rms_norm_rope_reference``). Per row of ``D`` values (one head of
one token)::

    xf   = float(x[row, :])
    y    = round(xf * rsqrt(mean(xf^2) + eps) * w)          # the norm's output, rounded to x's dtype once
    out[2j]   = y[2j] * cos[2j] - y[2j+1] * sin[2j]          # fp32, rounded once to x's dtype
    out[2j+1] = y[2j+1] * cos[2j+1] + y[2j] * sin[2j+1]

or with ``half_split`` the same with the pairs (j, j + D/2) in place of (2j, 2j + 1) (``cat([-x2, x1], -1)``): the
program loads the two halves as two tiles.

Why a kernel: Inductor writes this chain (reduction, then the pair swap of ``stack([-x1, x0], -1)``) as one
reduction kernel per head row, at about a third of an H100's memory bandwidth on FLUX.1-dev's single blocks
(``bench/results/quant_step_epilogues_h100.json``). Here a program takes ``BLOCK_R`` rows at once, reads each
row once and writes it once, the pairs split in registers: about twice the bandwidth
(``bench/results/norm_rope_kernel_h100.json``). ``x``, ``out``, ``cos`` and ``sin`` are 4-D with any
strides (``cos`` / ``sin`` broadcast to ``out``'s shape: stride 0 on the broadcast dims) and a unit last stride for
``x`` and ``out``; a concatenation along a leading dim is one call per part on a ``narrow`` of ``out``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .w4a4_autotune import interpreting

# head rows per program and warps: the fastest choice on an H100 for FLUX's q of a single block (4608 x 24 x 128
# bf16), against Inductor's kernel (bench/results/norm_rope_kernel_h100.json: GPU time in a replayed CUDA graph)
ROWS = 8
WARPS = 2
MAX_D = 1024         # widest head a program holds in registers
MAX_GROUPED = 16384  # widest norm over all heads (Wan's 5120): looped over its heads, the row read twice
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, d1, d2, D, eps,
                   sx0, sx1, sx2, so0, so1, so2, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                   HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, HALF_D: tl.constexpr, SOFT_BF16: tl.constexpr,
                   HALF_SPLIT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    i0, i1, i2 = rows // (d1 * d2), (rows // d2) % d1, rows % d2
    xrow, orow = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None], (i0 * so0 + i1 * so1 + i2 * so2)[:, None]
    crow, srow = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None], (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    if HALF_SPLIT:
        # pairs (j, j + D/2): the two halves as two tiles, each loaded and stored contiguously (a gather that
        # interleaves them in registers ran at a fraction of the bandwidth)
        j = tl.arange(0, HALF_D)
        valid = j < D // 2
        mask = (rows < n_rows)[:, None] & valid[None, :]
        c1, c2 = j[None, :].to(tl.int64), (j + D // 2)[None, :].to(tl.int64)
        x1 = tl.load(x_ptr + xrow + c1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xrow + c2, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
        y1, y2 = x1 * rstd[:, None], x2 * rstd[:, None]
        if HAS_W:
            y1 = y1 * tl.load(w_ptr + j, mask=valid, other=0.0).to(tl.float32)[None, :]
            y2 = y2 * tl.load(w_ptr + j + D // 2, mask=valid, other=0.0).to(tl.float32)[None, :]
        y1 = _rounded(y1, out_ptr, SOFT_BF16).to(tl.float32)
        y2 = _rounded(y2, out_ptr, SOFT_BF16).to(tl.float32)
        cos1 = tl.load(cos_ptr + crow + c1 * sc3, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + crow + c2 * sc3, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + srow + c1 * ss3, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + srow + c2 * ss3, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + orow + c1, _rounded(y1 * cos1 - y2 * sin1, out_ptr, SOFT_BF16), mask=mask)
        tl.store(out_ptr + orow + c2, _rounded(y2 * cos2 + y1 * sin2, out_ptr, SOFT_BF16), mask=mask)
    else:
        cols = tl.arange(0, 2 * HALF_D)  # register position: pair cols // 2, member cols % 2
        valid = cols < D
        mask = (rows < n_rows)[:, None] & valid[None, :]
        c = cols[None, :].to(tl.int64)
        xf = tl.load(x_ptr + xrow + c, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
        y = xf * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
        y = _rounded(y, out_ptr, SOFT_BF16).to(tl.float32)  # the norm's output is a tensor of x's dtype in the graph
        cos = tl.load(cos_ptr + crow + c * sc3, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + srow + c * ss3, mask=mask, other=0.0)
        out = _rotate_pairs(y, cos, sin, BLOCK_R, HALF_D)
        tl.store(out_ptr + orow + c, _rounded(out, out_ptr, SOFT_BF16), mask=mask)


@triton.jit
def _rms_norm_rope_grouped(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, d1, D, eps,
                           sx0, sx1, so0, so1, so2, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                           H: tl.constexpr, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, HALF_D: tl.constexpr,
                           SOFT_BF16: tl.constexpr):
    # a norm over the H * D values of a token (x: [B, S, H * D]), then the interleaved rope of each of its H
    # heads (out, cos, sin: [B, S, H, D]): a first loop over the heads sums the squares, a second normalises,
    # rounds the norm's output to x's dtype and rotates each head (its second read mostly from L2)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    i0, i1 = rows // d1, rows % d1
    xrow = (i0 * sx0 + i1 * sx1)[:, None]
    cols = tl.arange(0, 2 * HALF_D)
    valid = cols < D
    mask = (rows < n_rows)[:, None] & valid[None, :]
    c = cols[None, :].to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h in range(0, H):
        xf = tl.load(x_ptr + xrow + h * D + c, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(xf * xf, axis=1)
    rstd = tl.math.rsqrt(acc / (H * D) + eps)
    for h in range(0, H):
        xf = tl.load(x_ptr + xrow + h * D + c, mask=mask, other=0.0).to(tl.float32)
        y = xf * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + h * D + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
        y = _rounded(y, out_ptr, SOFT_BF16).to(tl.float32)
        orow = (i0 * so0 + i1 * so1 + h * so2)[:, None]
        crow, srow = (i0 * sc0 + i1 * sc1 + h * sc2)[:, None], (i0 * ss0 + i1 * ss1 + h * ss2)[:, None]
        cos = tl.load(cos_ptr + crow + c * sc3, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + srow + c * ss3, mask=mask, other=0.0)
        out = _rotate_pairs(y, cos, sin, BLOCK_R, HALF_D)
        tl.store(out_ptr + orow + c, _rounded(out, out_ptr, SOFT_BF16), mask=mask)


@triton.jit
def _rotate_pairs(y, cos, sin, BLOCK_R: tl.constexpr, HALF_D: tl.constexpr):
    # the interleaved rope of y's rows (fp32): each pair (2j, 2j + 1) rotated by its slots' cos / sin
    ye, yo = tl.split(tl.reshape(y, [BLOCK_R, HALF_D, 2]))
    ce, co = tl.split(tl.reshape(cos.to(tl.float32), [BLOCK_R, HALF_D, 2]))
    se, so = tl.split(tl.reshape(sin.to(tl.float32), [BLOCK_R, HALF_D, 2]))
    return tl.reshape(tl.join(ye * ce - yo * se, yo * co + ye * so), [BLOCK_R, 2 * HALF_D])


@triton.jit
def _rounded(v, out_ptr, SOFT_BF16: tl.constexpr):
    # fp32 -> out's dtype, round to nearest even. The interpreter's bf16 cast truncates: there (CPU tests) the
    # rounding is done on the bits first, so the cast that follows is exact
    if SOFT_BF16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = bits.to(tl.float32, bitcast=True)
    return v.to(out_ptr.dtype.element_ty)


def is_supported(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x``: a float tensor of rank <= 4 with an even last dim <= MAX_D, on a GPU (or any
    device under the interpreter)."""
    ok = x.dtype in _DTYPES and 1 <= x.dim() <= 4 and x.shape[-1] % 2 == 0 and 0 < x.shape[-1] <= MAX_D
    return ok and (x.device.type == "cuda" or interpreting())


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def rms_norm_rope_into(x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       out: torch.Tensor, half_split: bool = False, rows: int = ROWS,
                       num_warps: int = WARPS) -> torch.Tensor:
    """Write RMSNorm(x) with the interleaved (or with ``half_split`` the half-split) rotary embedding into ``out``
    (module docstring); ``cos`` / ``sin`` broadcast to ``out``'s shape. Returns ``out``. ``rows`` / ``num_warps``:
    the launch (bench/norm_rope_kernel.py times the choices)."""
    name = "rms_norm_rope"
    if not is_supported(x) or out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"{name}: x must be a float tensor of rank <= 4 with an even last dim <= {MAX_D} on a GPU "
                         f"and out of its shape with a unit last stride; got x {x.dtype} {tuple(x.shape)} on "
                         f"{x.device}, out {tuple(out.shape)} strides {out.stride()}. Use the op's reference off GPU.")
    x = x if x.stride(-1) == 1 else x.contiguous()
    x4, o4 = _as_4d(x), _as_4d(out)
    c4, s4 = _as_4d(cos.expand(out.shape)), _as_4d(sin.expand(out.shape))
    d = x.shape[-1]
    n_rows = x4.shape[0] * x4.shape[1] * x4.shape[2]
    if n_rows == 0:
        return out
    w = weight if weight is not None else x  # an unread placeholder pointer when there is no weight
    _rms_norm_rope[(triton.cdiv(n_rows, rows),)](
        x4, w, c4, s4, o4, n_rows, x4.shape[1], x4.shape[2], d, float(eps),
        *x4.stride()[:3], *o4.stride()[:3], *c4.stride(), *s4.stride(),
        HAS_W=weight is not None, BLOCK_R=rows, HALF_D=triton.next_power_of_2(d) // 2,
        SOFT_BF16=interpreting() and out.dtype == torch.bfloat16, HALF_SPLIT=bool(half_split), num_warps=num_warps)
    return out


def is_supported_grouped(x: torch.Tensor, rope_dim: int, half_split: bool = False) -> bool:
    """Whether :func:`rms_norm_rope_grouped_into` takes ``x``: a float tensor of rank 2 or 3 whose last dim, at
    most MAX_GROUPED, holds heads of an even ``rope_dim`` <= MAX_D, the interleaved rope, on a GPU (or any device
    under the interpreter)."""
    ok = x.dtype in _DTYPES and 2 <= x.dim() <= 3 and 0 < x.shape[-1] <= MAX_GROUPED and not half_split
    ok = ok and 0 < rope_dim <= MAX_D and rope_dim % 2 == 0 and x.shape[-1] % rope_dim == 0
    return ok and (x.device.type == "cuda" or interpreting())


def rms_norm_rope_grouped_into(x: torch.Tensor, weight, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                               out: torch.Tensor, half_split: bool = False, rows: int = ROWS,
                               num_warps: int = WARPS) -> torch.Tensor:
    """RMSNorm of each token's whole row of ``x`` ([..., H * D]) and the interleaved rope of its heads, into
    ``out`` ([..., H, D]; ``cos`` / ``sin`` broadcast to it). Returns ``out``."""
    d = out.shape[-1]
    if not is_supported_grouped(x, d, half_split) or tuple(out.shape) != tuple(x.shape[:-1]) + (x.shape[-1] // d, d) \
            or out.stride(-1) != 1:
        raise ValueError(f"rms_norm_rope (grouped): x must be a float tensor of rank 2 or 3, its last dim at most "
                         f"{MAX_GROUPED} a multiple of an even head size <= {MAX_D}, interleaved pairs, on a GPU, and "
                         f"out [..., heads, head size] with a unit last stride; got x {x.dtype} {tuple(x.shape)} on "
                         f"{x.device}, out {tuple(out.shape)}, half_split={half_split}. Use the op's reference.")
    x = x if x.stride(-1) == 1 else x.contiguous()
    x3, o4 = x, out
    while x3.dim() < 3:
        x3, o4 = x3.unsqueeze(0), o4.unsqueeze(0)
    c4, s4 = cos.expand(out.shape), sin.expand(out.shape)
    while c4.dim() < 4:
        c4, s4 = c4.unsqueeze(0), s4.unsqueeze(0)
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows == 0:
        return out
    w = weight if weight is not None else x
    _rms_norm_rope_grouped[(triton.cdiv(n_rows, rows),)](
        x3, w, c4, s4, o4, n_rows, x3.shape[1], d, float(eps),
        *x3.stride()[:2], *o4.stride()[:3], *c4.stride(), *s4.stride(),
        H=o4.shape[2], HAS_W=weight is not None, BLOCK_R=rows, HALF_D=triton.next_power_of_2(d) // 2,
        SOFT_BF16=interpreting() and out.dtype == torch.bfloat16, num_warps=num_warps)
    return out


__all__ = ["rms_norm_rope_into", "rms_norm_rope_grouped_into", "is_supported", "is_supported_grouped", "ROWS",
           "WARPS", "MAX_D", "MAX_GROUPED"]
