"""The lrcat design's A operand in two kernels: smoothing, per-token e4m3 quantization and the low-rank down
projection of an activation: the low-rank down projection fused with the activation quantization.

:func:`lrcat_quantize_rows` is the CUDA implementation of ``dit_passes::lrcat_quantize_rows`` (its specification:
``dit_passes.quant.graph_forms.lrcat_activation``)::

    statistics, one program per BLOCK_M tokens and KS columns (a K split s), per BK chunk:
        xs = float(x) * smooth_inv
        amax[s] = max(amax[s], max|xs|)                      # per token
        h[s] += x.dtype(xs) @ lora_down.T                    # [BLOCK_M, R] on tensor cores, fp32 accumulation
    quantization, one program per BLOCK_M tokens and BK columns (+ one for the branch):
        sx = div_rn(max_s amax[s], 448) (a zero scale becomes 1);  inv = div_rn(1, sx)
        a[:, chunk] = e4m3(clamp(xs * inv, -448, 448))      # x read again
        branch program: hs = clamp(div_rn(sum_s h[s], sx * c), -448, 448)
                        a[:, K:] = [e4m3(hs) | 0]   (split: [hi | lo | hi | 0], hi = e4m3(hs), lo = e4m3(hs - hi))

Why a kernel: written as ATen ops (``act_quant="graph"``) the same work is Inductor's reduction and
pointwise kernels over the smoothed activation, a bf16 copy of it for cuBLAS's [M, K] x [K, R] mm, the branch's
scaling and an e4m3 concatenation: four to five passes over [M, K] where these are two reads and a write. Why two
kernels over a grid of K splits: the first design, one program per 16 tokens doing both passes, gave FLUX's 4608
tokens 288 programs, too few loads in flight (about a fifth of the H100's memory bandwidth).

:func:`lrcat_quantize_smoothed` (``dit_passes::lrcat_quantize_smoothed``, ``lrcat_act="auto"|mm``;
specification ``graph_forms.lrcat_smoothed_activation``) takes the smoothed activation xd = x.dtype(x * smooth_inv),
which Inductor writes in its producer, and h = xd @ lora_down.T from a GEMM (cuBLAS), and makes the same operand in
one program per token (the row in registers, as ``fp8_rowquant_triton``'s one-pass kernel): sx and qx from xd's
values, then the branch columns from h. x is read once by cuBLAS's skinny GEMM and once here, no partial sums: the
default A operand, faster in the H100 step than the two kernels (``bench/results/quant_step_lrcat_act_h100.json``).
Bytes equal to its specification.

Numerics: qx and sx are the graph form's bytes (the same fp32 operations in the same order; a max is exact in any
order). h is accumulated in fp32 and not rounded to x.dtype before the scaling (the graph form rounds it: the op's
reference does as the kernel does), so the branch's columns equal the reference's up to the summation order of h
(one split: the chunks in order, as the reference under the interpreter): an e4m3 rounding may differ by one step
where hs lies within fp32 noise of a tie. Under ``TRITON_INTERPRET=1`` (CPU tests) the e4m3 rounding is
``w4a8_triton._soft_e4m3`` with the sign of a flushed zero kept (``fp8_rowquant_triton._to_e4m3``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .fp8_rowquant_triton import SINGLE_MAX, _row_e4m3, _to_e4m3, num_warps_for
from .fp8_rowquant_triton import is_supported as rows_supported
from .w4a4_autotune import interpreting
from .w4a4_triton import _round_to_bf16_rne
from .w4a8_triton import E4M3_MAX, _soft_e4m3

BLOCK_K = 256   # the statistics kernel's largest K chunk (a multiple of 16: tl.dot's K); K splits are multiples
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def k_split(k: int, rank_pad: int) -> int:
    """Columns of x per statistics program (a multiple of BLOCK_K): 512 up to K = 4096, else 1024 (at BLOCK_M 16 FLUX's
    4608 tokens x K = 3072 give 288 x 6 programs), doubled while the partial sums, S x rank_pad fp32 a token, would
    exceed a quarter of the token's bf16 row (the fused linears' rank 96 / 128 at K = 3072: 3 splits, not 6)."""
    ks = 512 if k <= 4096 else 1024
    while ks < k and -(-k // ks) * rank_pad * 8 > k:
        ks *= 2
    return ks


def _stats_configs():
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BK": BLOCK_K}, num_warps=4)]
    # BLOCK_M: every program re-reads its split's lora_down rows from L2 (M / BLOCK_M times per call: at the fused
    # linears' rank 96 / 128 and BLOCK_M 16, eight times x's own bytes); BK: the [BLOCK_M, BK] x and [BK, R] lora_down
    # chunks of a pipeline stage. ptxas for sm_90 on the CPU (bench/triton_sm90_resources.py): a config at R_PAD 128
    # with the widest chunks takes 255 registers a thread and 149 KB of shared memory (one 4-warp program an SM);
    # BK 32 / 64 at 8 warps: 48-128 registers, 8-66 KB. The first config: the one measured on the GPU.
    return [triton.Config({"BLOCK_M": bm, "BK": bk}, num_warps=w, num_stages=st)
            for bm, bk, w, st in ((16, 256, 4, 3), (32, 32, 8, 3), (32, 64, 8, 3), (64, 32, 8, 3), (64, 64, 8, 3),
                                  (128, 32, 8, 2))]


def _quant_configs():
    if interpreting():
        return [triton.Config({"BLOCK_M": 4, "BK": 128}, num_warps=4)]
    return [triton.Config({"BLOCK_M": bm, "BK": bk}, num_warps=w)
            for bm, bk, w in ((8, 512, 4), (4, 1024, 4), (16, 512, 8), (32, 256, 8))]


@triton.autotune(configs=_stats_configs(), key=["M_BUCKET", "K", "R_PAD"])
@triton.jit
def _lrcat_stats_kernel(x_ptr, si_ptr, ld_ptr, amax_ptr, h_ptr, M, K, R, M_BUCKET, s_xm, s_ldr,
                        KS: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr, DOT_F32: tl.constexpr,
                        BF16: tl.constexpr, SOFT: tl.constexpr, BLOCK_M: tl.constexpr):
    # grid (token blocks, K splits): partial amax [S, M] and h [S, M, R_PAD] of KS columns each
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)  # rows past M read row 0, store nothing
    split = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    # |xs| maxed elementwise over the chunks, reduced across the columns once after the loop (no cross-thread
    # reduction per chunk); a max is exact in any order
    amax = tl.zeros([BLOCK_M, BK], dtype=tl.float32)
    h = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    TRIP: tl.constexpr = KS // BK  # a compile-time trip count (the interpreter cannot loop to a runtime bound)
    for i in range(0, TRIP):
        cols = split * KS + i * BK + offs_k
        k_mask = cols < K
        xs = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        xs = xs * tl.load(si_ptr + cols, mask=k_mask, other=0.0)[None, :]
        amax = tl.maximum(amax, tl.abs(xs))
        ld_t = tl.load(ld_ptr + offs_r[None, :] * s_ldr + cols[:, None], mask=k_mask[:, None] & r_mask[None, :],
                       other=0.0)                                          # lora_down.T chunk [BK, R_PAD]
        ld_t = ld_t.to(x_ptr.dtype.element_ty)
        if SOFT and BF16:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest even by hand
            xd = _round_to_bf16_rne(xs)
        else:
            xd = xs.to(x_ptr.dtype.element_ty)                           # the branch reads x.dtype(xs)
        if DOT_F32:  # exact products of x.dtype values in fp32 (fp32 x; the interpreter's 16-bit dot is wrong)
            h = tl.dot(xd.to(tl.float32), ld_t.to(tl.float32), h, input_precision="ieee")
        else:
            h = tl.dot(xd, ld_t, h)
    tl.store(amax_ptr + split * M + rows, tl.max(amax, axis=1), mask=m_mask)
    tl.store(h_ptr + (split * M + rows)[:, None] * R_PAD + offs_r[None, :], h, mask=m_mask[:, None])


@triton.autotune(configs=_quant_configs(), key=["M_BUCKET", "K", "S", "SPLIT", "COLS"])
@triton.jit
def _lrcat_quant_kernel(x_ptr, si_ptr, amax_ptr, h_ptr, c_ptr, a_ptr, sx_ptr, M, K, R, M_BUCKET, s_xm, s_am,
                        S: tl.constexpr, RH: tl.constexpr, R_PAD: tl.constexpr, SPLIT: tl.constexpr,
                        COLS: tl.constexpr, SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr):
    # grid (token blocks, K chunks + 1): the x chunks in e4m3, the last program of a row block the branch and sx
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(0, S):  # max is exact in any order: sx is the one-pass kernel's
        amax = tl.maximum(amax, tl.load(amax_ptr + s * M + rows))
    sx = tl.math.div_rn(amax, E4M3_MAX)
    sx = tl.where(sx == 0.0, 1.0, sx)
    pid_k = tl.program_id(1)
    if pid_k < tl.cdiv(K, BK):
        cols = pid_k * BK + tl.arange(0, BK)
        k_mask = cols < K
        inv = tl.math.div_rn(1.0, sx)
        xs = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        xs = xs * tl.load(si_ptr + cols, mask=k_mask, other=0.0)[None, :]
        y = tl.minimum(tl.maximum(xs * inv[:, None], -E4M3_MAX), E4M3_MAX)
        tl.store(a_ptr + rows[:, None] * s_am + cols[None, :], _to_e4m3(y, SOFT),
                 mask=m_mask[:, None] & k_mask[None, :])
    else:
        tl.store(sx_ptr + rows, sx, mask=m_mask)
        offs_r = tl.arange(0, R_PAD)
        h = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
        for s in range(0, S):  # the splits' partial sums in split order (one split: the one-pass kernel's h)
            h += tl.load(h_ptr + (s * M + rows)[:, None] * RH + offs_r[None, :], mask=(offs_r < RH)[None, :],
                         other=0.0)
        _store_branch(a_ptr + rows[:, None] * s_am + (K + offs_r)[None, :], h, sx, c_ptr, offs_r, m_mask[:, None], R,
                      SPLIT, COLS, SOFT)


@triton.jit
def _store_branch(dst, h, sx, c_ptr, offs_r, row_ok, R, SPLIT: tl.constexpr, COLS: tl.constexpr, SOFT: tl.constexpr,
                  PLANES: tl.constexpr = 0):
    # the branch columns of a block of rows from h [ROWS, R_PAD] (fp32, 0 past R) and sx [ROWS]:
    # hs = clamp(h / (sx * c)); [e4m3(hs)] or, split, [hi | lo | hi], zeros up to COLS; PLANES (the LUT GEMM's
    # operand, w4_lut.lut_smoothed_activation): [hi | e4m3(hi / 16) | lo] (PLANES 3) or [hi | e4m3(hi / 16)] (2),
    # zeros up to COLS
    r_mask = offs_r < R
    c = tl.load(c_ptr + offs_r, mask=r_mask, other=1.0)
    hs = tl.math.div_rn(h, sx[:, None] * c[None, :])
    hs = tl.minimum(tl.maximum(hs, -E4M3_MAX), E4M3_MAX)
    hi = _to_e4m3(hs, SOFT)
    if PLANES:  # hi / 16 from hi's value in fp32 (_soft_e4m3: no fp8 round trip in registers, see below); exact
        hi_f = _soft_e4m3(hs)
        tl.store(dst, hi, mask=row_ok & r_mask[None, :])
        hi16 = _to_e4m3(hi_f * 0.0625, SOFT)
        if PLANES == 3:  # the last plane also writes the zero columns up to COLS (h is 0 past R)
            tl.store(dst + R, hi16, mask=row_ok & r_mask[None, :])
            tl.store(dst + 2 * R, _to_e4m3(hs - hi_f, SOFT), mask=row_ok & (offs_r < COLS - 2 * R)[None, :])
        else:
            tl.store(dst + R, hi16, mask=row_ok & (offs_r < COLS - R)[None, :])
    elif SPLIT:  # [hi | lo | hi], the last part also writing the zero columns up to COLS
        lo = _to_e4m3(hs - _soft_e4m3(hs), SOFT)  # hi's value without an fp8 round trip in registers (sm_90:
        # Triton 3.6 mis-lowered hi.to(float32) of the dot's layout: hi + lo off by hundreds in the GPU test)
        tl.store(dst, hi, mask=row_ok & r_mask[None, :])
        tl.store(dst + R, lo, mask=row_ok & r_mask[None, :])
        tl.store(dst + 2 * R, hi, mask=row_ok & (offs_r < COLS - 2 * R)[None, :])
    else:
        tl.store(dst, hi, mask=row_ok & (offs_r < COLS)[None, :])


@triton.jit
def _lrcat_rows_kernel(x_ptr, h_ptr, c_ptr, a_ptr, sx_ptr, K, R, s_xm, s_hm, s_am, BLOCK: tl.constexpr,
                       R_PAD: tl.constexpr, SPLIT: tl.constexpr, COLS: tl.constexpr, SOFT: tl.constexpr,
                       PLANES: tl.constexpr):
    # one program per token, its row held in registers (K <= SINGLE_MAX): the smoothed activation's e4m3 and scale,
    # then the branch columns from its down projection h (computed before, by a GEMM)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    xf = tl.load(x_ptr + row * s_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q, sx = _row_e4m3(xf, SOFT)                                           # fp8_rowquant_triton's one-pass row
    tl.store(a_ptr + row * s_am + cols, q, mask=mask)
    tl.store(sx_ptr + row, sx)
    offs_r = tl.arange(0, R_PAD)
    h = tl.load(h_ptr + row * s_hm + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)[None, :]   # [1, R_PAD]
    _store_branch(a_ptr + row * s_am + (K + offs_r)[None, :], h, tl.zeros([1], dtype=tl.float32) + sx, c_ptr,
                  offs_r, tl.full([1, 1], 1, tl.int1), R, SPLIT, COLS, SOFT, PLANES)


def is_supported(x: torch.Tensor, lora_down: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: a float 2-D x (and lora_down) on an sm_89+ GPU (the e4m3 cast), or any
    device under the interpreter: the row quantization kernel's conditions."""
    return lora_down.dim() == 2 and lora_down.is_floating_point() and rows_supported(x)


def smoothed_supported(xd: torch.Tensor) -> bool:
    """Whether :func:`lrcat_quantize_smoothed` takes xd: the row kernel's conditions and at most SINGLE_MAX columns
    (one token's row in registers)."""
    return rows_supported(xd) and 0 < xd.shape[1] <= SINGLE_MAX  # rows_supported: a 2-D float xd


def _outputs(name: str, x: torch.Tensor, r: int, split: bool, reference: str, planes: int = 0):
    """The ops' outputs, the A operand e4m3 [M, K + cols] and sx fp32 [M, 1], with cols (``graph_forms.lrcat_cols``;
    planes: ``w4_lut.branch_cols``) and the branch programs' width (split, planes: the widest of the three parts);
    x must be on CUDA (or interpreted)."""
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: the Triton kernel needs CUDA tensors (got {x.device}); on CPU use the op's "
                         f"reference (dit_passes.quant.{reference}) or set TRITON_INTERPRET=1 (tests)")
    m, k = x.shape
    cols = -(-planes * r // 64) * 64 if planes else -(-r * (3 if split else 1) // 16) * 16
    a = torch.empty((m, k + cols), dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    # the widest stored part: split / 3 planes the last (R up to the zeros' end), 2 planes the second
    width = max(r, cols - 2 * r) if split or planes == 3 else (max(r, cols - r) if planes else cols)
    return a, sx, cols, max(16, triton.next_power_of_2(width))


def lrcat_quantize_rows(x: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor,
                        split: bool = False, block_k_split: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32 / bf16 / fp16), smooth_inv fp32 [K], lora_down [R, K], c fp32 [R] -> ``(a float8_e4m3fn
    [M, K + cols], sx fp32 [M, 1])`` (module docstring; cols: ``graph_forms.lrcat_cols(R, split)``);
    ``block_k_split``: x's columns per statistics program (default :func:`k_split`; tests force several splits)."""
    name = "lrcat_quantize_rows"
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{name}: x must be a 2-D tensor of {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    r = lora_down.shape[0] if lora_down.dim() == 2 else -1
    if lora_down.dim() != 2 or lora_down.shape[1] != k or r < 1 or tuple(c.shape) != (r,) or c.dtype != torch.float32:
        raise ValueError(f"{name}: lora_down must be [R, {k}] (R >= 1) and c fp32 [R], got {tuple(lora_down.shape)} "
                         f"and {c.dtype} {tuple(c.shape)}")
    if tuple(smooth_inv.shape) != (k,):
        raise ValueError(f"{name}: smooth_inv must be [{k}], got {tuple(smooth_inv.shape)}")
    a, sx, cols, r_pad = _outputs(name, x, r, split, "graph_forms.lrcat_activation")
    if m == 0:
        return a, sx
    x = x if x.stride(-1) == 1 else x.contiguous()
    ld = lora_down if lora_down.stride(-1) == 1 else lora_down.contiguous()
    si = smooth_inv.to(torch.float32).contiguous()
    rh = max(16, triton.next_power_of_2(r))
    ks = k_split(k, rh) if block_k_split is None else block_k_split
    if ks % BLOCK_K:
        raise ValueError(f"{name}: the K split must be a multiple of {BLOCK_K}, got {ks}")
    s = triton.cdiv(k, ks)
    amax = torch.empty((s, m), dtype=torch.float32, device=x.device)
    h = torch.empty((s, m, rh), dtype=torch.float32, device=x.device)
    bucket = triton.next_power_of_2(m)
    _lrcat_stats_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), s)](
        x, si, ld, amax, h, m, k, r, bucket, x.stride(0), ld.stride(0), KS=ks, R_PAD=rh,
        DOT_F32=interpreting() or x.dtype == torch.float32, BF16=x.dtype == torch.bfloat16, SOFT=interpreting())
    _lrcat_quant_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(k, meta["BK"]) + 1)](
        x, si, amax, h, c.contiguous(), a, sx, m, k, r, bucket, x.stride(0), a.stride(0), S=s, RH=rh, R_PAD=r_pad,
        SPLIT=split, COLS=cols, SOFT=interpreting())
    return a, sx


def lrcat_quantize_smoothed(xd: torch.Tensor, h: torch.Tensor, c: torch.Tensor, split: bool = False,
                            planes: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The A operand from the smoothed activation xd [M, K] (fp32 / bf16 / fp16, K <= SINGLE_MAX) and its down
    projection h [M, R] (any float dtype; a GEMM made it), c fp32 [R] -> ``(a float8_e4m3fn [M, K + cols], sx fp32
    [M, 1])``: one program per token, xd read once (``dit_passes::lrcat_quantize_smoothed``, its reference
    ``graph_forms.lrcat_smoothed_activation``; ``planes`` 2 / 3: the LUT GEMM's branch columns,
    ``dit_passes::lut_quantize_smoothed``, reference ``w4_lut.lut_smoothed_activation``)."""
    name = "lut_quantize_smoothed" if planes else "lrcat_quantize_smoothed"
    if xd.dim() != 2 or xd.dtype not in _DTYPES or not 0 < xd.shape[1] <= SINGLE_MAX:
        raise ValueError(f"{name}: xd must be a 2-D tensor of {_DTYPES} with 1..{SINGLE_MAX} columns, got {xd.dtype} "
                         f"{tuple(xd.shape)}; use the op's reference (graph_forms.lrcat_smoothed_activation)")
    m, k = xd.shape
    r = h.shape[1] if h.dim() == 2 else -1
    if h.dim() != 2 or h.shape[0] != m or r < 1 or tuple(c.shape) != (r,) or c.dtype != torch.float32:
        raise ValueError(f"{name}: h must be [{m}, R] (R >= 1) and c fp32 [R], got {tuple(h.shape)} and {c.dtype} "
                         f"{tuple(c.shape)}")
    a, sx, cols, r_pad = _outputs(name, xd, r, split, "graph_forms.lrcat_smoothed_activation", planes)
    if m == 0:
        return a, sx
    xd = xd if xd.stride(-1) == 1 else xd.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    block = triton.next_power_of_2(k)
    _lrcat_rows_kernel[(m,)](xd, h, c.contiguous(), a, sx, k, r, xd.stride(0), h.stride(0), a.stride(0),
                             BLOCK=block, R_PAD=r_pad, SPLIT=split, COLS=cols, SOFT=interpreting(), PLANES=planes,
                             num_warps=num_warps_for(block))
    return a, sx
