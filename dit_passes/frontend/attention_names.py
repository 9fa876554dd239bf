"""The attention backend names of cache-dit 1.5.3 and diffusers 0.42 (``ParallelismConfig.attention_backend``) as
dit_passes' :class:`~dit_passes.passes.AttentionBackend`: the ones that are PyTorch's own SDPA with one kernel
pinned map onto the pass (the same kernel, so the same output); ``"native"`` is SDPA's own choice, what the graph
already runs; the others are kernels of other packages (FlashAttention, SageAttention, xformers, ...) whose
output differs from SDPA's by their own arithmetic, and are refused by name."""
from __future__ import annotations

from typing import Any, Optional

from ..passes.attention_backend import AttentionBackend

# name -> the SDPA kernel pinned (diffusers' _native_* run SDPA under sdpa_kernel(<that kernel>) alone; cache-dit's
# _sdpa_cudnn is its cuDNN one). No fallback: with the kernel unavailable they raise, and so does the pass.
PINNED = {"_native_cudnn": "cudnn", "_sdpa_cudnn": "cudnn", "_native_flash": "flash",
          "_native_efficient": "efficient", "_native_math": "math"}
DEFAULT = ("native",)
# the names either package takes for kernels outside PyTorch's SDPA
OTHER_KERNELS = ("flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "flash_4_hub", "_flash_3", "_flash_varlen_3",
                 "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub", "flex", "_native_npu", "_native_xla", "sage",
                 "sage_hub", "sage_blackwell_hub", "sage_varlen", "_sage_qk_int8_pv_fp8_cuda",
                 "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton",
                 "xformers", "sage3", "ffpa", "ffpa_fp8", "ffpa_fp4", "ffpa_fp8_per_block", "_npu_fia",
                 "_mindiesd_laser")
SUPPORTED = (*DEFAULT, *PINNED)


def attention_pass(name: Any) -> Optional[AttentionBackend]:
    """The pass for the attention backend ``name`` (None: ``None`` or ``"native"``, SDPA's own choice). Raises
    ``NotImplementedError`` for a kernel of another package and ``ValueError`` for a name neither reference knows,
    both naming the supported ones."""
    if name is None:
        return None
    value = getattr(name, "value", name)  # an enum of either package
    if not isinstance(value, str):
        raise TypeError(f"ParallelismConfig.attention_backend must be a backend name (str), got {name!r}")
    key = value.lower()
    if key in DEFAULT:
        return None
    if key in PINNED:
        return AttentionBackend(PINNED[key], fallback=False)
    if key in OTHER_KERNELS:
        raise NotImplementedError(f"ParallelismConfig.attention_backend={value!r} is another package's attention "
                                  f"kernel, which dit_passes does not run (its output differs from SDPA's); use one "
                                  f"of {list(SUPPORTED)} (PyTorch SDPA: its own choice, or one kernel pinned), or "
                                  "leave it None")
    raise ValueError(f"ParallelismConfig.attention_backend={value!r} is not an attention backend of cache-dit or "
                     f"diffusers; use one of {list(SUPPORTED)} or leave it None")


__all__ = ["attention_pass", "PINNED", "SUPPORTED"]
