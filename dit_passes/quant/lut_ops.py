"""The custom ops of SVDQuant's lookup-table form (``w4_lut.py``), each with its reference (any device: the op's
body), fake and CUDA implementations:

* ``dit_passes::lut_quantize_smoothed(Tensor xd, Tensor h, Tensor c, int planes) -> (Tensor, Tensor)``: the GEMM's
  A operand [qx | hi | hi16 | lo | 0] (planes 3; 2: without lo) e4m3 [M, K + C] and sx fp32 [M] from the smoothed
  activation xd [M, K] and its down projection h [M, R] (``w4_lut.lut_smoothed_activation``; CUDA: the row kernel of
  ``dit_passes.kernels.lrcat_act_triton`` with ``planes``, one program per token reading xd once);
* ``dit_passes::lut_quantize_lowrank(Tensor xd, Tensor amax, Tensor lora_down, Tensor c, int planes) -> (Tensor,
  Tensor)``: the same operand from xd, its per-token amax fp32 [M] and lora_down [R, K], h computed inside in fp32
  (``w4_lut.lut_lowrank_activation``; CUDA: ``dit_passes.kernels.lut_act_triton``, xd read once);
* ``dit_passes::w4a8_lut_gemm(Tensor codes, Tensor tables, Tensor a, Tensor sw, Tensor sx, Tensor? bias,
  ScalarType out_dtype) -> Tensor``: ``out_dtype(sx * (sw * (a @ decode(codes, tables).T)) + bias)``
  (``w4_lut.lut_gemm_reference``; CUDA: the CUTLASS kernel ``dit_passes.kernels.w4a8_lut_cutlass`` on a
  compute-capability-9 GPU for bf16 out, else the reference).

Which runs is ``lut_dispatch``'s answer (:func:`lut_dispatch.lut_gemm_kernel`, :func:`lut_dispatch.lut_lowrank_kernel`,
:func:`lut_dispatch.lut_act_kernel`)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import lut_dispatch
from .custom_ops import check_smoothed_operands
from .fp8_int8 import FP8_DTYPE
from .graph_forms import LinearShape
from .int4 import GROUP_SIZE
from .lut_dispatch import PLANE_CHOICES
from .w4_lut import (branch_cols, lut_gemm_reference, lut_lowrank_activation, lut_smoothed_activation,
                     svdq_lut_linear_form)


def _check_act(xd, h, c, planes) -> int:
    name = "dit_passes::lut_quantize_smoothed"
    r = check_smoothed_operands(xd, h, c, name)
    if planes not in PLANE_CHOICES:
        raise ValueError(f"{name}: planes must be one of {PLANE_CHOICES} (the branch's columns in K), got {planes}")
    return r


@torch.library.custom_op("dit_passes::lut_quantize_smoothed", mutates_args=())
def lut_quantize_smoothed(xd: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                          planes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The LUT GEMM's A operand, reference implementation (any device): (e4m3 [M, K + C], fp32 [M])."""
    r = _check_act(xd, h, c, planes)
    a, sx = lut_smoothed_activation(xd, h, c, xd.shape[0], r, planes)
    return a, sx.clone()  # an op's outputs may not alias one another's storage or its inputs'


@lut_quantize_smoothed.register_kernel("cuda")
def _lut_quantize_smoothed_cuda(xd, h, c, planes):
    r = _check_act(xd, h, c, planes)
    kernel = lut_dispatch.lut_act_kernel(xd)
    if kernel is None:
        a, sx = lut_smoothed_activation(xd, h, c, xd.shape[0], r, planes)
        return a, sx.clone()
    a, sx = kernel.lrcat_quantize_smoothed(xd, h, c, planes=planes)
    return a, sx.view(-1)


@lut_quantize_smoothed.register_fake
def _lut_quantize_smoothed_fake(xd, h, c, planes):
    r = _check_act(xd, h, c, planes)
    m, k = xd.shape
    return (xd.new_empty((m, k + branch_cols(r, planes)), dtype=FP8_DTYPE), xd.new_empty((m,), dtype=torch.float32))


def _check_lowrank(xd, amax, lora_down, c, planes) -> int:
    name = "dit_passes::lut_quantize_lowrank"
    if xd.dim() != 2 or xd.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: xd must be a 2-D fp32 / bf16 / fp16 tensor [M, K], got {xd.dtype} {list(xd.shape)}")
    m, k = xd.shape
    if amax.dtype != torch.float32 or tuple(amax.shape) != (m,):
        raise ValueError(f"{name}: amax must be fp32 [{m}] (max |xd| per token: w4_lut.token_amax), got {amax.dtype} "
                         f"{list(amax.shape)}")
    r = lora_down.shape[0] if lora_down.dim() == 2 else -1
    if r < 1 or lora_down.shape[1] != k or not lora_down.is_floating_point():
        raise ValueError(f"{name}: lora_down must be a float [R, {k}] tensor (R >= 1), got {lora_down.dtype} "
                         f"{list(lora_down.shape)}")
    if c.dtype != torch.float32 or tuple(c.shape) != (r,):
        raise ValueError(f"{name}: c must be fp32 [{r}] (graph_forms.lrcat_c), got {c.dtype} {list(c.shape)}")
    if planes not in PLANE_CHOICES:
        raise ValueError(f"{name}: planes must be one of {PLANE_CHOICES} (the branch's columns in K), got {planes}")
    return r


@torch.library.custom_op("dit_passes::lut_quantize_lowrank", mutates_args=())
def lut_quantize_lowrank(xd: torch.Tensor, amax: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor,
                         planes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The LUT GEMM's A operand with the down projection computed inside, reference implementation (any device):
    (e4m3 [M, K + C], fp32 [M])."""
    r = _check_lowrank(xd, amax, lora_down, c, planes)
    a, sx = lut_lowrank_activation(xd, amax, lora_down, c, xd.shape[0], r, planes)
    return a, sx.clone()


@lut_quantize_lowrank.register_kernel("cuda")
def _lut_quantize_lowrank_cuda(xd, amax, lora_down, c, planes):
    r = _check_lowrank(xd, amax, lora_down, c, planes)
    kernel = lut_dispatch.lut_lowrank_kernel(xd)
    if kernel is None:
        a, sx = lut_lowrank_activation(xd, amax, lora_down, c, xd.shape[0], r, planes)
        return a, sx.clone()
    return kernel.lut_quantize_lowrank(xd, amax, lora_down, c, planes)


@lut_quantize_lowrank.register_fake
def _lut_quantize_lowrank_fake(xd, amax, lora_down, c, planes):
    r = _check_lowrank(xd, amax, lora_down, c, planes)
    m, k = xd.shape
    return (xd.new_empty((m, k + branch_cols(r, planes)), dtype=FP8_DTYPE), xd.new_empty((m,), dtype=torch.float32))


def _check_gemm(codes, tables, a, sw, sx, bias) -> Tuple[int, int, int]:
    name = "dit_passes::w4a8_lut_gemm"
    m, k = a.shape if a.dim() == 2 else (-1, -1)
    n = codes.shape[0] if codes.dim() == 2 else -1
    want = {"a": (a, FP8_DTYPE, (m, k)), "codes": (codes, torch.uint8, (n, k // 2)),
            "tables": (tables, torch.uint8, (k // GROUP_SIZE, n, 8)), "sw": (sw, torch.float32, (n,)),
            "sx": (sx, torch.float32, (m,))}
    if bias is not None:
        want["bias"] = (bias, bias.dtype, (n,))
    bad = [f"{name_} {t.dtype} {list(t.shape)} (want {dt} {list(shape)})" for name_, (t, dt, shape) in want.items()
           if t.dtype != dt or tuple(t.shape) != shape]
    if m < 0 or k % GROUP_SIZE or n % 16 or bad:
        raise ValueError(f"{name}: a e4m3 [M, K] (K % 64 == 0), codes uint8 [N, K/2] (N % 16 == 0), tables uint8 "
                         f"[K/64, N, 8], sw / sx fp32 [N] / [M]; got " + ("; ".join(bad) or f"K={k} N={n}"))
    return m, n, k


@torch.library.custom_op("dit_passes::w4a8_lut_gemm", mutates_args=())
def w4a8_lut_gemm(codes: torch.Tensor, tables: torch.Tensor, a: torch.Tensor, sw: torch.Tensor, sx: torch.Tensor,
                  bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The LUT GEMM, reference implementation (any device): [M, N] in ``out_dtype``."""
    _check_gemm(codes, tables, a, sw, sx, bias)
    return lut_gemm_reference(codes, tables, a, sw, sx, bias, out_dtype)


@w4a8_lut_gemm.register_kernel("cuda")
def _w4a8_lut_gemm_cuda(codes, tables, a, sw, sx, bias, out_dtype):
    m, _, _ = _check_gemm(codes, tables, a, sw, sx, bias)
    kernel = lut_dispatch.lut_gemm_kernel(a, out_dtype)
    if kernel is None or m % 8 or (bias is not None and bias.dtype != torch.bfloat16):
        return lut_gemm_reference(codes, tables, a, sw, sx, bias, out_dtype)
    return kernel.lut_gemm(codes.contiguous(), tables.contiguous(), a.contiguous(), sw.contiguous(),
                           sx.contiguous(), None if bias is None else bias.contiguous())


@w4a8_lut_gemm.register_fake
def _w4a8_lut_gemm_fake(codes, tables, a, sw, sx, bias, out_dtype):
    m, n, _ = _check_gemm(codes, tables, a, sw, sx, bias)
    return a.new_empty((m, n), dtype=out_dtype)


@torch.library.custom_op("dit_passes::svdq_lut_linear", mutates_args=())
def svdq_lut_linear(x: torch.Tensor, codes: torch.Tensor, tables: torch.Tensor, sw: torch.Tensor, c: torch.Tensor,
                    lora_down: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor],
                    act_quant: str = "auto", lut_act: str = "auto", planes: int = 0) -> torch.Tensor:
    """The whole LUT linear x [..., K] -> [..., N] as one op (what the ``svdq_lut`` kind writes where x's shape is
    not known when the graph is written; otherwise its graph form, ``w4_lut.svdq_lut_linear_form``), any device;
    ``act_quant`` / ``lut_act`` / ``planes`` (0: the default): the pass's settings (``forms.QuantForms``)."""
    shape = LinearShape.of(x, codes.shape[0], x.shape[-1], bias, sw, rank=lora_down.shape[0])
    return svdq_lut_linear_form(x, codes, tables, sw, c, lora_down, smooth_inv, bias, shape,
                                lut_dispatch.lut_act(x, act_quant, lut_act),
                                lut_dispatch.lut_planes(planes or None)).clone()


@svdq_lut_linear.register_fake
def _svdq_lut_linear_fake(x, codes, tables, sw, c, lora_down, smooth_inv, bias, act_quant="auto", lut_act="auto",
                          planes=0):
    if x.shape[-1] != smooth_inv.shape[0]:
        raise ValueError(f"dit_passes::svdq_lut_linear: x's last dim {x.shape[-1]} != smooth_inv's "
                         f"{smooth_inv.shape[0]}")
    return x.new_empty((*x.shape[:-1], codes.shape[0]))
