"""The LUT GEMM's A operand with the low-rank down projection inside: ``dit_passes::lut_quantize_lowrank`` on CUDA
(its specification: ``dit_passes.quant.w4_lut.lut_lowrank_activation``)::

    quantization, one program per BLOCK_M tokens and KS columns (a K split s), per BK chunk of xd:
        sx = div_rn(amax, 448) (a zero scale becomes 1);  inv = div_rn(1, sx)      # amax: the graph's, per token
        a[:, chunk] = e4m3(clamp(xd * inv, -448, 448))
        h[s] += xd @ lora_down.T                                  # [BLOCK_M, R] on tensor cores, fp32 accumulation
    branch, one program per BLOCK_M tokens:
        sx[m] = sx;  a[:, K:] = planes of sum_s h[s] (lrcat_act_triton._store_branch: [hi | hi / 16 (| lo) | 0])

Why: the default form (``lut_act="rows"``) reads the smoothed activation xd twice, once by cuBLAS's skinny
[M, K] x [K, R] GEMM for h (split-K) and once by the row kernel.
Here xd is read once. What made that impossible before is the per-token scale, known only after a whole row is read:
the graph computes amax beside xd (``w4_lut.token_amax``), which Inductor folds into the kernel that writes xd (a
row reduction in the producer's pass), so the quantization needs no row in registers and the grid is tokens x K
splits (enough programs to keep loads in flight; ``lrcat_act_triton.k_split``), h partial sums per split.
Measured (H200, ``bench/results/quant_step_h200.md``): a tie, not the default. The down projection's GEMM goes
away, but this kernel reaches about half the memory bandwidth, and the producers' reductions cost more than their
pointwise form.

Numerics: qx and sx are the specification's bytes (the same fp32 operations; a max is exact in any order). h is the
fp32 sum of exact products of xd's and lora_down's values (in xd's dtype) in chunk, then split order: the branch's
columns equal the specification's up to that summation order (an e4m3 rounding may differ by a step where hs lies
within fp32 noise of a tie). Under ``TRITON_INTERPRET=1`` (CPU tests) the e4m3 rounding is ``_to_e4m3``'s soft one.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .fp8_rowquant_triton import _to_e4m3
from .fp8_rowquant_triton import is_supported as rows_supported
from .lrcat_act_triton import _DTYPES, _outputs, _store_branch, k_split
from .w4a4_autotune import interpreting
from .w4a8_triton import E4M3_MAX

BRANCH_BLOCK_M = 16


def _configs():
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BK": 128}, num_warps=4)]
    # BLOCK_M: lora_down's split is re-read from L2 by every program (M / BLOCK_M times a call); BK: a stage's
    # [BLOCK_M, BK] xd and [BK, R_PAD] lora_down chunks (at R_PAD 128 and BK 256, 64 KB of lora_down a stage)
    return [triton.Config({"BLOCK_M": bm, "BK": bk}, num_warps=w, num_stages=st)
            for bm, bk, w, st in ((16, 128, 4, 3), (32, 64, 4, 4), (32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 8, 2),
                                  (16, 256, 4, 2))]


@triton.autotune(configs=_configs(), key=["M_BUCKET", "K", "R_PAD"])
@triton.jit
def _lowrank_quant_kernel(x_ptr, amax_ptr, ld_ptr, a_ptr, h_ptr, M, K, R, M_BUCKET, s_xm, s_ldr, s_am,
                          KS: tl.constexpr, R_PAD: tl.constexpr, DOT_F32: tl.constexpr, SOFT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BK: tl.constexpr):
    # grid (token blocks, K splits): a's KS columns of BLOCK_M tokens in e4m3 and their h partial sums [BLOCK_M, R_PAD]
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)  # rows past M read row 0, store nothing
    split = tl.program_id(1)
    sx = tl.math.div_rn(tl.load(amax_ptr + rows), E4M3_MAX)
    sx = tl.where(sx == 0.0, 1.0, sx)
    inv = tl.math.div_rn(1.0, sx)
    offs_k = tl.arange(0, BK)
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    h = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    TRIP: tl.constexpr = KS // BK  # a compile-time trip count (the interpreter cannot loop to a runtime bound)
    for i in range(0, TRIP):
        cols = split * KS + i * BK + offs_k
        k_mask = cols < K
        xd = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=k_mask[None, :], other=0.0)
        y = tl.minimum(tl.maximum(xd.to(tl.float32) * inv[:, None], -E4M3_MAX), E4M3_MAX)
        tl.store(a_ptr + rows[:, None] * s_am + cols[None, :], _to_e4m3(y, SOFT),
                 mask=m_mask[:, None] & k_mask[None, :])
        ld_t = tl.load(ld_ptr + offs_r[None, :] * s_ldr + cols[:, None], mask=k_mask[:, None] & r_mask[None, :],
                       other=0.0).to(x_ptr.dtype.element_ty)           # lora_down.T chunk [BK, R_PAD], xd's dtype
        if DOT_F32:  # exact products in fp32 (fp32 xd; the interpreter's 16-bit dot is wrong)
            h = tl.dot(xd.to(tl.float32), ld_t.to(tl.float32), h, input_precision="ieee")
        else:
            h = tl.dot(xd, ld_t, h)
    tl.store(h_ptr + (split * M + rows)[:, None] * R_PAD + offs_r[None, :], h, mask=m_mask[:, None])


@triton.jit
def _lowrank_branch_kernel(h_ptr, amax_ptr, c_ptr, a_ptr, sx_ptr, M, K, R, s_am, S: tl.constexpr,
                           RH: tl.constexpr, W_PAD: tl.constexpr, COLS: tl.constexpr, PLANES: tl.constexpr,
                           SOFT: tl.constexpr, BLOCK_M: tl.constexpr):
    # one program per BLOCK_M tokens: sx, and the branch's columns from the splits' h summed in split order
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    sx = tl.math.div_rn(tl.load(amax_ptr + rows), E4M3_MAX)
    sx = tl.where(sx == 0.0, 1.0, sx)
    tl.store(sx_ptr + rows, sx, mask=m_mask)
    offs_r = tl.arange(0, W_PAD)
    h = tl.zeros([BLOCK_M, W_PAD], dtype=tl.float32)
    for s in range(0, S):
        h += tl.load(h_ptr + (s * M + rows)[:, None] * RH + offs_r[None, :], mask=(offs_r < RH)[None, :], other=0.0)
    _store_branch(a_ptr + rows[:, None] * s_am + (K + offs_r)[None, :], h, sx, c_ptr, offs_r, m_mask[:, None], R,
                  False, COLS, SOFT, PLANES)


def is_supported(xd: torch.Tensor) -> bool:
    """Whether the kernel takes xd: a 2-D float tensor on an sm_89+ GPU (the e4m3 cast), or any device under the
    interpreter (the row quantization kernel's conditions)."""
    return rows_supported(xd)


def lut_quantize_lowrank(xd: torch.Tensor, amax: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor, planes: int,
                         block_k_split: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """xd [M, K] (fp32 / bf16 / fp16), amax fp32 [M] (max |xd| per token), lora_down [R, K], c fp32 [R], planes 2 / 3
    -> ``(a float8_e4m3fn [M, K + w4_lut.branch_cols(R, planes)], sx fp32 [M])`` (module docstring);
    ``block_k_split``: xd's columns per program (a multiple of 256; default ``k_split``; tests force several)."""
    name = "lut_quantize_lowrank"
    if xd.dim() != 2 or xd.dtype not in _DTYPES:
        raise ValueError(f"{name}: xd must be a 2-D tensor of {_DTYPES}, got {xd.dtype} {tuple(xd.shape)}")
    m, k = xd.shape
    r = lora_down.shape[0] if lora_down.dim() == 2 else -1
    if r < 1 or lora_down.shape[1] != k or tuple(c.shape) != (r,) or c.dtype != torch.float32:
        raise ValueError(f"{name}: lora_down must be [R, {k}] (R >= 1) and c fp32 [R], got {tuple(lora_down.shape)} "
                         f"and {c.dtype} {tuple(c.shape)}")
    if tuple(amax.shape) != (m,) or amax.dtype != torch.float32:
        raise ValueError(f"{name}: amax must be fp32 [{m}], got {amax.dtype} {tuple(amax.shape)}")
    a, sx, cols, w_pad = _outputs(name, xd, r, False, "w4_lut.lut_lowrank_activation", planes)
    sx = sx.view(-1)
    if m == 0:
        return a, sx
    xd = xd if xd.stride(-1) == 1 else xd.contiguous()
    ld = lora_down if lora_down.stride(-1) == 1 else lora_down.contiguous()
    rh = max(16, triton.next_power_of_2(r))
    ks = block_k_split or k_split(k, rh)
    if ks % 256:
        raise ValueError(f"{name}: the K split must be a multiple of 256, got {ks}")
    s = triton.cdiv(k, ks)
    h = torch.empty((s, m, rh), dtype=torch.float32, device=xd.device)
    amax = amax.contiguous()
    _lowrank_quant_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), s)](
        xd, amax, ld, a, h, m, k, r, triton.next_power_of_2(m), xd.stride(0), ld.stride(0), a.stride(0), KS=ks,
        R_PAD=rh, DOT_F32=interpreting() or xd.dtype == torch.float32, SOFT=interpreting())
    _lowrank_branch_kernel[(triton.cdiv(m, BRANCH_BLOCK_M),)](
        h, amax, c.contiguous(), a, sx, m, k, r, a.stride(0), S=s, RH=rh, W_PAD=max(w_pad, rh), COLS=cols,
        PLANES=planes, SOFT=interpreting(), BLOCK_M=BRANCH_BLOCK_M, num_warps=4)
    return a, sx
