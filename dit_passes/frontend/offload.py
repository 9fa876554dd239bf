"""``layerwise_offload(pipe_or_module, ...)``: cache-dit's offload entry over the ``LayerwiseOffload`` pass.

For a pipeline, its transformer(s) get the pass: an accelerated transformer (``enable_cache`` /
``quantize``) adds it to its pass list, so it composes with DBCache (the blocks a cached step skips are
never loaded); a plain one is wrapped by ``compile_dit``. A bare module is returned wrapped.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch

from ..compiled import CompiledDiT
from ..passes.offload import LayerwiseOffload
from .api import _targets

logger = logging.getLogger("dit_passes")


def layerwise_offload(pipe_or_module: Any, *, onload_device: Union[str, torch.device, None] = "cuda",
                      offload_device: Union[str, torch.device] = "cpu", async_transfer: bool = False,
                      transfer_buckets: int = 1, prefetch_limit: bool = False, max_copy_streams: Optional[int] = None,
                      max_inflight_prefetch_bytes: Union[int, str, None] = None, persistent_buckets: int = 0,
                      persistent_bins: int = 1) -> Any:
    """Keep the transformer blocks' weights on ``offload_device``; each block loads them onto
    ``onload_device`` as it runs (``transfer_buckets`` blocks ahead with ``async_transfer``). Returns the
    pipeline (its transformer replaced on that instance) or, for a module, the wrapper to use."""
    offload = LayerwiseOffload(onload_device=onload_device, offload_device=offload_device,
                               async_transfer=async_transfer, transfer_buckets=transfer_buckets,
                               prefetch_limit=prefetch_limit, max_copy_streams=max_copy_streams,
                               max_inflight_prefetch_bytes=max_inflight_prefetch_bytes,
                               persistent_buckets=persistent_buckets, persistent_bins=persistent_bins)
    wrapped = []
    for owner, attr, module in _targets(pipe_or_module):
        if isinstance(module, CompiledDiT):
            if any(isinstance(p, LayerwiseOffload) for p in module.passes):
                raise ValueError(f"layerwise_offload: {attr or type(module.original).__name__} is already offloaded")
            module.set_passes([*module.passes, offload])  # the PassManager orders it before the cache
            wrapped.append(module)
        else:
            wrapped.append(CompiledDiT(module, [offload]))
            if owner is not None:
                setattr(owner, attr, wrapped[-1])
        logger.info("layerwise_offload(%s): blocks on %s, loaded onto %s", attr or type(module).__name__,
                    offload.offload_device, onload_device)
    return pipe_or_module if _targets(pipe_or_module)[0][0] is not None else wrapped[0]


__all__ = ["layerwise_offload"]


def layerwise_cpu_offload(pipe_or_module: Any, **kwargs: Any) -> Any:
    """cache-dit's ``layerwise_cpu_offload``: :func:`layerwise_offload` with the weights kept in host memory."""
    if "offload_device" in kwargs:
        raise TypeError("layerwise_cpu_offload keeps the weights on the CPU: use layerwise_offload(..., "
                        "offload_device=...) for another device")
    return layerwise_offload(pipe_or_module, offload_device="cpu", **kwargs)
