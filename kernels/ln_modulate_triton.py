"""AdaLN's LayerNorm and modulation in one read and one write, the gated residual before it optionally.

:func:`layer_norm_modulate_into` is the CUDA implementation of ``dit_passes::layer_norm_modulate`` (its
specification: the ATen ops it replaces, ``dit_passes.passes.norm_modulate.layer_norm_modulate_reference``). Per
row of ``D`` values (one token)::

    h    = round(r + g * y)                                  # with a residual; else h = x
    hf   = float(h)
    n    = (hf - mean(hf)) * rsqrt(var(hf) + eps) [* w + b]  # LayerNorm over the row, its affine optional
    out  = round(n * m + a)                                  # m: scale (or 1 + scale), a: shift, broadcast

all in fp32, each output rounded once to its dtype (``h`` to the residual's, ``out`` to ``out``'s).

Why a kernel: Inductor writes LayerNorm over a 3072-wide row as a looped reduction (its persistent reductions stop
at 1024 columns), reading each row twice; a program here holds its rows in registers, reads them once and writes
once. Tensors are up to 3-D (leading dims: batch, tokens) with any strides and a unit last stride for the row
tensors; ``g``, ``m``, ``a`` broadcast to the rows' shape (stride 0 on their broadcast dims), ``w`` / ``b`` are 1-D.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .norm_rope_triton import _rounded
from .w4a4_autotune import interpreting

# rows per program (at least; narrower rows take more, up to 4096 values a program) and warps: the fastest choice on
# an H100 at FLUX's single and double block shapes (bench/results/ln_modulate_kernel_h100.json)
ROWS = 1
WARPS = 4
MAX_D = 16384        # widest row a program holds in registers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _ln_modulate(y_ptr, r_ptr, g_ptr, h_ptr, w_ptr, b_ptr, m_ptr, a_ptr, out_ptr, n_rows, d1, D, eps,
                 sy0, sy1, sr0, sr1, sg0, sg1, sg2, sh0, sh1, sm0, sm1, sm2, sa0, sa1, sa2, so0, so1,
                 RESIDUAL: tl.constexpr, GATE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                 PLUS_ONE: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SOFT_H: tl.constexpr, SOFT_OUT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    i0, i1 = rows // d1, rows % d1
    cols = tl.arange(0, BLOCK_D)
    valid = cols < D
    mask = (rows < n_rows)[:, None] & valid[None, :]
    c = cols[None, :].to(tl.int64)
    hf = tl.load(y_ptr + (i0 * sy0 + i1 * sy1)[:, None] + c, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        if GATE:
            g = tl.load(g_ptr + (i0 * sg0 + i1 * sg1)[:, None] + c * sg2, mask=mask, other=0.0).to(tl.float32)
            hf = hf * g
        hf += tl.load(r_ptr + (i0 * sr0 + i1 * sr1)[:, None] + c, mask=mask, other=0.0).to(tl.float32)
        h = _rounded(hf, h_ptr, SOFT_H)  # the residual stream is a tensor of its dtype in the graph
        tl.store(h_ptr + (i0 * sh0 + i1 * sh1)[:, None] + c, h, mask=mask)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
    mean = tl.sum(hf, axis=1) / D
    centred = tl.where(mask, hf - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=1) / D + eps)
    n = centred * rstd[:, None]
    if HAS_W:
        n = n * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        n = n + tl.load(b_ptr + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
    m = tl.load(m_ptr + (i0 * sm0 + i1 * sm1)[:, None] + c * sm2, mask=mask, other=0.0).to(tl.float32)
    if PLUS_ONE:
        m += 1.0
    a = tl.load(a_ptr + (i0 * sa0 + i1 * sa1)[:, None] + c * sa2, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i0 * so0 + i1 * so1)[:, None] + c, _rounded(n * m + a, out_ptr, SOFT_OUT), mask=mask)


def is_supported(x: torch.Tensor) -> bool:
    """Whether the kernel takes rows like ``x``: a float tensor of rank 1..3 with a last dim <= MAX_D, on a GPU (or
    any device under the interpreter)."""
    ok = x.dtype in _DTYPES and 1 <= x.dim() <= 3 and 0 < x.shape[-1] <= MAX_D
    return ok and (x.device.type == "cuda" or interpreting())


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 3:
        t = t.unsqueeze(0)
    return t


def _rows(t: torch.Tensor) -> torch.Tensor:
    return _as_3d(t if t.stride(-1) == 1 else t.contiguous())


def layer_norm_modulate_into(y: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                             eps: float, scale: torch.Tensor, shift: torch.Tensor, out: torch.Tensor,
                             residual: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                             h_out: Optional[torch.Tensor] = None, scale_plus_one: bool = False,
                             rows: Optional[int] = None, num_warps: Optional[int] = None) -> torch.Tensor:
    """Write ``LayerNorm(h) * scale + shift`` (``* (1 + scale)`` with ``scale_plus_one``, the sum in fp32) into
    ``out`` (module docstring), h = ``y``, or with ``residual``
    ``residual + gate * y`` (``gate`` optional), written to ``h_out`` too. ``scale`` / ``shift`` / ``gate``
    broadcast to ``y``'s shape. Returns ``out``. ``rows`` / ``num_warps``: the launch (defaults by row width)."""
    name = "layer_norm_modulate"
    tensors = [t for t in (y, out, residual, h_out) if t is not None]
    if not is_supported(y) or any(t.shape != y.shape for t in tensors) or out.stride(-1) != 1 \
            or (residual is not None) != (h_out is not None) or (h_out is not None and h_out.stride(-1) != 1):
        raise ValueError(f"{name}: y must be a float tensor of rank 1..3 with a last dim <= {MAX_D} on a GPU, out "
                         f"(and with a residual, residual and h_out) of its shape with a unit last stride; got y "
                         f"{y.dtype} {tuple(y.shape)} on {y.device}, out {tuple(out.shape)} strides {out.stride()}. "
                         "Use the op's reference off GPU.")
    d = y.shape[-1]
    y3, o3 = _rows(y), _as_3d(out)
    n_rows = y3.shape[0] * y3.shape[1]
    if n_rows == 0:
        return out
    m3, a3 = _as_3d(scale.expand(y.shape)), _as_3d(shift.expand(y.shape))
    r3 = _rows(residual) if residual is not None else y3
    h3 = _as_3d(h_out) if h_out is not None else o3
    g3 = _as_3d(gate.expand(y.shape)) if gate is not None else m3
    block_d = triton.next_power_of_2(d)
    rows = rows or max(ROWS, min(16, 4096 // block_d))
    num_warps = num_warps or WARPS
    _ln_modulate[(triton.cdiv(n_rows, rows),)](
        y3, r3, g3, h3, weight if weight is not None else y3, bias if bias is not None else y3, m3, a3, o3,
        n_rows, y3.shape[1], d, float(eps), *y3.stride()[:2], *r3.stride()[:2], *g3.stride(), *h3.stride()[:2],
        *m3.stride(), *a3.stride(), *o3.stride()[:2],
        RESIDUAL=residual is not None, GATE=gate is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        PLUS_ONE=bool(scale_plus_one),
        BLOCK_R=rows, BLOCK_D=block_d, SOFT_H=interpreting() and h3.dtype == torch.bfloat16,
        SOFT_OUT=interpreting() and out.dtype == torch.bfloat16,
        num_warps=num_warps)
    return out


__all__ = ["layer_norm_modulate_into", "is_supported", "ROWS", "WARPS", "MAX_D"]
