"""The weights tensor parallelism shards, each held once (DESIGN.md §14).

:func:`shard_along` cuts rank ``r``'s shard of a weight: along ``dim`` the full extent is a concatenation of
segments (one for a q projection, three for a fused QKV, gate and value of a fused SwiGLU) and the shard is the
``r``-th chunk of each, concatenated; with ``padded`` sizes each segment is first zero-padded to its padded size
(an MLP hidden that does not divide by tp: zero rows of the up projection, zero columns of the down projection).

:class:`WeightShards` replaces a graph attribute by its shard through the weight ledger, once: a weight that
several linears read (CogView4's feed-forward, applied to the image and the text stream) is sharded the first
time and reused by the others when they shard it alike (same dim, same segments); readers that disagree, or any
other op reading a sharded weight, are refused with the readers named.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..infra.ownership import WeightLedger
from ..infra.pass_base import PassError, Refusal
from ..infra.weight_source import check_shape, source_name
from .propagate import segment_runs


class ShardingError(ValueError, Refusal):
    """A value cannot be sharded consistently (a view that mixes the sharded dim, an odd size)."""


def shard_pieces(segments: Sequence[int], rank: int, tp: int,
                 padded: Optional[Sequence[int]] = None) -> List[Tuple[int, int, int]]:
    """Rank ``rank``'s shard along the sharded dim as ``(start, length, zeros)`` pieces, in order: ``length``
    elements of the full tensor from ``start``, then ``zeros`` zero elements (padding past a segment's end)."""
    if padded is None or tuple(padded) == tuple(segments):
        return [(s, n, 0) for s, n in segment_runs(segments, tp, rank)]
    pieces, base = [], 0
    for real, size in zip(segments, padded):
        local = size // tp
        start = min(real, rank * local)
        n = min(real, start + local) - start
        pieces.append((base + start, n, local - n))
        base += real
    return pieces


def _assemble(read: Callable[[int, int], torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
              device: torch.device, dim: int, segments: Sequence[int], rank: int, tp: int,
              padded: Optional[Sequence[int]]) -> torch.Tensor:
    if sum(segments) != shape[dim]:
        raise ShardingError(f"segments {list(segments)} sum to {sum(segments)}, tensor has {shape[dim]} "
                            f"along dim {dim}")
    parts = []
    for start, n, zeros in shard_pieces(segments, rank, tp, padded):
        if n:
            parts.append(read(start, n))
        if zeros:
            parts.append(torch.zeros([*shape[:dim], zeros, *shape[dim + 1:]], dtype=dtype, device=device))
    if not parts:  # a rank whose pieces are all empty
        return torch.empty([*shape[:dim], 0, *shape[dim + 1:]], dtype=dtype, device=device)
    return torch.cat(parts, dim=dim).contiguous()


def shard_along(t: torch.Tensor, dim: int, segments: Sequence[int], rank: int, tp: int,
                padded: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank ``rank``'s shard of ``t`` along ``dim`` (see the module docstring), a new contiguous tensor;
    ``padded``: each segment taken as zero-padded to that size first (the zeros past its end)."""
    return _assemble(lambda s, n: t.narrow(dim, s, n), t.shape, t.dtype, t.device, dim, segments, rank, tp, padded)


def shard_from_source(source: Any, name: str, like: torch.Tensor, dim: int, segments: Sequence[int], rank: int,
                      tp: int, padded: Optional[Sequence[int]] = None) -> torch.Tensor:
    """:func:`shard_along` of checkpoint tensor ``name`` (shaped as ``like``, a stand-in: its dtype and device),
    reading only the rows / columns of this rank's shard from ``source`` (infra/weight_source.py)."""
    def read(start: int, n: int) -> torch.Tensor:
        return source.read_narrow(name, dim, start, n, dtype=like.dtype, device=like.device)
    return _assemble(read, like.shape, like.dtype, like.device, dim, segments, rank, tp, padded)


class WeightShards:
    """The sharded weights of one graph: attribute path -> ((dim, segments, padded segments), readers)."""

    def __init__(self, gm: fx.GraphModule, rank: int, tp: int, ledger: WeightLedger, owner: Any):
        self.gm, self.rank, self.tp = gm, rank, tp
        self.ledger, self.owner = ledger, owner  # where shards are recorded (infra/ownership.py), by whom
        self.shards: Dict[str, Tuple[tuple, set]] = {}

    def shard(self, attr_node: fx.Node, dim: int, spec, readers: Sequence[fx.Node]) -> None:
        """Make ``attr_node``'s weight rank ``rank``'s shard along ``dim`` as ``spec`` (a ShardSpec: its
        ``real_segments`` zero-padded to its ``segments``) for ``readers``; reuse it if sharded alike already."""
        path, how = attr_node.target, (dim, spec.real_segments, spec.segments)
        if path in self.shards:
            first, seen = self.shards[path]
            if first != how:
                raise PassError(f"tensor_parallel: parameter {path} is read by {sorted(u.name for u in seen)} "
                                f"sharded along dim {first[0]} in segments {list(first[1])} and by "
                                f"{[u.name for u in readers]} along dim {dim} in segments {list(spec.real_segments)}: "
                                f"a weight read by several linears is sharded once, so they must shard it alike")
            seen.update(readers)
            return
        token = (dim, tuple(spec.real_segments), self.rank, self.tp) + ((spec.segments,) if spec.padded else ())
        rec = self.ledger.released(self.gm, path)
        if rec is not None:  # lowering again after the full weight was released: the shard made then
            shard = self.ledger.reuse(rec, by=self.owner, token=token, like=attr_node.meta["val"])
        else:
            full = functools.reduce(getattr, path.split("."), self.gm)
            name = source_name(full)  # (before detach, which drops the mark)
            full = full.detach()
            if name is not None:  # built on the meta device: read this rank's slice of the checkpoint, nothing else
                check_shape(self.ledger.source, name, full.shape, f"tensor_parallel (module {path.rpartition('.')[0]}, rank {self.rank} of {self.tp})")
                full = shard_from_source(self.ledger.source, name, full, dim, spec.real_segments, self.rank,
                                         self.tp, spec.segments)
            else:
                full = shard_along(full, dim, spec.real_segments, self.rank, self.tp, spec.segments)
            shard = torch.nn.Parameter(full, requires_grad=False)
        # the graph's attribute becomes the shard; the ledger re-points the caller's model afterwards
        pad = f", zero-padded {list(spec.real_segments)} -> {list(spec.segments)}" if spec.padded else ""
        self.ledger.replace(self.gm, path, shard, by=self.owner, token=token,
                            how=f"sharded (rank {self.rank} of {self.tp}, dim {dim}{pad})")
        self.shards[path] = (how, set(readers))
        fake = attr_node.meta["val"].fake_mode.from_tensor(shard, static_shapes=True)
        for a in self.gm.graph.nodes:
            if a.op == "get_attr" and a.target == path:
                a.meta["val"] = fake

    def shared(self) -> int:
        """Sharded weights that more than one linear reads (each held once)."""
        return sum(len(readers) > 1 for _, readers in self.shards.values())

    def check_readers(self) -> None:
        """Refuse a sharded weight that something other than the linears sharding it reads (it would read the
        shard as if it were the whole weight)."""
        for a in self.gm.graph.nodes:
            if a.op == "get_attr" and a.target in self.shards:
                readers = self.shards[a.target][1]
                extra = [u for u in a.users if u not in readers]
                if extra:
                    raise PassError(f"tensor_parallel: parameter {a.target} is sharded for "
                                    f"{sorted(u.name for u in readers)} but also read whole by "
                                    f"{[f'{u.name} ({u.target})' for u in extra]}; a weight read by several ops is "
                                    f"sharded only when every reader is a linear sharding it alike")
