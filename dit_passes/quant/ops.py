"""Quantized linears as ``torch.library`` custom ops (namespace ``dit_passes``).

Ops (each returns a new tensor [..., N] in x.dtype; graphs holding them stay exportable and compilable):

* ``dit_passes::svdq_w4a4_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor lora_down,
  Tensor lora_up, Tensor smooth_inv, Tensor? bias) -> Tensor`` (shapes: see ``int4.w4a4_linear_reference``)
* ``dit_passes::fp8_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias, str granularity) -> Tensor``
* ``dit_passes::int8_linear(Tensor x, Tensor qweight, Tensor wscale, Tensor? bias) -> Tensor``

Every op has an any-device reference implementation and a fake (meta) implementation that checks
shapes. On CUDA, ``svdq_w4a4_linear`` calls the Triton kernels of ``dit_passes.kernels.w4a4_triton``
(in a source checkout: the top-level ``kernels/w4a4_triton.py``) when that module imports:
``fused_act_quant(x2d, smooth_inv, lora_down) -> (qx_packed, ascale, lora_act)`` and
``w4a4_gemm(qx_packed, ascale, qweight, wscale, lora_act, lora_up, bias, out_dtype) -> [M, N]``, with an
optional ``is_supported(x2d, qweight) -> bool``. Without it the reference runs. CPU never imports it.
Before that, ``dit_passes.kernels.w4a4_cutlass_linear`` may take the call (CUTLASS fp8 groupwise GEMM on
sm_90, bf16 activations): ``DIT_PASSES_W4A4_BACKEND=triton|cutlass|auto`` and its timing table decide.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType
from typing import Optional

import torch

from .fp8_int8 import FP8_GRANULARITIES, fp8_linear as _fp8_linear_impl, int8_linear_reference
from .int4 import w4a4_linear_reference

_KERNEL_MODULES = ("dit_passes.kernels.w4a4_triton", "kernels.w4a4_triton")
_CUTLASS_MODULES = ("dit_passes.kernels.w4a4_cutlass_linear", "kernels.w4a4_cutlass_linear")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_kernel_module(names, attrs, fallback: str) -> Optional[ModuleType]:
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):  # the module itself is absent
                continue
            warnings.warn(f"{name} needs a missing module ({e.name}); W4A4 runs {fallback} on CUDA")
            return None
        except ImportError as e:
            warnings.warn(f"{name} failed to import ({e}); W4A4 runs {fallback} on CUDA")
            return None
        if name.startswith("kernels.") and not os.path.abspath(mod.__file__).startswith(_REPO_ROOT + os.sep):
            continue
        if all(hasattr(mod, f) for f in attrs):
            return mod
    return None


@functools.lru_cache(maxsize=None)
def w4a4_kernel_module() -> Optional[ModuleType]:
    """The W4A4 kernel module, or None when it is absent or its dependencies (triton) are missing.

    Memoised because the answer cannot change within a process and a failed import costs a file-system
    search. The source-checkout name ``kernels`` is only accepted from this repository, never from an
    unrelated installed package of that name. Errors other than ImportError propagate: a broken
    kernel must be loud, not silently replaced.
    """
    return _import_kernel_module(_KERNEL_MODULES, ("fused_act_quant", "w4a4_gemm"), "the reference")


@functools.lru_cache(maxsize=None)
def w4a4_cutlass_module() -> Optional[ModuleType]:
    """The CUTLASS W4A4 linear (``kernels/w4a4_cutlass_linear.py``: ``use_cutlass(x, qweight) -> bool``,
    ``w4a4_linear(...)``), or None; its backend choice is ``DIT_PASSES_W4A4_BACKEND`` (see there)."""
    return _import_kernel_module(_CUTLASS_MODULES, ("use_cutlass", "w4a4_linear"), "Triton")


# ---------------------------------------------------------------------------------------------- W4A4


def _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias) -> None:
    k = x.shape[-1]
    n = qweight.shape[0]
    r = lora_down.shape[0]
    problems = []
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] * 2 != k:
        problems.append(f"qweight must be uint8 [N, {k}//2], got {qweight.dtype} {list(qweight.shape)}")
    if wscale.dim() != 2 or wscale.shape[0] != n or wscale.shape[1] * 64 != k:
        problems.append(f"wscale must be [{n}, {k}//64], got {list(wscale.shape)}")
    if lora_down.dim() != 2 or lora_down.shape[1] != k:
        problems.append(f"lora_down must be [rank, {k}], got {list(lora_down.shape)}")
    if lora_up.dim() != 2 or lora_up.shape[0] != n or lora_up.shape[1] != r:
        problems.append(f"lora_up must be [{n}, {r}], got {list(lora_up.shape)}")
    if smooth_inv.dim() != 1 or smooth_inv.shape[0] != k:
        problems.append(f"smooth_inv must be [{k}], got {list(smooth_inv.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        problems.append(f"bias must be [{n}], got {list(bias.shape)}")
    if problems:
        raise ValueError("dit_passes::svdq_w4a4_linear: " + "; ".join(problems))


@torch.library.custom_op("dit_passes::svdq_w4a4_linear", mutates_args=())
def svdq_w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                     lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """SVDQuant W4A4 linear, reference implementation (any device)."""
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    return w4a4_linear_reference(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)


@svdq_w4a4_linear.register_kernel("cuda")
def _svdq_w4a4_linear_cuda(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    if os.environ.get("DIT_PASSES_W4A4_BACKEND", "auto").strip().lower() != "triton":
        cutlass = w4a4_cutlass_module()
        if cutlass is not None and cutlass.use_cutlass(x, qweight):
            return cutlass.w4a4_linear(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    return w4a4_linear_with_kernel(w4a4_kernel_module(), x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)


def w4a4_linear_with_kernel(kernel: Optional[ModuleType], x, qweight, wscale, lora_down, lora_up, smooth_inv,
                            bias) -> torch.Tensor:
    """Run the W4A4 linear through ``kernel``'s two functions (the contract in the module docstring);
    the reference when ``kernel`` is None or its ``is_supported`` declines these inputs."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    if kernel is None or (hasattr(kernel, "is_supported") and not kernel.is_supported(x2d, qweight)):
        return w4a4_linear_reference(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    qx, ascale, lora_act = kernel.fused_act_quant(x2d, smooth_inv, lora_down)
    out = kernel.w4a4_gemm(qx, ascale, qweight, wscale, lora_act, lora_up, bias, x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[0])


@svdq_w4a4_linear.register_fake
def _svdq_w4a4_linear_fake(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
    _check_w4a4_shapes(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# --------------------------------------------------------------------------------------- fp8 / int8


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


def _check_granularity(granularity: str) -> None:
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"dit_passes::fp8_linear: granularity must be one of {FP8_GRANULARITIES}, "
                         f"got {granularity!r}")


@torch.library.custom_op("dit_passes::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: Optional[torch.Tensor],
               granularity: str) -> torch.Tensor:
    """fp8 e4m3 linear with dynamic activation scales (``torch._scaled_mm`` on capable CUDA)."""
    _check_granularity(granularity)
    _check_8bit_shapes("fp8_linear", x, qweight, wscale, bias, granularity == "per_row")
    return _fp8_linear_impl(x, qweight, wscale, bias, granularity)


@fp8_linear.register_fake
def _fp8_linear_fake(x, qweight, wscale, bias, granularity):
    _check_granularity(granularity)
    _check_8bit_shapes("fp8_linear", x, qweight, wscale, bias, granularity == "per_row")
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("dit_passes::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 per-row dynamic linear (int32 accumulation; ``torch._int_mm`` on CUDA)."""
    _check_8bit_shapes("int8_linear", x, qweight, wscale, bias, True)
    return int8_linear_reference(x, qweight, wscale, bias)


@int8_linear.register_fake
def _int8_linear_fake(x, qweight, wscale, bias):
    _check_8bit_shapes("int8_linear", x, qweight, wscale, bias, True)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
