"""Sequence sharding (Ulysses, Ring, USP): the rule table that finds which values of a captured DiT carry
the token dim, and what this rank's local graph computes.

A value is replicated (``None``) or :class:`Sharded` ``(dim, segments)``: for each segment
``(id, full_length)`` in order, this rank holds its ``even_shard_sizes(full_length, world)[rank]``
tokens. Flux's joint attention concatenates text and image, so the ranks' shards concatenate to a
*permutation* of the sequence, which attention does not see as long as q, k, v, rotary tables and
masks are permuted alike. From the residual streams entering block 0 (token dim 1, or 0 for a
sequence-first model; a stream shorter than the group stays replicated) and those entering a later block
list's first block, the shared rules (:mod:`~dit_passes.parallel.propagate`: broadcasting, views, cuts at
segment boundaries) apply; what is specific here: SDPA with q, k, v sharded alike becomes the pass's
distributed attention (a full mask is permuted to the shards' order), q sharded over other keys stays local
SDPA over the full (gathered) keys; a sum or matmul contracting the tokens is a partial sum all-reduced once;
a context region (autocast) is analysed as a region of its own; a known non-local op gathers its sharded
inputs and runs replicated; an op no rule knows raises a PassError naming it; values leaving the block range
are gathered back to the original order. :func:`analyze` is pure (the data it returns:
:mod:`~dit_passes.parallel.sequence_plan`); :mod:`dit_passes.parallel.sequence_rewrite` applies its plan.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..analysis.structure import DiTStructure
from ..infra.pass_base import PassError
from . import op_classes as oc
from .propagate import Propagation, Touches, agree, aligned_dim, arg, is_tensor, map_args, moved_dim, reduction_dims
from .propagate import resize_view, segment_cut, shape, val, view_dims
from .sequence_plan import AttentionDecision, SequenceShardSpec, Sharded, ShardingPlan, _Gather, _Permute, _Slice
from .sequence_streams import entering_streams

__all__ = ["AttentionDecision", "SequenceShardSpec", "Sharded", "ShardingPlan", "analyze"]

aten = torch.ops.aten


class _NonLocal(Exception):
    """The op is known but cannot run on shards: gather its inputs, run it replicated."""


class _Analysis(Propagation):
    """The placements of one region (``place``: the values placed before the walk first) and the edits that
    make it local; inserts nothing (:mod:`~dit_passes.parallel.sequence_rewrite` does)."""

    def __init__(self, gm: fx.GraphModule, region: List[fx.Node], spec: SequenceShardSpec):
        super().__init__(gm, "", spec.world, spec.rank)
        self.spec, self.region = spec, region
        self.edits: Dict[fx.Node, Tuple[Any, tuple, dict]] = {}
        self.attention: List[AttentionDecision] = []
        self.nonlocal_ops: List[Tuple[fx.Node, str]] = []
        self.reduced: List[fx.Node] = []
        self.bodies: Dict[fx.Node, Tuple[fx.GraphModule, ShardingPlan]] = {}
        self.late_streams: Dict[fx.Node, Tuple[fx.Node, Sharded]] = {}

    def edit(self, n: fx.Node, args=None, kwargs=None, target=None) -> None:
        self.edits[n] = (target or n.target, n.args if args is None else tuple(args),
                         dict(n.kwargs) if kwargs is None else kwargs)

    # -- driver ------------------------------------------------------------------------------
    def run(self, streams: Dict[fx.Node, Sharded], exits: bool = True,
            late: Optional[Dict[fx.Node, Dict[fx.Node, Sharded]]] = None) -> ShardingPlan:
        """Walk the region from the placed ``streams``; ``exits``: gather the sharded values read after it.
        ``late``: region node -> streams sharded from there on if still replicated when the walk reaches it
        (the streams of a later block list computed beside the earlier one: its users before that node read
        it whole, those after read the shard)."""
        self.place.update(streams)
        late, started = late or {}, {}

        def rule(n: fx.Node):
            try:
                return self.attend(n) if n.target is oc.SDPA else self.rule(n)
            except _NonLocal as why:
                return self.gather_inputs(n, str(why))
        for n in self.region:
            for s, lay in late.get(n, {}).items():
                if self.placed(s) is None:
                    self.place[s] = started[s] = lay
                    self.late_streams[s] = (n, lay)
            self.walk([n], rule)
        layouts = {n: lay for n, lay in self.place.items() if n not in streams and n not in started}
        region_set, leaving = set(self.region), []
        for n in self.region if exits else ():
            lay = layouts.get(n)
            outside = [u for u in n.users if u not in region_set]
            if outside and isinstance(lay, Sharded):
                leaving.append(n)
            elif outside and isinstance(lay, list):
                raise PassError(f"context parallel: multi-output node '{n.name}' ({n.target}) is read after the "
                                f"block range by {[u.name for u in outside]}; cannot gather it")
        return ShardingPlan(self.spec, self.region, dict(streams), layouts, self.edits, self.attention,
                            self.nonlocal_ops, leaving, self.reduced, self.bodies, self.late_streams)

    def gather_inputs(self, n: fx.Node, why: str):
        t = n.target
        mutable = isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable
        if mutable and isinstance(self.placed(n.args[0]), Sharded):
            raise PassError(f"context parallel: in-place op {t} at node '{n.name}' updates a token-sharded tensor "
                            f"but cannot run on shards ({why}): it would update a gathered copy. Report the model")
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
        if t is oc.OPAQUE_MODULE:  # run on the whole sequence, as eagerly: correct whatever the module computes
            raise _NonLocal("an opaque module (captured as one eager call): nothing proves it acts token by token")
        if t is oc.FLEX_ATTENTION:  # a shard's rows would need the mask and score functions re-indexed
            raise _NonLocal("flex attention: its block mask and score / mask functions index global positions")
        if t in oc.NEW_TENSORS:  # a constant of the full size (argument 0 lends only a dtype): replicated
            return None
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
        j = self._view_dim(n, lay.dim, ins, outs)
        new = resize_view(n, j, self.spec.local_length(lay.segments))
        if new is not None:
            self.edit(n, new)
        elif n.target is aten.squeeze.default:  # a local length of 1 must not be squeezed away
            self.edit(n, (x, [d for d, s in enumerate(ins) if s == 1]), target=aten.squeeze.dims)
        return Sharded(j, lay.segments)

    @staticmethod
    def _view_dim(n: fx.Node, dim: int, ins: Tuple[int, ...], outs: Tuple[int, ...]) -> int:
        """Where the token dim ``dim`` of ``ins`` is in the view's output ``outs``. A dim of 1 token next to other
        dims of 1 is ambiguous in sizes alone: (un)squeezes say which dims they add or drop; a view must keep the
        sizes before or after the token dim as they were, else it is not proven (and so not local)."""
        t = n.target
        if t in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            dropped = ([d for d in {d % len(ins) for d in n.args[1]} if ins[d] == 1] if t is aten.squeeze.dims else
                       [d for d, s in enumerate(ins) if s == 1] if t is aten.squeeze.default else None)
            if dropped is None:
                try:
                    return moved_dim(n, dim)
                except Touches:
                    raise _NonLocal("squeeze of the token dim") from None
            if dim in dropped:
                raise _NonLocal("squeeze of the token dim")
            return dim - sum(d < dim for d in dropped)
        found = [e for e, _ in view_dims(ins, outs, dim, [0]) if outs[e] == ins[dim]]
        if len(found) > 1:  # only a token dim of 1 has neighbours of its size here
            found = [e for e in found if outs[:e] == ins[:dim] or outs[e + 1:] == ins[dim + 1:]]
        if len(found) != 1:
            raise _NonLocal(f"reshape {ins} -> {outs} merges or splits the token dim"
                            if not found else f"reshape {ins} -> {outs} of a one-token dim is ambiguous")
        return found[0]

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
        if end <= start:  # an empty slice (the tail past a rotated prefix): the same empty value on every rank
            self.edit(n, (x, d, 0, 0, 1), {}, target=aten.slice.Tensor)
            return None
        a, b = self._segment_cut(lay, [start, end], "slice")
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
            if lay is None and shape(a)[d] == 0:  # an empty piece adds no tokens (the same on every rank)
                new.append(a)
                continue
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

    def pad(self, n):
        """``pad`` / ``constant_pad_nd`` leaving the token dim unpadded: each token's row is padded on its own
        (any mode reads only along the padded dims), so the shard pads exactly as the full value would."""
        lay, nd = self.placed(n.args[0]), val(n.args[0]).dim()
        pads = list(n.args[1])
        k = nd - 1 - lay.dim  # pad pairs run from the last dim
        if 2 * k < len(pads) and (pads[2 * k] or pads[2 * k + 1]):
            raise _NonLocal("pad of the token dim")
        return lay

    def sum_tokens(self, n):
        """``sum`` over dims that include the token dim: this rank's partial sum, then one all-reduce (sum)
        over the group (the plan's ``reduced``). Exact: the tokens are split into disjoint shards, so the
        partial sums add up to the full sum (fp32 reassociation only)."""
        lay = self.placed(n.args[0])
        dims, _ = reduction_dims(n)
        if lay.dim not in dims:
            return lay.with_dim(moved_dim(n, lay.dim))
        self.reduced.append(n)
        return None

    def matmul(self, n):
        """``matmul`` / ``bmm`` (both operands at least 2-D). The token dim as a row of ``a``, a column of ``b`` or
        a batch dim stays where it is in the output (each output element reads one row of ``a`` and one column of
        ``b``: local; a replicated operand with the full token length on an aligned batch dim is sliced alike).
        As the contracted dim (linear attention: ``v^T k`` over the tokens) both operands must carry the same
        tokens (a replicated one is sliced): this rank's product is a partial sum, all-reduced once (the plan's
        ``reduced``), exact as :meth:`sum_tokens` is."""
        a, b = n.args[:2]
        if val(a).dim() < 2 or val(b).dim() < 2:
            raise _NonLocal("matmul with a vector operand")
        la, lb = self.placed(a), self.placed(b)
        na, nb, no = val(a).dim(), val(b).dim(), val(n).dim()
        if (la is not None and la.dim == na - 1) or (lb is not None and lb.dim == nb - 2):
            ref = la if la is not None and la.dim == na - 1 else lb
            operands = (self._contracted(a, la, na - 1, ref), self._contracted(b, lb, nb - 2, ref))
            self.edit(n, operands + tuple(n.args[2:]))
            self.reduced.append(n)
            return None
        out = {lay.with_dim(lay.dim + no - nx) for lay, nx in ((la, na), (lb, nb)) if lay is not None}
        if len(out) != 1:
            raise _NonLocal(f"matmul operands sharded on unrelated dims ({la}, {lb})")
        (lay,) = out
        new = []
        for x, lx, nx in ((a, la, na), (b, lb, nb)):
            j = lay.dim - no + nx  # the dim of x aligned with the output's token dim (batch dims only)
            if lx is None and 0 <= j < nx - 2 and shape(x)[j] != 1:
                if shape(x)[j] != lay.full_length:
                    raise _NonLocal(f"matmul operand '{x.name}' has {shape(x)[j]} along the token dim")
                x = _Slice(x, j, lay.segments)
            new.append(x)
        self.edit(n, tuple(new) + tuple(n.args[2:]))
        return lay

    @staticmethod
    def _contracted(x, lay, d: int, ref: Sharded):
        if lay is not None:
            if lay != ref.with_dim(d):
                raise _NonLocal(f"matmul contracts operands sharded differently ({lay} vs {ref})")
            return x
        if shape(x)[d] != ref.full_length:
            raise _NonLocal(f"matmul contracts {ref.full_length} tokens with {shape(x)[d]}")
        return _Slice(x, d, ref.segments)

    def context_region(self, n):
        """A context wrapper (``wrap_with_autocast``, ``wrap_with_set_grad_enabled``) calls its body graph under a
        context that changes no shape: the body is analysed as a region of its own with its operands'
        placements (this rank's copy of it, rewritten like the block range: :class:`ShardingPlan` ``bodies``),
        and the call's outputs take the placements of the body's outputs. Exact as the body's rules are."""
        at = oc.CONTEXT_WRAPPERS[n.target]
        body = _copy_body(operator.attrgetter(n.args[at].target)(self.gm))
        inner = [p for p in body.graph.nodes if p.op == "placeholder"]
        entering = {}
        for p, a in zip(inner, n.args[at + 1:]):
            lay = self.placed(a)
            if isinstance(lay, list):
                raise _NonLocal("context region over a multi-output value")
            if lay is not None:
                entering[p] = lay
        sub = _Analysis(body, [c for c in body.graph.nodes if c.op == "call_function"], self.spec)
        plan = sub.run(entering, exits=False)
        (out,) = [c for c in body.graph.nodes if c.op == "output"]
        if not isinstance(out.args[0], (list, tuple)):
            raise _NonLocal("context region whose body does not return a tuple")
        leaving = [sub.placed(o) for o in out.args[0]]
        if any(isinstance(lay, list) for lay in leaving):
            raise _NonLocal("context region returning a multi-output value")
        self.bodies[n] = (body, plan)
        return leaving

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
        lead = shape(q)[:2]
        if shape(n)[:2] != lead or any(val(x).dim() != 4 or shape(x)[d] not in (1, lead[d]) for x in (k, v)
                                       for d in (0, 1)):
            raise _NonLocal("attention broadcasting the queries over the keys' batch or heads")
        if lk != lq or lv != lq:
            # cross-attention (full keys / values on every rank), or keys sharded unlike the queries (PRX: the
            # queries are the image, the keys text + image): each query row attends to the full keys, so this
            # rank's rows are SDPA of its queries over the gathered keys / values (original order, which the
            # mask's key dim follows). Exact: softmax rows are independent of the other queries.
            if isinstance(lk, list) or isinstance(lv, list):
                raise _NonLocal("attention over multi-output keys / values")
            k, v = (_Gather(x, lay) if isinstance(lay, Sharded) else x for x, lay in ((k, lk), (v, lv)))
            if mask is not None and val(mask).dim() >= 2 and shape(mask)[-2] == full:
                mask = _Slice(mask, val(mask).dim() - 2, lq.segments)
            self.attention.append(AttentionDecision(n, False, q, k, v, mask, n.kwargs.get("scale"), lq))
            return lq
        lengths = self.spec.rank_lengths(lq.segments)
        if min(lengths) < 1:  # the distributed attentions need a token on every rank: run this one whole
            raise _NonLocal(f"attention over {full} tokens, fewer than a token per rank (shards {lengths})")
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
             aten.slice_scatter.default: _Analysis.slice_scatter, aten.sum.dim_IntList: _Analysis.sum_tokens,
             **{t: _Analysis.pad for t in oc.PADS}, **{t: _Analysis.matmul for t in oc.MATMULS},
             **{t: _Analysis.context_region for t in oc.CONTEXT_WRAPPERS}}


def _copy_body(body: fx.GraphModule) -> fx.GraphModule:
    """A copy of a higher-order op's body graph (nodes and meta; same attributes), for one rank's rewrite."""
    g = fx.Graph()
    g.output(g.graph_copy(body.graph, {}))
    return fx.GraphModule(body, g)


def analyze(gm: fx.GraphModule, structure: DiTStructure, spec: SequenceShardSpec) -> ShardingPlan:
    """Layouts and edits for this rank (pure: the graph is not modified).

    The streams' token dim is dim 1 ([batch, tokens, features]), unless sharding dim 1 leaves every attention
    undistributed (or is refused) while dim 0 distributes some: a sequence-first stream ([tokens, batch,
    features], ERNIE-Image) whose dim 1 is the batch."""
    nodes = list(gm.graph.nodes)
    lo, hi = nodes.index(structure.blocks[0].first), nodes.index(structure.blocks[-1].last)
    region = [n for n in nodes[lo:hi + 1] if n.op == "call_function"]
    tried: List[Any] = []
    for token_dim in (1, 0):
        try:
            streams, late = entering_streams(structure, spec, token_dim)
            plan = _Analysis(gm, region, spec).run(streams, late=late)
        except PassError as e:
            tried.append(e)
            continue
        if plan.distributed_attention:
            return plan
        tried.append(plan)
    first = tried[0]
    if isinstance(first, PassError):
        raise first
    return first
