"""``ParallelMesh``: named parallel dims over an initialised torch.distributed group.

Dims are ordered ``(name, size)`` pairs whose product is the group's size, laid out row-major: the
**last dim is innermost** (consecutive ranks; put ``tp`` last). ``mesh.group(name)`` is the group of
the ranks that differ from this one only along ``name``, ``mesh.rank(name)`` this rank's coordinate.
Over the world group it uses ``init_device_mesh`` (``mesh.device_mesh`` for DTensor users), over a
subgroup ``new_group(..., use_local_synchronization=True)``. Construction is collective.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch.distributed as dist

from ..infra.pass_base import Refusal

__all__ = ["MeshError", "ParallelMesh", "check_ranks", "factorisations"]


class MeshError(ValueError, Refusal):
    """The requested mesh does not fit the process group (or no group is initialised)."""


def check_ranks(what: str, value) -> int:
    """``value`` if it is a positive int (a number of ranks), else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int (number of ranks), got {value!r}")
    return value


def factorisations(world_size: int, ndims: int) -> list[tuple[int, ...]]:
    """All ordered ``ndims``-tuples of positive ints whose product is ``world_size``."""
    if ndims == 0:
        return [()] if world_size == 1 else []
    out = []
    for first in range(1, world_size + 1):
        if world_size % first == 0:
            out.extend((first,) + rest for rest in factorisations(world_size // first, ndims - 1))
    return out


def _normalise_dims(dims) -> tuple[tuple[str, ...], tuple[int, ...]]:
    items = list(dims.items()) if isinstance(dims, Mapping) else list(dims)
    if not items:
        raise MeshError("a mesh needs at least one dim, e.g. {'ulysses': 2}")
    names, sizes = [], []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise MeshError(f"mesh dims are (name, size) pairs, got {item!r}")
        name, size = item
        if not isinstance(name, str) or not name:
            raise MeshError(f"mesh dim names are non-empty strings, got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(f"mesh dim {name!r} needs a positive int size, got {size!r}")
        names.append(name)
        sizes.append(size)
    if len(set(names)) != len(names):
        raise MeshError(f"mesh dim names must be unique, got {names}")
    return tuple(names), tuple(sizes)


class ParallelMesh:
    """Named dims over a process group; see the module docstring for the rank layout.

    Args:
        dims: ``{"ring": 2, "ulysses": 2, "tp": 1}`` or a sequence of ``(name, size)`` pairs, outermost
            first.
        group: parent ProcessGroup; the default (world) group when None.
    """

    def __init__(self, dims: Mapping[str, int] | Sequence[tuple[str, int]], *, group: dist.ProcessGroup | None = None) -> None:
        self.names, self.sizes = _normalise_dims(dims)
        if not (dist.is_available() and dist.is_initialized()):
            raise MeshError("ParallelMesh needs an initialised torch.distributed process group: call "
                            "torch.distributed.init_process_group(...) first (or use "
                            "dit_passes.testing.run_ranks in tests)")
        parent = group if group is not None else dist.group.WORLD
        world = dist.get_world_size(parent)
        if math.prod(self.sizes) != world:
            valid = factorisations(world, len(self.sizes))
            shown = ", ".join(str(v) for v in valid[:12]) + (" ..." if len(valid) > 12 else "")
            raise MeshError(f"mesh {dict(zip(self.names, self.sizes))} has {math.prod(self.sizes)} ranks but the "
                            f"process group has {world}; sizes for {self.names} whose product is {world}: {shown}")
        self.parent = parent
        self.world_size = world
        self.global_rank = dist.get_rank(parent)
        # row-major: the stride of a dim is the product of the sizes after it
        self.coordinate = tuple(self.global_rank // math.prod(self.sizes[i + 1:]) % n for i, n in enumerate(self.sizes))
        self.device_mesh = None
        if parent is dist.group.WORLD:
            self._groups = self._groups_from_device_mesh()
        else:
            self._groups = self._groups_from_new_group()

    # -- construction --------------------------------------------------------------------------

    def _groups_from_device_mesh(self) -> dict[str, dist.ProcessGroup]:
        from torch.distributed.device_mesh import init_device_mesh

        backend = str(dist.get_backend(self.parent))
        device_type = "cuda" if "nccl" in backend else "cpu"
        self.device_mesh = init_device_mesh(device_type, self.sizes, mesh_dim_names=self.names)
        return {name: self.device_mesh.get_group(name) for name in self.names}

    def _groups_from_new_group(self) -> dict[str, dist.ProcessGroup]:
        parent_ranks = dist.get_process_group_ranks(self.parent)
        groups = {}
        for axis, name in enumerate(self.names):
            # Members: every parent index whose coordinate equals ours except along `axis`.
            stride = math.prod(self.sizes[axis + 1:])
            base = self.global_rank - self.coordinate[axis] * stride
            members = [parent_ranks[base + value * stride] for value in range(self.sizes[axis])]
            # Local synchronisation: only the members call new_group for their group, so ranks may
            # create different groups without a world-wide ordering constraint.
            groups[name] = dist.new_group(members, use_local_synchronization=True)
        return groups

    # -- queries -------------------------------------------------------------------------------

    def _check(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"mesh has no dim {name!r}; its dims are {self.names}")
        return self.names.index(name)

    def group(self, name: str) -> dist.ProcessGroup:
        """ProcessGroup of the ranks along dim ``name`` through this rank."""
        self._check(name)
        return self._groups[name]

    def rank(self, name: str) -> int:
        """This rank's coordinate along ``name`` (its rank inside ``group(name)``)."""
        return self.coordinate[self._check(name)]

    def size(self, name: str) -> int:
        """Size of dim ``name`` (1 if the dim is off)."""
        return self.sizes[self._check(name)]

    def ranks_along(self, name: str) -> list[int]:
        """Global ranks of ``group(name)``, in dim order."""
        return dist.get_process_group_ranks(self.group(name))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))
        return f"ParallelMesh({dims}; rank {self.global_rank} at {self.coordinate})"

