"""Weight-only int4 linear on a few rows of x (FLUX's AdaLN modulation linears: one conditioning row per sample), as
one bandwidth-bound GEMV pass over the packed weight.

:func:`w4a16_rows_linear` is the CUDA implementation of ``dit_passes::w4a16_rows_linear`` (its specification:
``dit_passes.quant.weight_only_forms.w4a16_linear_form(..., rows=True)``, the multiply-and-sum). One program per
``BLOCK_N`` weight rows, looping over K in chunks of ``BB`` packed bytes::

    lo, hi = the chunk's int4 values (even k: the low nibble)            # [BLOCK_N, BB] each, exact in fp32
    w_lo = float(x.dtype(lo * wscale[n, byte // 32]))                    # the weight rounded as the linear rounds it
    acc[m, n, b] += x[m, 2b] * w_lo[n, b] + x[m, 2b + 1] * w_hi[n, b]    # fp32, every row m of x at once
    y[m, n] = x.dtype(sum_b acc[m, n, b] + float(bias[n]))

Two layouts, which the autotuner picks between per shape: flat (above: one program holds every row of x, a chunk
is [BLOCK_N, BB] bytes, the group scale gathered per byte) and grouped (a chunk is [BLOCK_N, GC groups, 32 bytes],
each group's scale loaded once and broadcast over its bytes; one row of x per program on grid axis 1, so a weight
block's second read for a CFG pair comes from L2). ptxas for sm_90 (bench/triton_sm90_resources.py): flat issues one
8-byte weight load and ~10 scalar loads per thread and chunk, grouped one 16-byte weight load and 4.

Why a kernel: Inductor's fusion of that form (``weight_only_form="rows"``) read the 1.6 GB of FLUX's packed
modulation weights at a tenth of an H200's memory bandwidth; the linear form before it wrote a dequantized bf16 copy
for cuBLAS's GEMV, twice the bytes. Here each packed byte is read once and x's few rows stay in cache.

Numerics: the specification's products; the sums in another order (fp32), so the output equals the reference up
to fp32 summation order (then one rounding to x.dtype). Under ``TRITON_INTERPRET=1`` (CPU tests) the bf16
rounding of the weight is ``w4a4_triton._round_to_bf16_rne`` (the interpreter's cast truncates).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .w4a4_autotune import interpreting
from .w4a4_triton import _round_to_bf16_rne

GROUP_BYTES = tl.constexpr(32)  # a group of 64 int4 values: 32 packed bytes share one scale
MAX_ROWS = 4      # rows of x per call (the graph writes the op for at most dispatch.FEW_ROWS rows)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _config(bn: int, warps: int, bb: int = 0, gc: int = 0) -> "triton.Config":
    """Flat (``bb`` bytes a chunk, every row of x in one program) or grouped (``gc`` groups of 32 bytes a chunk, one
    row of x a program) layout."""
    return triton.Config({"BLOCK_N": bn, "BB": bb or 32, "GC": gc or 1, "GROUPED": bool(gc)}, num_warps=warps)


def _configs():
    if interpreting():
        return [_config(8, 4, bb=64)]
    # flat: BLOCK_N x BB packed bytes a stage, the [M_PAD, BLOCK_N, BB] accumulator bounding the registers (M_PAD
    # <= 4: at most 32 fp32 a thread per row of x). grouped: [BLOCK_N, GC, 32], a group's scale loaded once and
    # broadcast over its bytes (flat loads it per byte: ptxas counts ~10 scalar loads per 8 weight bytes); x's rows
    # apart on grid axis 1, a weight block's second read served by L2
    flat = [_config(bn, w, bb=bb) for bn, bb, w in ((4, 256, 4), (8, 128, 4), (8, 256, 8), (16, 128, 8), (4, 512, 8),
                                                       (2, 512, 4))]
    return flat + [_config(bn, w, gc=gc) for bn, gc, w in ((8, 8, 4), (16, 8, 8), (8, 16, 8), (4, 16, 4), (32, 4, 8))]


@triton.autotune(configs=_configs(), key=["N", "KB", "M_PAD"])
@triton.jit
def _w4a16_rows_kernel(x_ptr, qw_ptr, ws_ptr, b_ptr, y_ptr, M, N, s_xm, s_qn, s_wsn, s_ym,
                       KB: tl.constexpr, M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFT_BF16: tl.constexpr,
                       BLOCK_N: tl.constexpr, BB: tl.constexpr, GC: tl.constexpr, GROUPED: tl.constexpr):
    if GROUPED:
        _grouped_row(x_ptr, qw_ptr, ws_ptr, b_ptr, y_ptr, N, s_xm, s_qn, s_wsn, s_ym, KB, HAS_BIAS, SOFT_BF16, BLOCK_N,
                     GC)
    else:
        _flat_rows(x_ptr, qw_ptr, ws_ptr, b_ptr, y_ptr, M, N, s_xm, s_qn, s_wsn, s_ym, KB, M_PAD, HAS_BIAS, SOFT_BF16,
                   BLOCK_N, BB)


@triton.jit
def _weights(packed, ws, x_ptr, SOFT_BF16: tl.constexpr):
    # a chunk's two nibble planes (even k: the low nibble) times their group scales, rounded to x.dtype as the linear
    # form rounds its dequantized weight (the interpreter's cast truncates: round to nearest even by hand)
    w_lo = (((packed & 15) ^ 8) - 8).to(tl.float32) * ws
    w_hi = (((packed >> 4) ^ 8) - 8).to(tl.float32) * ws
    if SOFT_BF16:
        w_lo, w_hi = _round_to_bf16_rne(w_lo), _round_to_bf16_rne(w_hi)
    else:
        w_lo = w_lo.to(x_ptr.dtype.element_ty).to(tl.float32)
        w_hi = w_hi.to(x_ptr.dtype.element_ty).to(tl.float32)
    return w_lo, w_hi


@triton.jit
def _grouped_row(x_ptr, qw_ptr, ws_ptr, b_ptr, y_ptr, N, s_xm, s_qn, s_wsn, s_ym, KB: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK_N: tl.constexpr, GC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    rows = tl.where(n_mask, rows, 0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, GC)
    offs_j = tl.arange(0, GROUP_BYTES)
    G: tl.constexpr = KB // GROUP_BYTES
    acc = tl.zeros([BLOCK_N, GC, GROUP_BYTES], dtype=tl.float32)
    for i in range(0, tl.cdiv(G, GC)):
        g = i * GC + offs_g
        g_mask = g < G
        byte = g[:, None] * GROUP_BYTES + offs_j[None, :]                                   # [GC, 32]
        packed = tl.load(qw_ptr + rows[:, None, None] * s_qn + byte[None, :, :], mask=g_mask[None, :, None],
                         other=0).to(tl.int32)
        ws = tl.load(ws_ptr + rows[:, None] * s_wsn + g[None, :], mask=g_mask[None, :], other=0.0).to(tl.float32)
        w_lo, w_hi = _weights(packed, ws[:, :, None], x_ptr, SOFT_BF16)
        x_even = tl.load(x_ptr + m * s_xm + 2 * byte, mask=g_mask[:, None], other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + m * s_xm + 2 * byte + 1, mask=g_mask[:, None], other=0.0).to(tl.float32)
        acc += x_even[None, :, :] * w_lo + x_odd[None, :, :] * w_hi
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * s_ym + rows, out.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _flat_rows(x_ptr, qw_ptr, ws_ptr, b_ptr, y_ptr, M, N, s_xm, s_qn, s_wsn, s_ym, KB: tl.constexpr,
               M_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
               BB: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    rows = tl.where(n_mask, rows, 0).to(tl.int64)  # rows past N read row 0, store nothing
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < M
    offs_b = tl.arange(0, BB)
    # the products summed elementwise per byte lane, reduced across lanes once after the loop: a reduction per chunk
    # (cross-thread shuffles every BB bytes) kept a first version at a fifth of an H100's memory bandwidth
    acc = tl.zeros([M_PAD, BLOCK_N, BB], dtype=tl.float32)
    for i in range(0, tl.cdiv(KB, BB)):  # KB (K / 2) is a compile-time constant: the interpreter's loops need one
        byte = i * BB + offs_b
        b_mask = byte < KB
        packed = tl.load(qw_ptr + rows[:, None] * s_qn + byte[None, :], mask=b_mask[None, :], other=0).to(tl.int32)
        ws = tl.load(ws_ptr + rows[:, None] * s_wsn + (byte // GROUP_BYTES)[None, :], mask=b_mask[None, :],
                     other=0.0).to(tl.float32)
        w_lo, w_hi = _weights(packed, ws, x_ptr, SOFT_BF16)
        xm = m_mask[:, None] & b_mask[None, :]
        x_even = tl.load(x_ptr + offs_m[:, None] * s_xm + 2 * byte[None, :], mask=xm, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + offs_m[:, None] * s_xm + 2 * byte[None, :] + 1, mask=xm, other=0.0).to(tl.float32)
        acc += x_even[:, None, :] * w_lo[None, :, :] + x_odd[:, None, :] * w_hi[None, :, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * s_ym + rows[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def is_supported(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: a 2-D float x of at most MAX_ROWS rows and packed uint8 weights on a
    CUDA GPU, or any device under the interpreter."""
    ok = x.dim() == 2 and x.dtype in _DTYPES and 0 < x.shape[0] <= MAX_ROWS and qweight.dtype == torch.uint8
    return ok and (interpreting() or (x.is_cuda and qweight.is_cuda))


def w4a16_rows_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, config: Optional[dict] = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; fp32 / bf16 / fp16), qweight uint8 [N, K/2], wscale [N, K/64], bias [N] or None ->
    y [M, N] in x.dtype (module docstring); ``config``: ``_config``'s arguments, to run one layout without the
    autotuner (tests)."""
    name = "w4a16_rows_linear"
    if not is_supported(x, qweight):
        raise ValueError(f"{name}: needs a 2-D float x of 1..{MAX_ROWS} rows and uint8 qweight on CUDA (or "
                         f"TRITON_INTERPRET=1), got x {x.dtype} {tuple(x.shape)} on {x.device}, qweight "
                         f"{qweight.dtype}; use the op's reference (weight_only_forms.w4a16_linear_form(rows=True))")
    m, k = x.shape
    n = qweight.shape[0]
    if tuple(qweight.shape) != (n, k // 2) or k % 64 or tuple(wscale.shape) != (n, k // 64):
        raise ValueError(f"{name}: qweight must be [N, {k // 2}] and wscale [N, {k // 64}] for K = {k} (a multiple "
                         f"of 64), got {tuple(qweight.shape)} and {tuple(wscale.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    qw = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    ws = wscale if wscale.stride(-1) == 1 else wscale.contiguous()
    b = bias if bias is not None else y  # unread without a bias

    def grid(meta):
        return triton.cdiv(n, meta["BLOCK_N"]), m if meta["GROUPED"] else 1

    args = (x, qw, ws, b, y, m, n, x.stride(0), qw.stride(0), ws.stride(0), y.stride(0))
    meta = dict(KB=k // 2, M_PAD=triton.next_power_of_2(m), HAS_BIAS=bias is not None,
                SOFT_BF16=interpreting() and x.dtype == torch.bfloat16)
    if config is None:
        _w4a16_rows_kernel[grid](*args, **meta)
    else:
        c = _config(**config)
        _w4a16_rows_kernel.fn[grid(c.kwargs)](*args, **meta, **c.kwargs, num_warps=c.num_warps)
    return y
