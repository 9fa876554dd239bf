"""``layerwise_offload(pipe_or_module, ...)``: cache-dit's offload entry over the ``LayerwiseOffload`` pass.

For a pipeline, its transformer(s) get the pass: an accelerated transformer (``enable_cache`` /
``quantize``) adds it to its pass list, so it composes with DBCache (the blocks a cached step skips are
never loaded); a plain one is wrapped by ``compile_dit``. A bare module is returned wrapped.

cache-dit's handles over it: :func:`get_layerwise_offload_handles` / :func:`remove_layerwise_offload` find and
remove the pass (a :class:`LayerwiseOffloadHandle` per offloaded transformer). ``layerwise_offload`` itself returns
the pipeline or the wrapper, not cache-dit's handle.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, List, Optional, Tuple, Union

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


__all__ = ["layerwise_offload", "layerwise_cpu_offload", "LayerwiseOffloadHandle", "LayerwiseOffloadHandleGroup",
           "get_layerwise_offload_handles", "remove_layerwise_offload"]


def layerwise_cpu_offload(pipe_or_module: Any, **kwargs: Any) -> Any:
    """cache-dit's ``layerwise_cpu_offload``: :func:`layerwise_offload` with the weights kept in host memory."""
    if "offload_device" in kwargs:
        raise TypeError("layerwise_cpu_offload keeps the weights on the CPU: use layerwise_offload(..., "
                        "offload_device=...) for another device")
    return layerwise_offload(pipe_or_module, offload_device="cpu", **kwargs)


class LayerwiseOffloadHandle:
    """cache-dit's handle on one offloaded transformer: here the ``LayerwiseOffload`` pass in a wrapper's pass
    list (cache-dit's is a set of forward hooks). ``module_names`` are the repeated blocks whose weights the pass
    offloads (cache-dit lists the leaf modules it hooks); ``remove(offload=True)`` takes the pass out of the
    wrapper's list (the next call lowers again without it) and, as cache-dit's, leaves every block's weights on
    ``offload_device`` (the blocks kept resident included); ``offload=False`` leaves each where it is."""

    def __init__(self, root_module: CompiledDiT, offload: LayerwiseOffload):
        if not isinstance(root_module, CompiledDiT) or not any(p is offload for p in root_module.passes):
            raise ValueError("LayerwiseOffloadHandle: root_module must be a wrapper whose passes hold offload; "
                             "get_layerwise_offload_handles(pipe_or_wrapper) gives the handles")
        self.root_module, self.offload = root_module, offload
        self.onload_device, self.offload_device = offload.onload_device, offload.offload_device
        self.async_transfer, self.transfer_buckets = offload.async_transfer, offload.transfer_buckets
        self.prefetch_limit, self.max_copy_streams = offload.prefetch_limit, offload.max_copy_streams
        self.max_inflight_prefetch_bytes = offload.max_inflight
        self.persistent_buckets, self.persistent_bins = offload.persistent_buckets, offload.persistent_bins

    @property
    def removed(self) -> bool:
        """The pass is no longer in the wrapper's list (whichever handle removed it)."""
        return not any(p is self.offload for p in self.root_module.passes)

    def __eq__(self, other: object) -> bool:  # handles of one pass are one handle, as cache-dit's registered one
        return isinstance(other, LayerwiseOffloadHandle) and other.root_module is self.root_module \
            and other.offload is self.offload

    def __hash__(self) -> int:
        return hash((id(self.root_module), id(self.offload)))

    @property
    def module_names(self) -> List[str]:
        model = self.root_module.original
        return [f"{name}.{i}" for name, m in model.named_modules()
                if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(b) for b in m}) == 1
                for i in range(len(m))]

    def remove(self, *, offload: bool = True) -> None:
        if self.removed:
            return
        self.root_module.set_passes([p for p in self.root_module.passes if p is not self.offload])
        if offload:
            for name in self.module_names:
                self.root_module.original.get_submodule(name).to(self.offload_device)


class LayerwiseOffloadHandleGroup:
    """cache-dit's group of handles (one per offloaded transformer of a pipeline), the same aggregate."""

    def __init__(self, *, source: Any, handles: Iterable[LayerwiseOffloadHandle], root_names: Iterable[str]):
        self.source, self.handles, self.root_names = source, tuple(handles), tuple(root_names)

    @property
    def module_names(self) -> List[str]:
        return [f"{root}.{name}" if root and name else (name or root)
                for root, handle in zip(self.root_names, self.handles) for name in handle.module_names]

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self) -> Iterator[LayerwiseOffloadHandle]:
        return iter(self.handles)

    def remove(self, *, offload: bool = True) -> None:
        for handle in self.handles:
            handle.remove(offload=offload)


def get_layerwise_offload_handles(root_module: Any) -> Tuple[LayerwiseOffloadHandle, ...]:
    """The offloads of a pipeline's transformer(s), or of the wrapper ``layerwise_offload`` returned for a
    module, in pass-list order (a module never wrapped has none)."""
    return tuple(LayerwiseOffloadHandle(module, p) for _, _, module in _targets(root_module)
                 if isinstance(module, CompiledDiT) for p in module.passes if isinstance(p, LayerwiseOffload))


def remove_layerwise_offload(root_module: Any, *, offload: bool = True) -> int:
    """Remove every offload of ``root_module`` (see :class:`LayerwiseOffloadHandle`); returns how many."""
    handles = get_layerwise_offload_handles(root_module)
    for handle in handles:
        handle.remove(offload=offload)
    return len(handles)
