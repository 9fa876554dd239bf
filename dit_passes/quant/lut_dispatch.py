"""Which implementation runs SVDQuant's lookup-table form (``w4_lut.py``, ``lut_ops.py``), beside ``dispatch.py``
(whose :func:`dispatch.device_default` gives the per-device defaults of the settings read here):

* :func:`svdq_lut`: whether the W4A4 tables are stored in the LUT form for a model on a device (``form="auto"``: a
  Hopper GPU where the CUTLASS library builds, :func:`lut_ready`; ``form="lut"``: any device);
* :func:`lut_planes`: the branch's columns in K (``lut_planes``, 2 by default);
* :func:`lut_act`: how the A operand is written (``lut_act``: the row kernel after a cuBLAS mm, or the op that
  computes the down projection itself);
* :func:`lut_gemm_kernel` / :func:`lut_lowrank_kernel` / :func:`lut_act_kernel`: the kernel modules of the ops on
  CUDA, or None (the reference).
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Optional

import torch

from .dispatch import (_import_kernel, capability, device_capability, device_default, fp8_act_quant,
                       lrcat_act_module)
from .forms import LUT_ACT_SETTINGS, LUT_PLANE_CHOICES, SVDQ_FORMS

PLANE_CHOICES = LUT_PLANE_CHOICES  # the stored operand has three planes; a GEMM over two reads its prefix


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


def svdq_lut(device: torch.device, setting: str = "auto") -> bool:
    """Whether SVDQuant's linears are stored and written in the lookup-table form (``w4_lut.py``) for a model on
    ``device`` with ``form`` = ``setting``: ``"lut"`` on any device (the reference GEMM off Hopper; tests); ``auto``
    where :func:`dispatch.device_default` takes it and the LUT GEMM runs (:func:`lut_ready`)."""
    if setting not in SVDQ_FORMS:
        raise ValueError(f"form must be one of {SVDQ_FORMS}, got {setting!r}")
    if setting != "auto":
        return setting == "lut"
    cap = None if device.type != "cuda" else tuple(capability(device))
    return device_default("form", cap) == "lut" and lut_ready(device)


def lut_planes(setting: Optional[int] = None) -> int:
    """The LUT form's branch columns in K (``lut_planes``): 3 ([hi | hi16 | lo]: ~8 bits of h, lrcat_split's
    fidelity) or 2 ([hi | hi16]: h in e4m3, the GEMM 64-128 columns shorter); None: :func:`dispatch.device_default`."""
    if setting is None:
        return device_default("lut_planes", None)
    if setting not in PLANE_CHOICES:
        raise ValueError(f"lut_planes must be one of {PLANE_CHOICES}, got {setting!r}")
    return int(setting)


def lut_act(x: torch.Tensor, act_quant: str = "auto", setting: str = "auto") -> str:
    """How the LUT form writes the A operand of activations like ``x`` (``w4_lut.lut_activation``'s ``act``):
    ``"graph"`` (ATen ops) where ``dispatch.fp8_act_quant`` keeps the graph form (``act_quant``), else as ``lut_act``
    (``setting``) asks: ``rows`` -> ``"kernel"``: h by a cuBLAS mm, then the row kernel (xd read twice); ``lowrank``:
    the op ``dit_passes::lut_quantize_lowrank`` (xd's amax in its producer, the down projection inside the op, xd
    read once); ``auto``: :func:`dispatch.device_default`."""
    if setting not in LUT_ACT_SETTINGS:
        raise ValueError(f"lut_act must be one of {LUT_ACT_SETTINGS}, got {setting!r}")
    s = device_default("lut_act", device_capability(x)) if setting == "auto" else setting
    act = fp8_act_quant("per_row", x, act_quant)
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
