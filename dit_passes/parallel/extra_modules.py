"""TE-P / VAE-P / CN-P: parallelise a pipeline's other modules with the passes of its transformer.

The front end's ``ParallelismConfig(extra_parallel_modules=[pipe.text_encoder, pipe.vae, pipe.controlnet])``
lands here (``parallelize_extra_modules``). Each module is replaced on that pipeline instance only:

* a VAE (a module with ``decode`` and a ``latent_channels`` config): :func:`dit_passes.parallel.vae.parallel_vae`
  over the whole group (the latent split spatially, halos exchanged);
* a ControlNet (repeated DiT blocks, like its transformer): the transformer's own parallel passes;
* anything else (text encoders: T5, Llama, Qwen, ...): ``TensorParallel`` over the whole group, since a
  text encoder's sequence is short and its weights are what weigh.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def _is_vae(module: Any) -> bool:
    config = getattr(module, "config", None)
    return callable(getattr(module, "decode", None)) and config is not None and "latent_channels" in config


def _is_controlnet(module: Any) -> bool:
    return "controlnet" in type(module).__name__.lower()


def parallelize_module(module: torch.nn.Module, size: int, transformer_passes: Callable[[], list],
                       group: Optional[dist.ProcessGroup] = None) -> torch.nn.Module:
    """The parallel replacement of one extra module (see the module docstring for the rule)."""
    from .. import compile_dit
    from ..passes import TensorParallel

    if _is_vae(module):
        from .vae import parallel_vae
        return parallel_vae(module, size, group=group)
    if _is_controlnet(module):
        return compile_dit(module, passes=transformer_passes())
    return compile_dit(module, passes=[TensorParallel(size, group=group)])


def parallelize_extra_modules(pipe: Any, modules: Sequence[Any], size: int, transformer_passes: Callable[[], list],
                              group: Optional[dist.ProcessGroup] = None) -> List[Tuple[str, Any]]:
    """Replace each of ``modules`` (components of ``pipe``) by its parallel version; returns
    ``[(attribute, original), ...]`` so the caller can put the originals back."""
    components = {id(v): k for k, v in getattr(pipe, "components", {}).items() if v is not None}
    missing = [type(m).__name__ for m in modules if id(m) not in components]
    if missing:
        raise ValueError(f"extra_parallel_modules: {missing} are not components of this pipeline "
                         f"({sorted(getattr(pipe, 'components', {}))}); pass e.g. [pipe.text_encoder, pipe.vae]")
    replaced: List[Tuple[str, Any]] = []
    for module in modules:
        attr = components[id(module)]
        setattr(pipe, attr, parallelize_module(module, size, transformer_passes, group))
        replaced.append((attr, module))
    return replaced


__all__ = ["parallelize_extra_modules", "parallelize_module"]
