"""``fake_world(rank, world_size)``: this one process as rank ``rank`` of a ``world_size``-rank world, for lowering.

The parallel passes read only the group's size, this process's rank in it and the groups a mesh splits it into;
the graph they write depends on nothing else. Under torch's fake process group (backend ``"fake"``, the one
torch's own tests and its ``after_aot`` repro scripts use for a single rank) every collective returns at once
without communicating, so lowering a pass list here gives the graph rank ``rank`` would get from a real launch,
from one process and without devices. What the graph computes here is wrong (the other ranks' shards never
arrive): it is for printing and inspecting the graph, never for running it.

torch registers the backend when ``torch.testing._internal.distributed.fake_pg`` is imported (torch 2.11 - 2.13
have no public module for it; ``torch.distributed`` itself imports ``FakeStore`` from there).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from .mesh import check_ranks

__all__ = ["FAKE_BACKEND", "fake_world"]

FAKE_BACKEND = "fake"


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[dist.ProcessGroup]:
    """Initialise the fake default process group with this process as ``rank`` of ``world_size``; yields the world
    group and destroys it (and every group made from it) on exit. Refuses when a process group already exists:
    a real one must not be replaced, and the passes would otherwise run over it."""
    check_ranks("fake_world(world_size)", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be one of 0..{world_size - 1} (the world has {world_size} ranks), got {rank!r}")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; a fake rank needs it")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this process; a fake world "
                           "replaces none: lower the passes over the existing group instead")
    from torch.testing._internal.distributed import fake_pg  # registers the "fake" backend

    dist.init_process_group(FAKE_BACKEND, store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
