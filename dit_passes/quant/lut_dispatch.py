"""Which implementation runs SVDQuant's lookup-table form (``w4_lut.py``, ``lut_ops.py``), beside ``dispatch.py``
(whose ``DIT_PASSES_W4A4_BACKEND`` it reads through :func:`dispatch.backend_setting`):

* :func:`svdq_lut`: whether the W4A4 tables are stored in the LUT form for a model on a device (``auto``: a Hopper
  GPU where the CUTLASS library builds, :func:`lut_ready`; ``lut``: any device);
* :func:`lut_planes`: the branch's columns in K (``DIT_PASSES_LUT_PLANES``, 2 by default);
* :func:`lut_act`: how the A operand is written (``DIT_PASSES_LUT_ACT``: the row kernel after a cuBLAS mm, or the
  op that computes the down projection itself);
* :func:`lut_gemm_kernel` / :func:`lut_lowrank_kernel` / :func:`lut_act_kernel`: the kernel modules of the ops on
  CUDA, or None (the reference).
"""
from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Optional

import torch

from .dispatch import _import_kernel, backend_setting, capability, fp8_act_quant, lrcat_act_module

# the LUT form is the Hopper default (auto) where its library builds: the fastest SVDQuant form of the FLUX step on
# the H100 and the H200 at SVDQuant's fidelity (bench/results/quant_step_h100.md, quant_step_h200.md;
# quant_fidelity_lut2.md against lrcat_split's quant_fidelity_hopper.md)
LUT_DEFAULT = True
LUT_PLANES_ENV = "DIT_PASSES_LUT_PLANES"
# two planes (h in e4m3, the GEMM 64 columns shorter at rank 32): the faster in each run that had both, at SVDQuant's
# fidelity (the fastest form that keeps SVDQuant-level fidelity): bench/results/quant_step_h100.md (two against three
# planes, one process), quant_step_h200.md; digits DiT PTQ in quant_fidelity_lut2.md
LUT_PLANES_DEFAULT = 2
PLANE_CHOICES = (2, 3)  # the stored operand has three planes; a GEMM over two reads its prefix
LUT_ACT_ENV = "DIT_PASSES_LUT_ACT"
LUT_ACT_SETTINGS = ("rows", "lowrank")


@functools.lru_cache(maxsize=None)
def lut_gemm_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.w4a8_lut_cutlass`` (``lut_gemm``, ``is_available``), or None."""
    return _import_kernel("w4a8_lut_cutlass", "the reference")


def lut_ready(device: torch.device) -> bool:
    """Whether the LUT GEMM runs on ``device``: a compute-capability-9 GPU where its library builds (nvcc and the
    nvidia-cutlass headers, the first time) or was built."""
    if device.type != "cuda" or capability(device)[0] != 9:
        return False
    module = lut_gemm_module()
    return module is not None and module.is_available()


def svdq_lut(device: torch.device) -> bool:
    """Whether SVDQuant's linears are stored and written in the lookup-table form (``w4_lut.py``) for a model on
    ``device``: ``DIT_PASSES_W4A4_BACKEND=lut`` on any device (the reference GEMM off Hopper; tests); ``auto`` on
    a Hopper GPU where the LUT GEMM runs (:func:`lut_ready`)."""
    setting = backend_setting()
    return setting == "lut" or (setting == "auto" and LUT_DEFAULT and lut_ready(device))


def lut_planes() -> int:
    """The LUT form's branch columns in K (``DIT_PASSES_LUT_PLANES``): 3 ([hi | hi16 | lo]: ~8 bits of h, lrcat_split's
    fidelity) or 2 ([hi | hi16]: h in e4m3, the GEMM 64-128 columns shorter; the default where measured faster at
    SVDQuant's fidelity, LUT_PLANES_DEFAULT)."""
    s = os.environ.get(LUT_PLANES_ENV, "").strip() or str(LUT_PLANES_DEFAULT)
    if s not in tuple(map(str, PLANE_CHOICES)):
        raise ValueError(f"{LUT_PLANES_ENV}={s!r}: expected one of {PLANE_CHOICES}")
    return int(s)


def lut_act(x: torch.Tensor) -> str:
    """How the LUT form writes the A operand of activations like ``x`` (``w4_lut.lut_activation``'s ``act``):
    ``"graph"`` (ATen ops) where ``dispatch.fp8_act_quant`` keeps the graph form (off sm_89+ GPUs), else as
    ``DIT_PASSES_LUT_ACT`` asks: ``rows`` (the default), ``"kernel"``: h by a cuBLAS mm, then the row kernel (xd read
    twice); ``lowrank``: the op ``dit_passes::lut_quantize_lowrank`` (xd's amax in its producer, the down projection
    inside the op, xd read once), measured no faster (its quantization kernel at ~half the memory bandwidth):
    ``bench/results/quant_step_h200.md``, ``quant_step_h100.md``."""
    s = os.environ.get(LUT_ACT_ENV, "").strip().lower() or LUT_ACT_SETTINGS[0]
    if s not in LUT_ACT_SETTINGS:
        raise ValueError(f"{LUT_ACT_ENV}={s!r}: expected one of {LUT_ACT_SETTINGS}")
    act = fp8_act_quant("per_row", x)
    return "lowrank" if act == "kernel" and s == "lowrank" else act


def lut_gemm_kernel(a: torch.Tensor, out_dtype: torch.dtype) -> Optional[ModuleType]:
    """The module running ``dit_passes::w4a8_lut_gemm`` on CUDA for this operand (bf16 out on Hopper), or None
    (the reference)."""
    return lut_gemm_module() if out_dtype == torch.bfloat16 and lut_ready(a.device) else None


@functools.lru_cache(maxsize=None)
def lut_act_module() -> Optional[ModuleType]:
    """``dit_passes.kernels.lut_act_triton`` (``lut_quantize_lowrank``, ``is_supported``), or None."""
    return _import_kernel("lut_act_triton", "the reference")


def lut_lowrank_kernel(xd: torch.Tensor) -> Optional[ModuleType]:
    """The module running ``dit_passes::lut_quantize_lowrank`` on CUDA (sm_89+), or None."""
    kernel = lut_act_module()
    return kernel if kernel is not None and kernel.is_supported(xd) else None


def lut_act_kernel(xd: torch.Tensor) -> Optional[ModuleType]:
    """The module running ``dit_passes::lut_quantize_smoothed`` on CUDA (sm_89+, a row in registers), or None."""
    kernel = lrcat_act_module()
    return kernel if kernel is not None and kernel.smoothed_supported(xd) else None
