"""Per-row (per-token) e4m3 quantization of an activation in one read and one write.

:func:`fp8_quantize_rows` is the CUDA implementation of ``dit_passes::fp8_quantize_rows`` (its specification:
``dit_passes.quant.fp8_int8.quantize_fp8_act`` per row). One program per row::

    xf = float(x[m, :])                       # loaded once when K <= 16384 (FLUX's widest input: 15360)
    sx = div_rn(amax|xf|, 448)                # a zero scale becomes 1
    q  = e4m3(clamp(xf * div_rn(1, sx), -448, 448))    # one division per row, round to nearest even

Above ``SINGLE_MAX`` the row is read twice in chunks (abs-max, then quantize: the second pass finds the row in L2).
Why a kernel: Inductor splits the graph form into a reduction and a pointwise kernel that both re-read (and
recompute) the producer's output, and divides every element. Under ``TRITON_INTERPRET=1`` (CPU tests) the e4m3
rounding is ``w4a8_triton._soft_e4m3`` (the interpreter's cast mis-rounds at binade carries) with the sign of a
flushed zero kept; on the GPU the hardware cast (round to nearest even, satfinite).
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch
import triton
import triton.language as tl

from .w4a4_autotune import interpreting
from .w4a8_triton import E4M3_MAX, _soft_e4m3

SINGLE_MAX = 16384  # widest row held in registers in one piece
CHUNK = 8192        # the step of the two-pass loop above it
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rowquant_one_pass(x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    xf = tl.load(x_ptr + row * s_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = _row_e4m3(xf, SOFT)
    tl.store(q_ptr + row * s_qm + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _row_e4m3(xf, SOFT: tl.constexpr):
    # one row held in registers (fp32, 0 past K) -> its e4m3 values and scale (amax / 448; a zero row: 1)
    scale = tl.math.div_rn(tl.max(tl.abs(xf), axis=0), E4M3_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    inv = tl.math.div_rn(1.0, scale)
    y = tl.minimum(tl.maximum(xf * inv, -E4M3_MAX), E4M3_MAX)
    return _to_e4m3(y, SOFT), scale


@triton.jit
def _rowquant_two_pass(x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, TRIP: tl.constexpr, BLOCK: tl.constexpr,
                       SOFT: tl.constexpr):
    # TRIP: the chunk count as a compile-time constant (the interpreter cannot loop to a runtime bound, see
    # w4a8_triton); a kernel per K is what the graph asks for anyway (its shapes are static)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, TRIP):
        cols = i * BLOCK + offs
        xf = tl.load(x_ptr + row * s_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xf))
    scale = tl.math.div_rn(tl.max(amax, axis=0), E4M3_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    inv = tl.math.div_rn(1.0, scale)
    for i in range(0, TRIP):
        cols = i * BLOCK + offs
        xf = tl.load(x_ptr + row * s_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(xf * inv, -E4M3_MAX), E4M3_MAX)
        tl.store(q_ptr + row * s_qm + cols, _to_e4m3(y, SOFT), mask=cols < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _to_e4m3(v, SOFT: tl.constexpr):
    if SOFT:  # the soft rounding's magic-number add loses the sign of a flushed zero: put it back (bit equality)
        sign = v.to(tl.int32, bitcast=True) & -2147483648
        v = (_soft_e4m3(v).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


def num_warps_for(block: int) -> int:
    """Warps per row program: enough threads that each holds at most ~32 values (16 warps at 16384)."""
    return max(1, min(16, block // 1024)) if block >= 4096 else (4 if block >= 1024 else 2)


def is_supported(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x``: a float 2-D tensor on an sm_89+ GPU (the e4m3 cast), or any device under
    the interpreter."""
    if x.dim() != 2 or x.dtype not in _DTYPES:
        return False
    if interpreting():
        return True
    return x.device.type == "cuda" and _has_e4m3(x.device.index if x.device.index is not None else
                                                 torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _has_e4m3(index: int) -> bool:
    # once per device: the op runs a few hundred times per step, from Python
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32 / bf16 / fp16) -> ``(q float8_e4m3fn [M, K], scale fp32 [M, 1])`` (module docstring)."""
    name = "fp8_quantize_rows"
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{name}: x must be a 2-D tensor of {_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: the Triton kernel needs a CUDA tensor (got {x.device}); on CPU use the op's "
                         "reference (dit_passes.quant.fp8_int8.quantize_fp8_act) or set TRITON_INTERPRET=1 (tests)")
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    if k == 0:
        return q, scale.fill_(1.0)
    soft = interpreting()
    if k <= SINGLE_MAX:
        block = triton.next_power_of_2(k)
        _rowquant_one_pass[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, SOFT=soft,
                                 num_warps=num_warps_for(block))
    else:
        _rowquant_two_pass[(m,)](x, q, scale, k, x.stride(0), q.stride(0), TRIP=triton.cdiv(k, CHUNK), BLOCK=CHUNK,
                                 SOFT=soft, num_warps=num_warps_for(CHUNK))
    return q, scale
