"""The quantized-linear ``torch.library`` custom ops (namespace ``dit_passes``), all registered here.

Ops (each returns a new tensor [..., N] in x.dtype; graphs holding them stay exportable and compilable):

* ``dit_passes::svdq_w4a4_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor lora_down,
  Tensor lora_up, Tensor smooth_inv, Tensor? bias) -> Tensor`` (shapes: see ``int4.w4a4_linear_reference``)
* ``dit_passes::svdq_w4a8_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor lora_down, Tensor lora_up,
  Tensor smooth_inv, Tensor? bias, bool fold) -> Tensor`` (SVDQuant's tensors as W4A8 on fp8 tensor cores, the
  fused Triton kernels; see ``w4a8.w4a8_linear_reference``)
* ``dit_passes::svdq_nvfp4_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor wglobal, Tensor lora_down,
  Tensor lora_up, Tensor smooth_inv, Tensor? bias) -> Tensor`` (NVFP4 W4A4; see ``nvfp4.nvfp4_linear_reference``)
* ``dit_passes::fp8_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias, str granularity) -> Tensor``
* ``dit_passes::int8_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias) -> Tensor``
* ``dit_passes::fp8_quantize_rows(Tensor x) -> (Tensor, Tensor)``: x [M, K] (fp32 / bf16 / fp16) -> (e4m3 [M, K],
  fp32 scale [M, 1]) per row (``fp8_int8.quantize_fp8_act``); what the fp8 graph form writes for its activations
  with ``act_quant="kernel"`` (CUDA: one Triton kernel, ``dit_passes.kernels.fp8_rowquant_triton``)
* ``dit_passes::w4_to_e4m3(Tensor qweight, Tensor wscale) -> (Tensor, Tensor)``: SVDQuant's packed int4 weights
  uint8 [N, K/2] and group scales [N, K/64] -> (e4m3 [N, K], fp32 row scale [N]) (``graph_forms.w4_to_e4m3``);
  what the SVDQuant fp8 graph form writes for its weight expansion with ``w4_expand="kernel"`` (CUDA: one
  bandwidth-bound Triton kernel, ``dit_passes.kernels.w4_expand_triton``)
* ``dit_passes::w4_lrcat_to_e4m3(Tensor qweight, Tensor wscale, Tensor lora_up, Tensor c, bool split)
  -> (Tensor, Tensor)``: the lrcat design's B operand e4m3 [N, K + cols] and row scale fp32 [N]
  (``graph_forms.lrcat_weight``: the expanded int4 weights and the scaled low-rank up factor under one row scale;
  CUDA: the same Triton kernel writing both parts)
* ``dit_passes::lrcat_quantize_rows(Tensor x, Tensor smooth_inv, Tensor lora_down, Tensor c, bool split)
  -> (Tensor, Tensor)``: the lrcat design's A operand e4m3 [M, K + cols] and per-token scale fp32 [M, 1]
  (``graph_forms.lrcat_activation``: smoothing, per-token e4m3 and the low-rank down projection of x [M, K]); what
  the lrcat graph form writes with ``lrcat_act="stats"`` (CUDA: two Triton kernels,
  ``dit_passes.kernels.lrcat_act_triton``)
* ``dit_passes::lrcat_quantize_smoothed(Tensor xd, Tensor h, Tensor c, bool split) -> (Tensor, Tensor)``: the same
  operand from the smoothed activation xd [M, K] and its down projection h [M, R] computed before
  (``graph_forms.lrcat_smoothed_activation``); what the lrcat form writes by default on sm_89+ (``lrcat_act``
  ``auto`` / ``mm``; CUDA: one Triton program per token reading xd once)
* ``dit_passes::w4a16_rows_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias) -> Tensor``: weight-only int4
  on a few rows x [M, K] (``weight_only_forms.w4a16_linear_form(rows=True)``: the AdaLN modulation linears); what the
  int4 weight-only forms write with ``weight_only_form="kernel"`` (CUDA: one GEMV pass over the packed
  weight, ``dit_passes.kernels.w4a16_rows_triton``)
* ``dit_passes::int8_tensor_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias) -> Tensor`` (one scale for
  the activations, one for the weight: cache-dit's ``int8_per_tensor``)
* ``dit_passes::fp8_block_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias) -> Tensor`` (block-scaled
  fp8, ``fp8_block.py``: cache-dit's ``float8_per_block``; the reference on every device)

Each op has three implementations: the reference (any device; the op's body), the fake (meta: checks the
shapes, allocates the output) and the CUDA one, which asks ``dispatch.py`` which backend runs (W4A4:
CUTLASS, Triton or the reference; W4A8: the fused Triton kernels or the reference; fp8: ``torch._scaled_mm`` or
the reference; int8: ``torch._int_mm`` or the reference).

The other ``dit_passes::`` ops stay with their subsystems, each next to the only code that emits it:
``onload`` (passes/offload.py), ``sdpa_backend`` (passes/attention_backend.py), ``ring_exchange``
(parallel/collectives.py), ``vae_halo_exchange`` / ``vae_group_stats`` / ``vae_group_norm_apply``
(parallel/vae_ops.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import dispatch
from .fp8_block import check_fp8_block_args, fp8_block_linear_reference
from .fp8_int8 import (FP8_DTYPE, FP8_GRANULARITIES, fp8_linear_reference, fp8_linear_scaled_mm, int8_linear_reference,
                       quantize_fp8_act)
from .graph_forms import lrcat_activation, lrcat_cols, lrcat_smoothed_activation, lrcat_weight
from .graph_forms import w4_to_e4m3 as w4_to_e4m3_reference
from .int4 import w4a4_linear_reference
from .nvfp4 import BLOCK, nvfp4_linear_reference
from .w4a8 import w4a8_linear_reference
from .weight_only_forms import w4a16_linear_form


# ---------------------------------------------------------------------------------------------- W4A4


def _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, op="svdq_w4a4_linear") -> None:
    k = x.shape[-1]
    n = qweight.shape[0]
    problems = []
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] * 2 != k:
        problems.append(f"qweight must be uint8 [N, {k}//2], got {qweight.dtype} {list(qweight.shape)}")
    if wscale.dim() != 2 or wscale.shape[0] != n or wscale.shape[1] * 64 != k:
        problems.append(f"wscale must be [{n}, {k}//64], got {list(wscale.shape)}")
    problems += _branch_problems(k, n, lora_down, lora_up, smooth_inv, bias)
    if problems:
        raise ValueError(f"dit_passes::{op}: " + "; ".join(problems))


def _branch_problems(k: int, n: int, lora_down, lora_up, smooth_inv, bias) -> list:
    """The SVDQuant tensors beside the 4-bit weight: low-rank factors, smoothing, bias."""
    r = lora_down.shape[0]
    problems = []
    if lora_down.dim() != 2 or lora_down.shape[1] != k:
        problems.append(f"lora_down must be [rank, {k}], got {list(lora_down.shape)}")
    if lora_up.dim() != 2 or lora_up.shape[0] != n or lora_up.shape[1] != r:
        problems.append(f"lora_up must be [{n}, {r}], got {list(lora_up.shape)}")
    if smooth_inv.dim() != 1 or smooth_inv.shape[0] != k:
        problems.append(f"smooth_inv must be [{k}], got {list(smooth_inv.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        problems.append(f"bias must be [{n}], got {list(bias.shape)}")
    return problems


@torch.library.custom_op("dit_passes::svdq_w4a4_linear", mutates_args=())
def svdq_w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                     lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor],
                     backend: str = "auto") -> torch.Tensor:
    """SVDQuant W4A4 linear, reference implementation (any device). ``backend``: the CUDA kernel
    (``dispatch.OP_BACKENDS``: ``SVDQuantW4A4(form="triton" | "cutlass")``; ``auto``: the timing table's)."""
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    dispatch.check_op_backend(backend)
    return w4a4_linear_reference(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)


@svdq_w4a4_linear.register_kernel("cuda")
def _svdq_w4a4_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, backend="auto"):
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    return dispatch.w4a4_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, backend)


@svdq_w4a4_linear.register_fake
def _svdq_w4a4_linear_fake(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, backend="auto"):
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    dispatch.check_op_backend(backend)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# ---------------------------------------------------------------------------------------------- W4A8
W4A8_OP = "svdq_w4a8_linear"

@torch.library.custom_op("dit_passes::svdq_w4a8_linear", mutates_args=())
def svdq_w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                     lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor],
                     fold: bool) -> torch.Tensor:
    """SVDQuant's stored tensors as W4A8 (per-token e4m3 activations), reference implementation (any device)."""
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, W4A8_OP)
    return w4a8_linear_reference(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold)


@svdq_w4a8_linear.register_kernel("cuda")
def _svdq_w4a8_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold):
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, W4A8_OP)
    return dispatch.w4a8_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold)


@svdq_w4a8_linear.register_fake
def _svdq_w4a8_linear_fake(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, fold):
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, W4A8_OP)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# --------------------------------------------------------------------------------------------- NVFP4


def _check_nvfp4_shapes(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias) -> None:
    k, n = x.shape[-1], qweight.shape[0]
    problems = []
    if k % BLOCK:
        problems.append(f"K={k} must be a multiple of {BLOCK}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] * 2 != k:
        problems.append(f"qweight must be uint8 [N, {k}//2], got {qweight.dtype} {list(qweight.shape)}")
    if wscale.dtype != torch.float8_e4m3fn or wscale.dim() != 2 or tuple(wscale.shape) != (n, k // BLOCK):
        problems.append(f"wscale must be float8_e4m3fn [{n}, {k}//{BLOCK}], got {wscale.dtype} {list(wscale.shape)}")
    if wglobal.dtype != torch.float32 or wglobal.numel() != 1:
        problems.append(f"wglobal must be one fp32 value, got {wglobal.dtype} {list(wglobal.shape)}")
    problems += _branch_problems(k, n, lora_down, lora_up, smooth_inv, bias)
    if problems:
        raise ValueError("dit_passes::svdq_nvfp4_linear: " + "; ".join(problems))


@torch.library.custom_op("dit_passes::svdq_nvfp4_linear", mutates_args=())
def svdq_nvfp4_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wglobal: torch.Tensor,
                      lora_down: torch.Tensor, lora_up: torch.Tensor, smooth_inv: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """SVDQuant NVFP4 W4A4 linear, reference implementation (any device: the exact dequantization in fp32). On
    sm_89+ GPUs the quantize passes write the fp8 graph form instead (``graph_forms.svdq_nvfp4_fp8_linear_form``)."""
    _check_nvfp4_shapes(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias)
    return nvfp4_linear_reference(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias)


@svdq_nvfp4_linear.register_fake
def _svdq_nvfp4_linear_fake(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias):
    _check_nvfp4_shapes(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _check_8bit_shapes(op: str, x, qweight, wscale, bias, per_row: bool) -> None:
    n = qweight.shape[0]
    if qweight.dim() != 2 or qweight.shape[1] != x.shape[-1]:
        raise ValueError(f"dit_passes::{op}: qweight must be [N, {x.shape[-1]}], got {list(qweight.shape)}")
    if per_row and (wscale.dim() != 1 or wscale.shape[0] != n):
        raise ValueError(f"dit_passes::{op}: per-row wscale must be [{n}], got {list(wscale.shape)}")
    if not per_row and wscale.numel() != 1:
        raise ValueError(f"dit_passes::{op}: per-tensor wscale must hold one value, got {list(wscale.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"dit_passes::{op}: bias must be [{n}], got {list(bias.shape)}")


def _check_fp8(x, qweight, wscale, bias, granularity: str) -> None:
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"dit_passes::fp8_linear: granularity must be one of {FP8_GRANULARITIES}, "
                         f"got {granularity!r}")
    _check_8bit_shapes("fp8_linear", x, qweight, wscale, bias, granularity == "per_row")


@torch.library.custom_op("dit_passes::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: Optional[torch.Tensor],
               granularity: str) -> torch.Tensor:
    """fp8 e4m3 linear with dynamic activation scales, reference implementation (any device)."""
    _check_fp8(x, qweight, wscale, bias, granularity)
    return fp8_linear_reference(x, qweight, wscale, bias, granularity)


@fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(x, qweight, wscale, bias, granularity):
    _check_fp8(x, qweight, wscale, bias, granularity)
    if dispatch.fp8_backend(x, qweight, granularity) == "scaled_mm":
        return fp8_linear_scaled_mm(x, qweight, wscale, bias, granularity)
    return fp8_linear_reference(x, qweight, wscale, bias, granularity)


@fp8_linear.register_fake
def _fp8_linear_fake(x, qweight, wscale, bias, granularity):
    _check_fp8(x, qweight, wscale, bias, granularity)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("dit_passes::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 per-row dynamic linear (int32 accumulation), reference implementation (any device)."""
    _check_8bit_shapes("int8_linear", x, qweight, wscale, bias, True)
    return int8_linear_reference(x, qweight, wscale, bias)


@int8_linear.register_kernel("cuda")
def _int8_linear_cuda(x, qweight, wscale, bias):
    _check_8bit_shapes("int8_linear", x, qweight, wscale, bias, True)
    return int8_linear_reference(x, qweight, wscale, bias, int_mm=dispatch.int8_backend(x, qweight) == "int_mm")


@int8_linear.register_fake
def _int8_linear_fake(x, qweight, wscale, bias):
    _check_8bit_shapes("int8_linear", x, qweight, wscale, bias, True)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _check_rows(x) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dit_passes::fp8_quantize_rows: x must be a 2-D fp32 / bf16 / fp16 tensor [M, K], got "
                         f"{x.dtype} {list(x.shape)} (reshape the activation to [tokens, K] first)")


@torch.library.custom_op("dit_passes::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization, reference implementation (any device): (e4m3 [M, K], fp32 scale [M, 1])."""
    _check_rows(x)
    return quantize_fp8_act(x, "per_row")


@fp8_quantize_rows.register_kernel("cuda")
def _fp8_quantize_rows_cuda(x):
    _check_rows(x)
    return dispatch.fp8_quantize_rows_cuda(x)


@fp8_quantize_rows.register_fake
def _fp8_quantize_rows_fake(x):
    _check_rows(x)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def _check_w4_expand(qweight, wscale) -> None:
    k = 2 * qweight.shape[-1]
    ok = qweight.dtype == torch.uint8 and qweight.dim() == 2 and k > 0 and k % 64 == 0
    if not ok or wscale.dim() != 2 or wscale.shape[0] != qweight.shape[0] or wscale.shape[1] * 64 != k:
        raise ValueError(f"dit_passes::w4_to_e4m3: qweight must be uint8 [N, K/2] with K a positive multiple of 64 "
                         f"and wscale [N, K/64], got {qweight.dtype} {list(qweight.shape)} and {list(wscale.shape)}")
    if not wscale.is_floating_point():
        raise ValueError(f"dit_passes::w4_to_e4m3: wscale must be a float tensor, got {wscale.dtype}")


@torch.library.custom_op("dit_passes::w4_to_e4m3", mutates_args=())
def w4_to_e4m3(qweight: torch.Tensor, wscale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 weights to e4m3 with the group scales folded, reference implementation (any device): (e4m3
    [N, K], fp32 row scale [N])."""
    _check_w4_expand(qweight, wscale)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    return w4_to_e4m3_reference(qweight, wscale, n, k)


@w4_to_e4m3.register_kernel("cuda")
def _w4_to_e4m3_cuda(qweight, wscale):
    _check_w4_expand(qweight, wscale)
    return dispatch.w4_to_e4m3_cuda(qweight, wscale)


@w4_to_e4m3.register_fake
def _w4_to_e4m3_fake(qweight, wscale):
    _check_w4_expand(qweight, wscale)
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    return qweight.new_empty((n, k), dtype=FP8_DTYPE), qweight.new_empty((n,), dtype=torch.float32)


def _check_lrcat(qweight, wscale, lora_up, c) -> int:
    _check_w4_expand(qweight, wscale)
    n, r = qweight.shape[0], lora_up.shape[-1]
    if lora_up.dim() != 2 or lora_up.shape[0] != n or not lora_up.is_floating_point():
        raise ValueError(f"dit_passes::w4_lrcat_to_e4m3: lora_up must be a float [{n}, R] tensor, got {lora_up.dtype} "
                         f"{list(lora_up.shape)}")
    if c.dtype != torch.float32 or tuple(c.shape) != (r,):
        raise ValueError(f"dit_passes::w4_lrcat_to_e4m3: c must be fp32 [{r}] (graph_forms.lrcat_c), got {c.dtype} "
                         f"{list(c.shape)}")
    return r


@torch.library.custom_op("dit_passes::w4_lrcat_to_e4m3", mutates_args=())
def w4_lrcat_to_e4m3(qweight: torch.Tensor, wscale: torch.Tensor, lora_up: torch.Tensor, c: torch.Tensor,
                     split: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat B operand [w8 | u8 | 0] (``split``: [w8 | u_hi | u_hi | u_lo | 0]) and its row scale, reference
    implementation (any device): (e4m3 [N, K + cols], fp32 [N])."""
    r = _check_lrcat(qweight, wscale, lora_up, c)
    return lrcat_weight(qweight, wscale, lora_up, c, qweight.shape[0], 2 * qweight.shape[1], r, split=split)


@w4_lrcat_to_e4m3.register_kernel("cuda")
def _w4_lrcat_to_e4m3_cuda(qweight, wscale, lora_up, c, split):
    _check_lrcat(qweight, wscale, lora_up, c)
    return dispatch.w4_lrcat_to_e4m3_cuda(qweight, wscale, lora_up, c, split)


@w4_lrcat_to_e4m3.register_fake
def _w4_lrcat_to_e4m3_fake(qweight, wscale, lora_up, c, split):
    r = _check_lrcat(qweight, wscale, lora_up, c)
    n = qweight.shape[0]
    return (qweight.new_empty((n, 2 * qweight.shape[1] + lrcat_cols(r, split)), dtype=FP8_DTYPE),
            qweight.new_empty((n,), dtype=torch.float32))


def _check_lrcat_act(x, smooth_inv, lora_down, c) -> int:
    name = "dit_passes::lrcat_quantize_rows"
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: x must be a 2-D fp32 / bf16 / fp16 tensor [M, K], got {x.dtype} {list(x.shape)} "
                         "(reshape the activation to [tokens, K] first)")
    k = x.shape[1]
    if lora_down.dim() != 2 or lora_down.shape[1] != k or lora_down.shape[0] < 1 or not lora_down.is_floating_point():
        raise ValueError(f"{name}: lora_down must be a float [R, {k}] tensor (R >= 1), got {lora_down.dtype} "
                         f"{list(lora_down.shape)}")
    r = lora_down.shape[0]
    if c.dtype != torch.float32 or tuple(c.shape) != (r,) or tuple(smooth_inv.shape) != (k,):
        raise ValueError(f"{name}: c must be fp32 [{r}] (graph_forms.lrcat_c) and smooth_inv [{k}], got {c.dtype} "
                         f"{list(c.shape)} and {list(smooth_inv.shape)}")
    return r


@torch.library.custom_op("dit_passes::lrcat_quantize_rows", mutates_args=())
def lrcat_quantize_rows(x: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor,
                        split: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat A operand [qx | qh | 0] (``split``: [qx | hi | lo | hi | 0]) and its per-token scale, reference
    implementation (any device): (e4m3 [M, K + cols], fp32 [M, 1])."""
    r = _check_lrcat_act(x, smooth_inv, lora_down, c)
    return lrcat_activation(x, smooth_inv, lora_down, c, x.shape[0], r, x.dtype, split)


@lrcat_quantize_rows.register_kernel("cuda")
def _lrcat_quantize_rows_cuda(x, smooth_inv, lora_down, c, split):
    _check_lrcat_act(x, smooth_inv, lora_down, c)
    return dispatch.lrcat_quantize_rows_cuda(x, smooth_inv, lora_down, c, split)


@lrcat_quantize_rows.register_fake
def _lrcat_quantize_rows_fake(x, smooth_inv, lora_down, c, split):
    r = _check_lrcat_act(x, smooth_inv, lora_down, c)
    return (x.new_empty((x.shape[0], x.shape[1] + lrcat_cols(r, split)), dtype=FP8_DTYPE),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def check_smoothed_operands(xd, h, c, name: str = "dit_passes::lrcat_quantize_smoothed") -> int:
    """The smoothed activation xd [M, K], its down projection h [M, R] and the branch scale c fp32 [R] of the ops that
    make an A operand from them (this one, ``lut_ops``'); returns R."""
    if xd.dim() != 2 or xd.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: xd must be a 2-D fp32 / bf16 / fp16 tensor [M, K], got {xd.dtype} {list(xd.shape)}")
    r = h.shape[1] if h.dim() == 2 else -1
    if h.dim() != 2 or h.shape[0] != xd.shape[0] or r < 1 or not h.is_floating_point():
        raise ValueError(f"{name}: h must be a float [{xd.shape[0]}, R] tensor (R >= 1: xd's down projection), got "
                         f"{h.dtype} {list(h.shape)}")
    if c.dtype != torch.float32 or tuple(c.shape) != (r,):
        raise ValueError(f"{name}: c must be fp32 [{r}] (graph_forms.lrcat_c), got {c.dtype} {list(c.shape)}")
    return r


@torch.library.custom_op("dit_passes::lrcat_quantize_smoothed", mutates_args=())
def lrcat_quantize_smoothed(xd: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                            split: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat A operand from the smoothed activation and its down projection, reference implementation (any
    device): (e4m3 [M, K + cols], fp32 [M, 1])."""
    r = check_smoothed_operands(xd, h, c)
    return lrcat_smoothed_activation(xd, h, c, xd.shape[0], r, split)


@lrcat_quantize_smoothed.register_kernel("cuda")
def _lrcat_quantize_smoothed_cuda(xd, h, c, split):
    check_smoothed_operands(xd, h, c)
    return dispatch.lrcat_quantize_smoothed_cuda(xd, h, c, split)


@lrcat_quantize_smoothed.register_fake
def _lrcat_quantize_smoothed_fake(xd, h, c, split):
    r = check_smoothed_operands(xd, h, c)
    return (xd.new_empty((xd.shape[0], xd.shape[1] + lrcat_cols(r, split)), dtype=FP8_DTYPE),
            xd.new_empty((xd.shape[0], 1), dtype=torch.float32))


def _check_w4a16_rows(x, qweight, wscale, bias) -> None:
    name = "dit_passes::w4a16_rows_linear"
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: x must be a 2-D fp32 / bf16 / fp16 tensor [M, K], got {x.dtype} {list(x.shape)}")
    k, n = x.shape[1], qweight.shape[0] if qweight.dim() == 2 else -1
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, k // 2) or k % 64 or \
            tuple(wscale.shape) != (n, k // 64):
        raise ValueError(f"{name}: qweight must be uint8 [N, {k // 2}] and wscale [N, {k // 64}] (K = {k}, a multiple "
                         f"of 64), got {qweight.dtype} {list(qweight.shape)} and {list(wscale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{name}: bias must be [{n}], got {list(bias.shape)}")


@torch.library.custom_op("dit_passes::w4a16_rows_linear", mutates_args=())
def w4a16_rows_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Weight-only int4 linear of a few rows x [M, K], reference implementation (any device): the multiply-and-sum
    of ``weight_only_forms.w4a16_linear_form(rows=True)``, [M, N] in x.dtype."""
    _check_w4a16_rows(x, qweight, wscale, bias)
    return w4a16_linear_form(x, qweight, wscale, bias, rows=True)


@w4a16_rows_linear.register_kernel("cuda")
def _w4a16_rows_linear_cuda(x, qweight, wscale, bias):
    _check_w4a16_rows(x, qweight, wscale, bias)
    return dispatch.w4a16_rows_cuda(x, qweight, wscale, bias)


@w4a16_rows_linear.register_fake
def _w4a16_rows_linear_fake(x, qweight, wscale, bias):
    _check_w4a16_rows(x, qweight, wscale, bias)
    return x.new_empty((x.shape[0], qweight.shape[0]))


@torch.library.custom_op("dit_passes::int8_tensor_linear", mutates_args=())
def int8_tensor_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 per-tensor dynamic linear (int32 accumulation), reference implementation (any device)."""
    _check_8bit_shapes("int8_tensor_linear", x, qweight, wscale, bias, False)
    return int8_linear_reference(x, qweight, wscale, bias, granularity="per_tensor")


@int8_tensor_linear.register_kernel("cuda")
def _int8_tensor_linear_cuda(x, qweight, wscale, bias):
    _check_8bit_shapes("int8_tensor_linear", x, qweight, wscale, bias, False)
    return int8_linear_reference(x, qweight, wscale, bias, int_mm=dispatch.int8_backend(x, qweight) == "int_mm",
                                 granularity="per_tensor")


@int8_tensor_linear.register_fake
def _int8_tensor_linear_fake(x, qweight, wscale, bias):
    _check_8bit_shapes("int8_tensor_linear", x, qweight, wscale, bias, False)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("dit_passes::fp8_block_linear", mutates_args=())
def fp8_block_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Block-scaled fp8 linear (tiles of the weight, per token and block of x), reference implementation (any
    device; a block-scaled GEMM kernel for Hopper is not written yet)."""
    return fp8_block_linear_reference(x, qweight, wscale, bias)


@fp8_block_linear.register_fake
def _fp8_block_linear_fake(x, qweight, wscale, bias):
    check_fp8_block_args(x, qweight, wscale, bias)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
