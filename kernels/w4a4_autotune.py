"""Tile configurations for the W4A4 Triton kernels (kernels/w4a4_triton.py).

Why these tiles (Hopper, int8 ``tl.dot`` -> wgmma, fp32 accumulator + one int32 group accumulator):

* every K-group of 64 ends in a CUDA-core epilogue over the whole [BLOCK_M, BLOCK_N] tile (int32 -> fp32,
  scale product, fma). A thread therefore holds two full accumulators (fp32 ``acc`` and int32 ``d``).
  sm_90 builds compiled ahead of time on a CPU machine (ptxas -v) gave: 64x128/4 warps, 128x64/4,
  64x256/8 and 64x64/4 without spills (158-254 registers), 128x128/8 warps 20 bytes of spill (kept: the
  autotuner decides), 128x256/8 warps 436 bytes of spill (not offered);
* the packed tiles are small (BLOCK_M x 32 bytes per group), so deep software pipelining (4-6 stages)
  costs little shared memory and hides the load latency of the short per-group iterations;
* several CTAs per multiprocessor (the 64-row tiles) let one CTA's epilogue overlap another's wgmma.

The interpreter (``TRITON_INTERPRET=1``, CPU tests) gets one small configuration: autotuning there would
only run the slow interpreter many times.
"""
from __future__ import annotations

from typing import List

import triton

from dit_passes.infra import env


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return env.triton_interpret()


def gemm_configs() -> List[triton.Config]:
    """Autotune candidates for ``_w4a4_gemm_kernel`` (keys BLOCK_M, BLOCK_N, GROUP_M)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "GROUP_M": 2}, num_warps=4, num_stages=1)]
    cfg = []
    for bm, bn, warps, stages in ((128, 128, 8, 4), (128, 128, 8, 6), (64, 128, 4, 5), (64, 256, 8, 4),
                                  (128, 64, 4, 5), (64, 64, 4, 6)):
        cfg.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=warps, num_stages=stages))
    return cfg


def act_quant_configs() -> List[triton.Config]:
    """Autotune candidates for ``_fused_act_quant_kernel`` (a memory-bound pass over x)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s)
            for bm, w, s in ((16, 4, 3), (32, 4, 3), (64, 4, 2), (64, 8, 3))]


# ------------------------------------------------------------------------------- W4A8 (kernels/w4a8_triton.py)
# What the interpreter runs (one program's tile; BLOCK_K 64 or 128 both exercised by the CPU tests' explicit configs)
W4A8_INTERPRET_GEMM = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}


def w4a8_gemm_configs() -> List[triton.Config]:
    """Autotune candidates for ``_w4a8_gemm_kernel`` on sm_90 (kept short: each is a compile on first use).

    The kernel computes the tile transposed (the converted weight is wgmma's register A operand, BLOCK_N its M, the
    tokens BLOCK_M its N). sm_90 builds compiled ahead of time on a CPU machine (ptxas -v), none spilling: folded
    scales 128 x 128 176 registers (8 warps), 256 x 128 255, 128 x 256 252, 64 x 128 / 4 warps 190; exact group
    scales (a second fp32 tile: the group's dot before its scale) 128 x 128 196 (BLOCK_K 128: 245), 64 x 128 / 4
    warps 199, while 256 x 128 spills (offered to ``FOLD`` only, :func:`w4a8_prune`). The weight's conversion costs
    the same per tile whatever BLOCK_M, so wide token tiles (256) amortise it best. ``PREFETCH`` (the next group's
    conversion overlapping this group's MMAs, its bytes by plain loads) is tried on the two likeliest tiles. The
    packed weight tile is half the bytes of an fp8 one, so 3-4 stages fit easily."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PREFETCH": pf}, num_warps=w,
                          num_stages=s)
            for bm, bn, bk, w, s, pf in ((128, 128, 64, 8, 4, 0), (128, 128, 64, 8, 4, 1), (128, 128, 128, 8, 3, 0),
                                         (64, 128, 64, 4, 4, 0), (256, 128, 64, 8, 3, 0), (256, 128, 64, 8, 3, 1),
                                         (128, 256, 64, 8, 3, 0))]


def w4a8_prune(configs, named_args, **kwargs) -> List[triton.Config]:
    """The configs whose BLOCK_K divides K, and tiles over 128 x 128 only for ``FOLD`` (one accumulator)."""
    args = {**named_args, **kwargs}
    k, fold = int(args["K"]), bool(args.get("FOLD", False))
    keep = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0
            and (fold or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128)]
    return keep or [triton.Config({**configs[0].kwargs, "BLOCK_K": 64}, num_warps=configs[0].num_warps,
                                  num_stages=configs[0].num_stages)]


def w4a8_act_configs() -> List[triton.Config]:
    """Autotune candidates for ``_w4a8_act_kernel`` (memory-bound: x read in two passes, e4m3 written)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=s) for bm, w, s in ((16, 4, 3), (32, 8, 3))]
