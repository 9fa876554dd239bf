"""The data of sequence sharding: placements (:class:`Sharded`), the static shard arithmetic
(:class:`SequenceShardSpec`), the markers the rules put into rewritten arguments, and the
:class:`ShardingPlan` that :mod:`~dit_passes.parallel.sequence_sharding` computes and
:mod:`~dit_passes.parallel.sequence_rewrite` applies.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from .propagate import Placement, segment_runs

Segment = Tuple[str, int]  # (segment id, full length)


@dataclasses.dataclass(frozen=True, eq=False)
class Sharded(Placement):
    """Equal placements hold the same positions on every rank: same dim and segment lengths (the ids only
    name the segments: two streams of equal length are sharded alike, whatever they are called)."""
    dim: int
    segments: Tuple[Segment, ...]

    @property
    def full_length(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def lengths(self) -> Tuple[int, ...]:
        return tuple(n for _, n in self.segments)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sharded) and (self.dim, self.lengths) == (other.dim, other.lengths)

    def __hash__(self) -> int:
        return hash((self.dim, self.lengths))


@dataclasses.dataclass(frozen=True)
class SequenceShardSpec:
    """Static shard arithmetic for ``world`` ranks, seen from ``rank`` (:func:`~propagate.segment_runs`)."""

    world: int
    rank: int

    def rank_lengths(self, segments: Sequence[Segment]) -> Tuple[int, ...]:
        return tuple(sum(n for _, n in self._runs(segments, r)) for r in range(self.world))

    def local_length(self, segments: Sequence[Segment]) -> int:
        return self.rank_lengths(segments)[self.rank]

    def local_boundaries(self, segments: Sequence[Segment]) -> List[int]:
        """Where each segment starts in this rank's shard, then the shard's length."""
        return list(itertools.accumulate((n for _, n in self._runs(segments, self.rank)), initial=0))

    def _runs(self, segments: Sequence[Segment], rank: int) -> List[Tuple[int, int]]:
        return segment_runs([n for _, n in segments], self.world, rank)

    def local_runs(self, segments: Sequence[Segment], rank: Optional[int] = None) -> List[Tuple[int, int]]:
        """(start, length) runs of the full axis that ``rank`` (default: this one) holds, in order."""
        return _merge(self._runs(segments, self.rank if rank is None else rank))

    def permutation_runs(self, segments: Sequence[Segment]) -> List[Tuple[int, int]]:
        """Runs of the full axis in the order the ranks' shards concatenate to (rank 0 first)."""
        return _merge([run for r in range(self.world) for run in self.local_runs(segments, r)])

    def inverse_runs(self, segments: Sequence[Segment]) -> List[Tuple[int, int]]:
        """Runs of the gathered (rank-ordered) axis that restore the original order; [] if identity."""
        at, landed = 0, []  # (start on the full axis, start on the gathered axis, length)
        for start, n in self.permutation_runs(segments):
            landed.append((start, at, n))
            at += n
        runs = _merge([(g, n) for _, g, n in sorted(landed)])
        return [] if len(runs) == 1 else runs


def _merge(runs: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for s, n in runs:
        if n > 0 and out and out[-1][0] + out[-1][1] == s:  # continues the last run
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n > 0:
            out.append((s, n))
    return out


# --- markers the rules put into rewritten arguments (materialised by the rewrite) -------------------

@dataclasses.dataclass(frozen=True)
class _Slice:      # replicated value -> this rank's runs along dim
    node: fx.Node
    dim: int
    segments: Tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class _Permute:    # replicated full value -> the shards' order along dims (masks)
    node: fx.Node
    dims: Tuple[int, ...]
    segments: Tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class _Gather:     # sharded value -> full value, original order
    node: fx.Node
    layout: Sharded


@dataclasses.dataclass
class AttentionDecision:
    node: fx.Node
    distributed: bool              # False: local SDPA of this rank's queries over full (replicated or gathered) k / v
    q: Any
    k: Any
    v: Any
    mask: Any
    scale: Optional[float]
    layout: Sharded
    out_order: Tuple[int, ...] = (0, 1, 2, 3)  # memory order of SDPA's output (outermost first)


@dataclasses.dataclass
class ShardingPlan:
    spec: SequenceShardSpec
    region: List[fx.Node]
    streams: Dict[fx.Node, Sharded]
    layouts: Dict[fx.Node, Any]
    edits: Dict[fx.Node, Tuple[Any, tuple, dict]]
    attention: List[AttentionDecision]
    nonlocal_ops: List[Tuple[fx.Node, str]]
    exits: List[fx.Node]
    reduced: List[fx.Node] = dataclasses.field(default_factory=list)  # partial sums: all-reduced after the node
    # context-wrapper calls (autocast regions) -> (this rank's copy of the body, the body's plan)
    bodies: Dict[fx.Node, Tuple[fx.GraphModule, "ShardingPlan"]] = dataclasses.field(default_factory=dict)
    # streams of a later block list sharded where it starts: stream -> (first node of that list, layout)
    late_streams: Dict[fx.Node, Tuple[fx.Node, Sharded]] = dataclasses.field(default_factory=dict)

    @property
    def distributed_attention(self) -> int:
        return (sum(d.distributed for d in self.attention)
                + sum(p.distributed_attention for _, p in self.bodies.values()))

    def all_nonlocal_ops(self) -> List[Tuple[fx.Node, str]]:
        """The non-local ops of the region and of its context regions' bodies."""
        return self.nonlocal_ops + [op for _, p in self.bodies.values() for op in p.all_nonlocal_ops()]
