"""Collectives of the parallel attention functions and passes: functional collectives (``funcol``:
traced by Dynamo / export as ``_c10d_functional.*`` ops, counted by ``CommDebugMode``) and
:func:`ring_exchange`, point-to-point, wrapped as the custom op ``dit_passes::ring_exchange`` (one
opaque node with a fake kernel). Each takes an optional eager-only :class:`CollectiveCounter`; inside
``torch.compile`` pass ``None`` and count graph ops instead. Graph-inserted ops name their group and
resolve it at call time (:func:`resolve_group`).
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["CollectiveCounter", "all_gather", "all_reduce", "all_to_all_single", "ring_exchange"]


class CollectiveCounter:
    """Counts collective calls by kind: ``"all_to_all"``, ``"all_gather"``, ``"all_reduce"``,
    ``"ring_exchange"`` (one per :func:`ring_exchange` call, however many tensors it moves).

    ``counter["all_to_all"]`` reads a count (0 if never called); ``counter.counts`` is the dict.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, kind: str, n: int = 1) -> None:
        self.counts[kind] += n

    def __getitem__(self, kind: str) -> int:
        return self.counts[kind]

    def __repr__(self) -> str:
        return f"CollectiveCounter({dict(self.counts)})"


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group a graph-inserted op names (``group.group_name``)."""
    return dist.distributed_c10d._resolve_process_group(name)


def _count(counter: CollectiveCounter | None, kind: str) -> None:
    if counter is not None:
        counter.add(kind)


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Eager funcol returns an AsyncCollectiveTensor that waits lazily on first use; waiting here
    # keeps the subclass out of callers (custom ops and slicing code get plain tensors). Under
    # tracing funcol already returns a plain tensor (the wait is a graph node).
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


# torch >= 2.13 names it all_gather_single (all_gather_tensor warns as deprecated); 2.11 has only
# all_gather_tensor. Same semantics.
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_to_all_single(x: torch.Tensor, output_split_sizes: Sequence[int] | None,
                      input_split_sizes: Sequence[int] | None, group: dist.ProcessGroup, *,
                      counter: CollectiveCounter | None = None) -> torch.Tensor:
    """Split ``x`` along dim 0 by ``input_split_sizes`` (rank order), send chunk j to rank j,
    return the received chunks concatenated along dim 0 (``output_split_sizes[j]`` rows from rank
    j). ``None`` for both means equal splits. Uneven splits allowed; sizes must be static ints."""
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("all_to_all_single: give both output_split_sizes and input_split_sizes, or neither "
                         f"(got output={output_split_sizes!r}, input={input_split_sizes!r})")
    world = group.size()
    if input_split_sizes is not None:
        if len(input_split_sizes) != world or len(output_split_sizes) != world:
            raise ValueError(f"all_to_all_single: split sizes need one entry per rank of the group ({world}), "
                             f"got input={list(input_split_sizes)}, output={list(output_split_sizes)}")
        if sum(input_split_sizes) != x.shape[0]:
            raise ValueError(f"all_to_all_single: input_split_sizes {list(input_split_sizes)} sum to "
                             f"{sum(input_split_sizes)}, but x has {x.shape[0]} rows along dim 0")
        input_split_sizes = list(input_split_sizes)
        output_split_sizes = list(output_split_sizes)
    _count(counter, "all_to_all")
    return _wait(funcol.all_to_all_single(x.contiguous(), output_split_sizes, input_split_sizes, group))


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, sizes: Sequence[int] | None = None, *,
               counter: CollectiveCounter | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    ``sizes`` (one per rank, static) gives each rank's extent along ``dim`` when they differ: the
    shards are padded to the largest, gathered with one collective, and the padding is sliced off.
    ``None`` means every rank holds ``x.shape[dim]``. Other dims must agree across ranks.
    """
    dim = dim % x.dim()
    world = group.size()
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != world:
            raise ValueError(f"all_gather: sizes {sizes} need one entry per rank of the group ({world})")
        rank = group.rank()
        if x.shape[dim] != sizes[rank]:
            raise ValueError(f"all_gather: rank {rank} holds {x.shape[dim]} along dim {dim}, but sizes[{rank}] = "
                             f"{sizes[rank]} (sizes={sizes})")
    _count(counter, "all_gather")
    if sizes is None or min(sizes) == max(sizes):
        return _wait(_funcol_all_gather(x.contiguous(), dim, group))
    biggest = max(sizes)
    if biggest > x.shape[dim]:
        # cat with zeros rather than F.pad: works for every dtype, bool masks included.
        filler_shape = list(x.shape)
        filler_shape[dim] = biggest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(filler_shape)], dim=dim)
    gathered = _wait(_funcol_all_gather(x.contiguous(), dim, group))
    return torch.cat([gathered.narrow(dim, j * biggest, sizes[j]) for j in range(world)], dim=dim)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum", *, counter: CollectiveCounter | None = None) -> torch.Tensor:
    """Elementwise reduction of ``x`` over the group; ``op`` is ``"sum"`` or ``"avg"``.

    ``"avg"`` is a sum divided by the group size (gloo has no native average)."""
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'avg', got {op!r}")
    _count(counter, "all_reduce")
    total = _wait(funcol.all_reduce(x.contiguous(), "sum", group))
    return total / group.size() if op == "avg" else total


# --- point to point -------------------------------------------------------------------------------


@torch.library.custom_op("dit_passes::ring_exchange", mutates_args=())
def _ring_exchange_op(tensors: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """Send each tensor to the next rank of the group and return those received from the previous
    one (same shapes). All sends/receives of one call go in one ``batch_isend_irecv``."""
    group = resolve_group(group_name)
    world = group.size()
    rank = group.rank()
    send_to = dist.get_global_rank(group, (rank + 1) % world)
    recv_from = dist.get_global_rank(group, (rank - 1) % world)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = []
    for out, t in zip(received, tensors):
        ops.append(dist.P2POp(dist.isend, t.contiguous(), send_to, group))
        ops.append(dist.P2POp(dist.irecv, out, recv_from, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


@_ring_exchange_op.register_fake
def _(tensors, group_name):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]


def ring_exchange(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, *,
                  counter: CollectiveCounter | None = None) -> list[torch.Tensor]:
    """Ring shift: send each tensor to rank ``(r + 1) % world`` of ``group`` and return the
    tensors received from rank ``(r - 1) % world`` (same shapes and dtypes on every rank).

    One call is one ``batch_isend_irecv`` (counted once) whatever the number of tensors. Not a
    functional collective: see the module docstring for how it stays traceable.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("ring_exchange needs at least one tensor")
    _count(counter, "ring_exchange")
    if group.size() == 1:
        return [t.clone() for t in tensors]
    return _ring_exchange_op(tensors, group.group_name)
