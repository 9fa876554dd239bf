"""The one place that turns parallel sizes into passes (``parallel_passes``): USP when ulysses and ring
are both > 1, else Ulysses / Ring; TensorParallel for tp > 1; both together on a (cp, tp) mesh, tp
innermost (rank ``g``: tp coordinate ``g % tp``), each pass with its own subgroup. Extra modules
(:func:`parallelize_extra_modules`): a VAE -> :func:`parallel_vae`, a ControlNet -> the transformer's
passes, anything else (text encoders) -> TensorParallel over the whole group.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..infra.pass_base import Pass
from ..parallel.mesh import ParallelMesh, check_ranks
from .context_parallel import USP, Ring, Ulysses
from .tensor_parallel import TensorParallel
from .vae_parallel import parallel_vae

__all__ = ["extra_components", "hybrid_passes", "parallel_passes", "parallelize_extra_modules", "parallelize_module"]


def _check_sizes(who: str, **sizes: int) -> None:
    for name, v in sizes.items():
        check_ranks(f"{who}: {name}", v)


def _check_world(who: str, ulysses: int, ring: int, tp: int, group: Optional[dist.ProcessGroup]) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who} needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group in each rank first)")
    world = dist.get_world_size(group)
    if ulysses * ring * tp != world:
        raise ValueError(f"{who}: ulysses × ring × tp = {ulysses} × {ring} × {tp} = {ulysses * ring * tp} "
                         f"ranks, but the group has {world}")


def parallel_passes(ulysses: int = 1, ring: int = 1, tp: int = 1,
                    group: Optional[dist.ProcessGroup] = None, ring_rotate_method: str = "p2p",
                    ulysses_float8: bool = False, ulysses_async: bool = False) -> List[Pass]:
    """The parallel passes for ``ulysses × ring × tp`` ranks of ``group`` (default: the world); sizes of
    1 drop their pass; ``ring_rotate_method``: how ring attention's K / V travel ("p2p" or "allgather");
    ``ulysses_float8``: the Ulysses all-to-alls in e4m3 (approximate); ``ulysses_async``: the q / k / v all-to-alls
    overlapped with the projections (Ulysses, or USP's Ulysses part). Context and tensor parallelism together
    build the subgroups of a (cp, tp) mesh: a collective, every rank calls it with the same sizes; one kind alone
    needs no process group yet."""
    _check_sizes("parallel_passes", ulysses=ulysses, ring=ring, tp=tp)
    cp_group = tp_group = group
    if tp > 1 and ulysses * ring > 1:
        _check_world("parallel_passes", ulysses, ring, tp, group)
        mesh = ParallelMesh((("cp", ulysses * ring), ("tp", tp)), group=group)
        cp_group, tp_group = mesh.group("cp"), mesh.group("tp")
    if ulysses_async and ulysses < 2:
        raise ValueError(f"parallel_passes(ulysses_async=True) overlaps the Ulysses all-to-alls, but ulysses={ulysses} "
                         f"(ring={ring}) runs none: set ulysses > 1 or drop ulysses_async")
    passes: List[Pass] = []
    if ulysses > 1 and ring > 1:
        passes.append(USP(ulysses=ulysses, ring=ring, group=cp_group, ring_rotate_method=ring_rotate_method,
                          ulysses_float8=ulysses_float8, ulysses_async=ulysses_async))
    elif ulysses > 1:
        passes.append(Ulysses(ulysses, group=cp_group, float8=ulysses_float8, async_qkv=ulysses_async))
    elif ring > 1:
        passes.append(Ring(ring, group=cp_group, rotate_method=ring_rotate_method))
    if tp > 1:
        passes.append(TensorParallel(tp, group=tp_group))
    return passes


def hybrid_passes(ulysses: int = 1, ring: int = 1, tp: int = 1,
                  group: Optional[dist.ProcessGroup] = None) -> List[Pass]:
    """:func:`parallel_passes`, checking first that a process group of ``ulysses × ring × tp`` ranks exists."""
    _check_sizes("hybrid_passes", ulysses=ulysses, ring=ring, tp=tp)
    _check_world("hybrid_passes", ulysses, ring, tp, group)
    return parallel_passes(ulysses, ring, tp, group)


def _is_vae(module: Any) -> bool:
    config = getattr(module, "config", None)
    return callable(getattr(module, "decode", None)) and config is not None and "latent_channels" in config


def parallelize_module(module: torch.nn.Module, size: int, transformer_passes: Callable[[], list],
                       group: Optional[dist.ProcessGroup] = None, keep_original: bool = False,
                       then: Union[Sequence[Pass], Callable[[], Sequence[Pass]]] = ()) -> torch.nn.Module:
    """The parallel replacement of one extra module (see the module docstring for the rule); ``keep_original``:
    as ``compile_dit``'s (the sharded weights stay in ``module`` too); ``then``: passes after the parallel ones
    (a quantization), or a callable building them (a VAE runs them on each graph it captures: give a callable,
    so that each gets its own)."""
    from .. import compile_dit

    build = then if callable(then) else (lambda: list(then))
    if _is_vae(module):
        return parallel_vae(module, size, group=group, then=build if callable(then) or then else None)
    if "controlnet" in type(module).__name__.lower():
        return compile_dit(module, passes=[*transformer_passes(), *build()], keep_original=keep_original)
    return compile_dit(module, passes=[*parallel_passes(tp=size, group=group), *build()], keep_original=keep_original)


def parallelize_extra_modules(pipe: Any, modules: Sequence[Any], size: int, transformer_passes: Callable[[], list],
                              group: Optional[dist.ProcessGroup] = None, keep_original: bool = False,
                              then: Optional[Dict[int, Any]] = None) -> List[Tuple[str, Any]]:
    """Replace each of ``modules`` (components of ``pipe``) by its parallel version (``then[id(module)]``: passes
    to run after the parallel ones, or a callable building them, as :func:`parallelize_module` takes); returns
    ``[(attribute, original), ...]`` so the caller can put the originals back."""
    replaced = extra_components(pipe, modules)
    for attr, module in replaced:
        setattr(pipe, attr, parallelize_module(module, size, transformer_passes, group, keep_original,
                                               (then or {}).get(id(module), ())))
    return replaced


def extra_components(pipe: Any, modules: Sequence[Any]) -> List[Tuple[str, Any]]:
    """``[(attribute, module), ...]``: the pipeline attribute holding each of ``modules``; refuses a module that
    is not one of ``pipe``'s components."""
    components = {id(v): k for k, v in getattr(pipe, "components", {}).items() if v is not None}
    missing = [type(m).__name__ for m in modules if id(m) not in components]
    if missing:
        raise ValueError(f"extra_parallel_modules: {missing} are not components of this pipeline "
                         f"({sorted(getattr(pipe, 'components', {}))}); pass e.g. [pipe.text_encoder, pipe.vae]")
    return [(components[id(m)], m) for m in modules]
