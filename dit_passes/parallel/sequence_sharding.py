"""Sequence sharding (Ulysses, Ring, USP): the rule table that finds which values of a captured DiT carry
the token dim, and what this rank's local graph computes.

A value is replicated (``None``) or :class:`Sharded` ``(dim, segments)``: for each segment
``(id, full_length)`` in order, this rank holds its ``even_shard_sizes(full_length, world)[rank]``
tokens. Flux's joint attention concatenates text and image, so the ranks' shards concatenate to a
*permutation* of the sequence, which attention does not see as long as q, k, v, rotary tables and
masks are permuted alike. From the residual streams entering block 0 (token dim 1), the shared rules
(:mod:`~dit_passes.parallel.propagate`: broadcasting, views, cuts at segment boundaries) apply; what
is specific here: SDPA with q, k, v sharded alike becomes the pass's distributed attention (a full
mask is permuted to the shards' order), q sharded over replicated k, v stays local SDPA; a known
non-local op gathers its sharded inputs and runs replicated; an op no rule knows raises a PassError
naming it; values leaving the block range are gathered back to the original order. :func:`analyze`
is pure; :mod:`dit_passes.parallel.sequence_rewrite` applies its plan.
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..analysis.structure import DiTStructure
from ..infra.pass_base import PassError
from . import op_classes as oc
from .propagate import Placement, Propagation, Touches, agree, aligned_dim, arg, is_tensor, map_args, moved_dim
from .propagate import resize_view, segment_cut, segment_runs, shape, val, view_dims

aten = torch.ops.aten
Segment = Tuple[str, int]  # (segment id, full length)


@dataclasses.dataclass(frozen=True)
class Sharded(Placement):
    dim: int
    segments: Tuple[Segment, ...]

    @property
    def full_length(self) -> int:
        return sum(n for _, n in self.segments)


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


class _NonLocal(Exception):
    """The op is known but cannot run on shards: gather its inputs, run it replicated."""


@dataclasses.dataclass
class AttentionDecision:
    node: fx.Node
    distributed: bool              # False: q sharded, k/v replicated (cross-attention): local SDPA
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


class _Analysis(Propagation):
    """The placements of the block range (``place``, the streams first) and the edits that make it local;
    inserts nothing (:mod:`~dit_passes.parallel.sequence_rewrite` does)."""

    def __init__(self, gm: fx.GraphModule, structure: DiTStructure, spec: SequenceShardSpec):
        super().__init__(gm, "", spec.world, spec.rank)
        self.s, self.spec = structure, spec
        nodes = list(gm.graph.nodes)
        lo, hi = nodes.index(structure.blocks[0].first), nodes.index(structure.blocks[-1].last)
        self.region = [n for n in nodes[lo:hi + 1] if n.op == "call_function"]
        self.edits: Dict[fx.Node, Tuple[Any, tuple, dict]] = {}
        self.attention: List[AttentionDecision] = []
        self.nonlocal_ops: List[Tuple[fx.Node, str]] = []

    def edit(self, n: fx.Node, args=None, kwargs=None, target=None) -> None:
        self.edits[n] = (target or n.target, n.args if args is None else tuple(args),
                         dict(n.kwargs) if kwargs is None else kwargs)

    # -- driver ------------------------------------------------------------------------------
    def run(self) -> ShardingPlan:
        for s in self.s.blocks[0].stream_inputs:
            v = val(s)
            if not isinstance(v, torch.Tensor) or v.dim() < 3:
                raise PassError(f"context parallel: residual stream '{s.name}' entering block 0 has shape "
                                f"{None if v is None else tuple(v.shape)}; expected [batch, tokens, features]")
            self.place[s] = Sharded(1, ((s.name, int(v.shape[1])),))
        streams = dict(self.place)

        def rule(n: fx.Node):
            try:
                return self.attend(n) if n.target is oc.SDPA else self.rule(n)
            except _NonLocal as why:
                return self.gather_inputs(n, str(why))
        self.walk(self.region, rule)
        layouts = {n: lay for n, lay in self.place.items() if n not in streams}
        region_set = set(self.region)
        exits = []
        for n in self.region:
            lay = layouts.get(n)
            outside = [u for u in n.users if u not in region_set]
            if outside and isinstance(lay, Sharded):
                exits.append(n)
            elif outside and isinstance(lay, list):
                raise PassError(f"context parallel: multi-output node '{n.name}' ({n.target}) is read after the "
                                f"block range by {[u.name for u in outside]}; cannot gather it")
        return ShardingPlan(self.spec, self.region, streams, layouts, self.edits, self.attention, self.nonlocal_ops,
                            exits)

    def gather_inputs(self, n: fx.Node, why: str):
        self.nonlocal_ops.append((n, why))

        def fix(a):
            lay = self.placed(a)
            if isinstance(lay, Sharded):
                return _Gather(a, lay)
            if isinstance(lay, list):
                raise PassError(f"context parallel: node '{n.name}' ({n.target}) needs the full value of "
                                f"multi-output node '{a.name}' ({why})")
            return a
        self.edit(n, map_args(n.args, fix), map_args(dict(n.kwargs), fix))
        return None

    def rule(self, n: fx.Node):
        t = n.target
        if t is operator.getitem:
            lay = self.placed(n.args[0])
            return lay[n.args[1]] if isinstance(lay, list) else None
        if t is aten._assert_tensor_metadata.default:  # export's dtype check (no Cleanup): drop any size check
            args = (n.args[0], None, None) + tuple(n.args[3:])
            self.edit(n, args[:len(n.args)], {k: v for k, v in n.kwargs.items() if k not in ("size", "stride")})
            return None
        if t in oc.MIXING:
            raise _NonLocal(f"{t} mixes tokens")
        if t in oc.COPIES or oc.is_pointwise(t):
            return self.pointwise(n)
        lay = self.placed(n.args[0])
        if t in oc.LIKE_ARG0 or t in oc.ELEMENTWISE_COLLECTIVES:
            return lay if isinstance(lay, Sharded) else None
        if t is oc.LINEAR and not isinstance(lay, Sharded):
            raise _NonLocal("linear over the token dim")
        handler = _HANDLERS.get(t)
        if handler is not None:
            return handler(self, n)
        if isinstance(lay, Sharded):
            try:
                out = lay.with_dim(moved_dim(n, lay.dim))
                return [out] * 3 if t is aten.native_layer_norm.default else out
            except Touches as why:
                raise _NonLocal(str(why).replace("sharded dim", "token dim")) from None
            except KeyError:
                pass
        path = n.meta.get("dit_module_path", "") or "<top level>"
        raise PassError(f"context parallel: no sequence-sharding rule for op {t} at node '{n.name}' (module "
                        f"{path}), which reads a token-sharded value: the analysis cannot prove the op local. "
                        f"Add a rule to dit_passes/parallel/sequence_sharding.py or report the model")

    # -- rules ---------------------------------------------------------------------------------
    def _agree(self, n):
        """(output dim, segments) every sharded input maps to; replicated full-length inputs sliced."""
        found = agree(n, lambda a: self.placed(a) if isinstance(self.placed(a), Sharded) else None, n.all_input_nodes,
                      _NonLocal)
        od, segs = found.dim, found.segments

        def fix(a):
            j = None if self.placed(a) is not None else aligned_dim(n, a, od)
            if j is None:
                return a
            if shape(a)[j] != found.full_length:
                raise _NonLocal(f"operand '{a.name}' has {shape(a)[j]} along the token dim, not {found.full_length}")
            return _Slice(a, j, segs)
        return od, segs, fix

    def pointwise(self, n):
        t = n.target
        if t._schema.is_mutable and not isinstance(self.placed(n.args[0]), Sharded):
            raise _NonLocal("in-place update of a replicated tensor from a sharded one")
        od, segs, fix = self._agree(n)
        self.edit(n, map_args(n.args, fix), map_args(dict(n.kwargs), fix))
        return Sharded(od, segs)

    def slice_scatter(self, n):
        """``slice_scatter(self, src, dim, ...)`` off the token dim: elementwise in the token dim."""
        lay = self.placed(n.args[0])
        d = arg(n, 2, "dim", 0) % val(n).dim()
        if not isinstance(lay, Sharded) or d == lay.dim:
            raise _NonLocal("slice_scatter into the token dim or into a replicated tensor")
        return self.pointwise(n)

    def reshape(self, n):
        x = n.args[0]
        lay, ins, outs = self.placed(x), shape(x), shape(n)
        j = next((e for e, _ in view_dims(ins, outs, lay.dim, [0]) if outs[e] == ins[lay.dim]), None)
        if j is None:
            raise _NonLocal(f"reshape {ins} -> {outs} merges or splits the token dim")
        new = resize_view(n, j, self.spec.local_length(lay.segments))
        if new is not None:
            self.edit(n, new)
        elif n.target is aten.squeeze.default:  # a local length of 1 must not be squeezed away
            self.edit(n, (x, [d for d, s in enumerate(ins) if s == 1]), target=aten.squeeze.dims)
        return Sharded(j, lay.segments)

    def expand(self, n):
        x, lay = n.args[0], self.placed(n.args[0])
        j = lay.dim + len(n.args[1]) - val(x).dim()
        new = resize_view(n, j, self.spec.local_length(lay.segments))
        if new is not None:
            self.edit(n, new)
        return Sharded(j, lay.segments)

    @staticmethod
    def _segment_cut(lay: Sharded, cuts: Sequence[int], what: str) -> List[int]:
        """Indices into the segment boundaries for full-axis cut points (must all be boundaries)."""
        idx = segment_cut([m for _, m in lay.segments], cuts)
        if idx is None:
            raise _NonLocal(f"{what} cuts the token dim at {list(cuts)}, not at segment boundaries {lay.segments}")
        return idx

    def slice(self, n):
        x = n.args[0]
        lay, nd = self.placed(x), val(x).dim()
        d = arg(n, 1, "dim", 0) % nd
        if d != lay.dim:
            return lay
        if n.target is aten.narrow.default:
            start, end, step = n.args[2], n.args[2] + n.args[3], 1
        else:
            start, end, step = arg(n, 2, "start", None), arg(n, 3, "end", None), arg(n, 4, "step", 1)
        if step != 1:
            raise _NonLocal(f"strided slice (step {step}) of the token dim")
        start, end, _ = slice(start, end).indices(lay.full_length)  # None, negative, out of range: as the op reads them
        a, b = self._segment_cut(lay, [start, max(start, end)], "slice")
        if a == b:
            raise _NonLocal("empty slice of the token dim")
        lb = self.spec.local_boundaries(lay.segments)
        self.edit(n, (x, d, lb[a], lb[b], 1), {}, target=aten.slice.Tensor)
        return Sharded(d, lay.segments[a:b])

    def split(self, n):
        x = n.args[0]
        lay, nd = self.placed(x), val(x).dim()
        t = n.target
        d = arg(n, 1 if t is aten.unbind.int else 2, "dim", 0) % nd
        pieces = list(val(n))
        if d != lay.dim:
            return [Sharded(lay.dim - (t is aten.unbind.int and d < lay.dim), lay.segments)] * len(pieces)
        if t is aten.unbind.int:
            raise _NonLocal("unbind of the token dim")
        idx = self._segment_cut(lay, list(itertools.accumulate((int(p.shape[d]) for p in pieces), initial=0)), "split")
        if any(i == j for i, j in zip(idx, idx[1:])):
            raise _NonLocal("split with an empty token piece")
        lb = self.spec.local_boundaries(lay.segments)
        self.edit(n, (x, [lb[j] - lb[i] for i, j in zip(idx, idx[1:])], d), {}, target=aten.split_with_sizes.default)
        return [Sharded(d, lay.segments[i:j]) for i, j in zip(idx, idx[1:])]

    def cat(self, n):
        """cat / stack: along the token dim each piece adds its segments (a replicated piece is one);
        otherwise the pieces agree like a pointwise op's operands (stack's new dim ``d`` is not broadcast's)."""
        tensors = [a for a in n.args[0] if not (is_tensor(a) and val(a).dim() == 1 and shape(a)[0] == 0)]
        d, stack = arg(n, 1, "dim", 0) % val(n).dim(), n.target is aten.stack.default
        lays = [self.placed(a) for a in tensors]
        if stack or not any(isinstance(lay, Sharded) and lay.dim == d for lay in lays):
            od, segs, fix = self._agree(n)
            self.edit(n, (map_args(list(n.args[0]), fix),) + tuple(n.args[1:]))
            return Sharded(od - (stack and d >= od), segs)
        new, segs = [], ()
        for a, lay in zip(tensors, lays):
            if lay is None:  # a replicated piece joins as a segment of its own
                lay = Sharded(d, ((a.name, shape(a)[d]),))
                new.append(_Slice(a, d, lay.segments))
            elif lay.dim != d:
                raise _NonLocal("cat of pieces sharded on different dims")
            else:
                new.append(a)
            segs += lay.segments
        self.edit(n, (new, d))
        return Sharded(d, segs)

    def attend(self, n):
        q, k, v = n.args[:3]
        mask = arg(n, 3, "attn_mask", None)
        if arg(n, 4, "dropout_p", 0.0) or arg(n, 5, "is_causal", False) or n.kwargs.get("enable_gqa", False):
            raise _NonLocal("attention with dropout, is_causal or enable_gqa")
        lq, lk, lv = self.placed(q), self.placed(k), self.placed(v)
        if not (isinstance(lq, Sharded) and lq.dim == 2 and val(q).dim() == 4):
            raise _NonLocal("attention whose queries are not sharded on the sequence dim")
        full = lq.full_length
        mlay = self.placed(mask)
        if isinstance(mlay, Sharded):
            raise _NonLocal("attention with a token-sharded mask")
        if lk is None and lv is None:  # cross-attention: full keys/values on every rank
            if mask is not None and val(mask).dim() >= 2 and shape(mask)[-2] == full:
                mask = _Slice(mask, val(mask).dim() - 2, lq.segments)
            self.attention.append(AttentionDecision(n, False, q, k, v, mask, n.kwargs.get("scale"), lq))
            return lq
        if lk != lq or lv != lq:
            raise _NonLocal(f"attention with q/k/v sharded differently ({lq}, {lk}, {lv})")
        lengths = self.spec.rank_lengths(lq.segments)
        if min(lengths) < 1:
            raise PassError(f"context parallel: attention '{n.name}' has {full} tokens ({lq.segments}), too few "
                            f"for {self.spec.world} ranks (shards {lengths}); use fewer ranks")
        if mask is not None:
            mshape = shape(mask)
            if len(mshape) < 1 or mshape[-1] != full:
                raise _NonLocal(f"attention mask {mshape} does not span the {full} keys")
            nd = len(mshape)
            dims = tuple(d for d in (nd - 2, nd - 1) if d >= 0 and mshape[d] == full)
            if len(lq.segments) > 1 or self.spec.world > 1:
                mask = _Permute(mask, dims, lq.segments)
        stride = val(n).stride()
        order = tuple(sorted(range(len(stride)), key=lambda d: (-stride[d], d)))
        self.attention.append(AttentionDecision(n, True, q, k, v, mask, n.kwargs.get("scale"), lq, order))
        return lq


_HANDLERS = {**{t: _Analysis.reshape for t in oc.RESHAPES | oc.COMPLEX_VIEWS},
             **{t: _Analysis.split for t in oc.SPLITS | {aten.unbind.int}},
             aten.expand.default: _Analysis.expand, aten.slice.Tensor: _Analysis.slice,
             aten.narrow.default: _Analysis.slice, aten.cat.default: _Analysis.cat, aten.stack.default: _Analysis.cat,
             aten.slice_scatter.default: _Analysis.slice_scatter}


def analyze(gm: fx.GraphModule, structure: DiTStructure, spec: SequenceShardSpec) -> ShardingPlan:
    """Layouts and edits for this rank (pure: the graph is not modified)."""
    return _Analysis(gm, structure, spec).run()
