"""Context × tensor parallel hybrids on one device mesh: the passes for ``ulysses × ring × tp`` ranks.

Layout (tp innermost, as TorchTitan and the reference place it): global rank ``g`` has tp coordinate
``g % tp`` and context-parallel coordinate ``g // tp``. Ranks with the same cp coordinate hold the same
sequence shard and split the weights; ranks with the same tp coordinate hold the same weight shard and
split the sequence. Each pass gets its own subgroup:

    [Ulysses(2, group=<ranks {0,2} or {1,3}>), TensorParallel(2, group=<ranks {0,1} or {2,3}>)]   # 4 ranks
"""
from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from ..infra.pass_base import Pass
from .mesh import ParallelMesh


def hybrid_passes(ulysses: int = 1, ring: int = 1, tp: int = 1,
                  group: Optional[dist.ProcessGroup] = None) -> List[Pass]:
    """The parallel passes for a ``ulysses × ring × tp`` layout over ``group`` (default: the world).

    Collective (builds subgroups): every rank calls it with the same sizes. Sizes of 1 drop their pass.
    """
    from ..passes.context_parallel import USP, Ring, Ulysses
    from ..passes.tensor_parallel import TensorParallel

    for name, v in (("ulysses", ulysses), ("ring", ring), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"hybrid_passes: {name} must be a positive int, got {v!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hybrid_passes needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group in each rank first)")
    world = dist.get_world_size(group)
    if ulysses * ring * tp != world:
        raise ValueError(f"hybrid_passes: ulysses × ring × tp = {ulysses} × {ring} × {tp} = {ulysses * ring * tp} "
                         f"ranks, but the group has {world}")
    cp = ulysses * ring
    mesh = ParallelMesh((("cp", cp), ("tp", tp)), group=group)
    passes: List[Pass] = []
    if ulysses > 1 and ring > 1:
        passes.append(USP(ulysses=ulysses, ring=ring, group=mesh.group("cp")))
    elif ulysses > 1:
        passes.append(Ulysses(ulysses, group=mesh.group("cp")))
    elif ring > 1:
        passes.append(Ring(ring, group=mesh.group("cp")))
    if tp > 1:
        passes.append(TensorParallel(tp, group=mesh.group("tp")))
    return passes


__all__ = ["hybrid_passes"]
