"""Tensor-parallel rule table (hidden / head sharding) over the shared driver.

A :class:`ShardSpec` ``(dim, segments)``: the full extent along ``dim`` is a concatenation of ``segments`` (one
for a q projection, three for a fused QKV, ``(attention, MLP)`` for Flux single blocks) and rank ``r`` holds the
``r``-th chunk of each, concatenated; a padded spec (an MLP hidden or attention heads that do not divide, planned
by :mod:`~dit_passes.parallel.tp_plan`, its rules in :mod:`~dit_passes.parallel.tp_padded`) holds each segment
zero-padded to a multiple of tp. Specific here: column-parallel weight slicing
(:mod:`~dit_passes.parallel.tp_weights`: each weight sharded once, also when several linears read it),
row-parallel linears (+ all-reduce, bias after), local slices and views of fused segments, slices of replicated
operands, all-gather fallback; the attention's rules (SDPA heads, per-head matmuls) are in
:mod:`~dit_passes.parallel.tp_attention`, the distributed norms in :mod:`~dit_passes.parallel.tp_norms`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.fx as fx

from ..infra.ownership import WeightLedger
from ..infra.pass_base import PassError
from . import op_classes as oc
from . import tp_attention, tp_flex, tp_norms, tp_padded
from .propagate import (Placement, Propagation, PropagationError, Touches, agree, aligned_dim, arg, broadcast_dim,
                        memory_order, moved_dim, repropagate, resize_view, segment_cut, segment_runs, split_dim,
                        split_sizes, view_dims)
from .tp_plan import divisors, slice_range
from .tp_weights import ShardingError, WeightShards, shard_along  # noqa: F401 (tests import them here)

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class ShardSpec(Placement):
    dim: int                      # non-negative dim of the full tensor
    segments: Tuple[int, ...]     # full sizes of the concatenated segments along ``dim`` (padded ones if padded)
    real: Tuple[int, ...] = ()    # the segments' sizes before zero-padding; () when not padded

    @property
    def full(self) -> int:
        return sum(self.segments)

    @property
    def real_segments(self) -> Tuple[int, ...]:
        return self.real or self.segments

    @property
    def padded(self) -> bool:
        return bool(self.real) and self.real != self.segments

    def piece(self, i: int, j: int) -> "ShardSpec":
        """The spec of segments ``i:j`` (a split or slice of them)."""
        return ShardSpec(self.dim, self.segments[i:j], self.real[i:j] if self.real else ())

    def local_segments(self, tp: int) -> Tuple[int, ...]:
        return tuple(s // tp for s in self.segments)

    def local(self, tp: int) -> int:
        return self.full // tp


def check_divisible(segments: Sequence[int], tp: int, what: str) -> None:
    """Raise :class:`ShardingError` naming ``what`` unless every segment divides by ``tp``."""
    bad = [s for s in segments if s % tp]
    if bad:
        raise ShardingError(f"{what}: size(s) {list(segments)} are not divisible by tp={tp}; "
                            f"tensor-parallel sizes that divide them: {divisors(math.gcd(*segments))}")


def map_view_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, tp: int) -> int:
    """The output dim of a reshape that carries input ``dim``'s even shard (:func:`~propagate.view_dims`;
    e.g. ``(B, S, H*D) -> (B, S, H, D)`` shards H), else :class:`ShardingError`."""
    src, dst = [int(v) for v in in_shape], [int(v) for v in out_shape]
    what = f"view {src} -> {dst}"
    if math.prod(src) != math.prod(dst):
        raise ShardingError(f"{what} changes the element count")
    for e, _ in view_dims(src, dst, dim, [src[dim] * r // tp for r in range(tp + 1)]):
        return e
    if all(math.prod(dst[:e]) != math.prod(src[:dim]) for e in range(len(dst))):
        raise ShardingError(f"{what} merges dims before the sharded dim {dim} into it: the shard would not be "
                            "contiguous")
    raise ShardingError(f"{what}: the output dim that carries the shard is not divisible by tp={tp}")


class TPRules(Propagation):
    """Hidden / head sharding: the shard spec of every value reached from a column-parallel output, and
    the rewrite (row-parallel linears, distributed norms, slices of replicated operands, gathers)."""

    def __init__(self, gm: fx.GraphModule, tp: int, rank: int, group: dist.ProcessGroup, ledger: WeightLedger,
                 owner: Any):
        super().__init__(gm, group.group_name, tp, rank)
        self.tp = tp
        self.weights = WeightShards(gm, rank, tp, ledger, owner)  # each sharded weight once, with its readers
        self.row_nodes: List[fx.Node] = []
        self.fallback_ops: List[str] = []
        self.zero: Set[fx.Node] = set()  # values whose padded heads the plan proved exactly zero (TPPlan.zero)

    def _s(self, a) -> Optional[ShardSpec]:
        s = self.placed(a)
        return s if isinstance(s, ShardSpec) else None

    # -- parameters ------------------------------------------------------------------------------
    def _shard_rows_of(self, n: fx.Node, spec: ShardSpec, what: str, who: str = "tensor_parallel") -> None:
        try:
            check_divisible(spec.segments, self.tp, what)
        except ShardingError as e:
            raise PassError(f"{who}: {e}") from None
        for w in n.args[1:3]:
            if w is not None:
                self.weights.shard(w, 0, spec, [n])

    def shard_column(self, plan) -> None:
        """Shard a column-parallel linear as ``plan`` (a :class:`~dit_passes.parallel.tp_plan.ColumnPlan`) says."""
        n, site = plan.site.node, plan.site
        padded = plan.padded != plan.segments
        spec = ShardSpec(n.meta["val"].dim() - 1, plan.padded, plan.segments if padded else ())
        self._shard_rows_of(n, spec, f"{site.role} linear {site.module_path}")
        self.place[n] = spec
        self.counts["column"] += 1
        self.counts["padded"] += padded

    def shard_modulation(self, sites) -> None:
        """``modulation="column"``, after :meth:`propagate`: each modulation linear of ``sites`` (LinearSites) with a
        replicated input gets its weight rows sharded and its output all-gathered; one the propagation rewrote
        (input sharded: row-parallel, though its role says modulation) stays as it is. Other linears reading the
        same weight (DiT's timestep embedder, run again outside the blocks) are sharded and gathered alike."""
        readers: Dict[str, List[fx.Node]] = {}  # weight attribute -> the replicated linears reading it
        for u in self.g.nodes:
            if u.target is oc.LINEAR and self._replicated_linear(u):
                readers.setdefault(u.args[1].target, []).append(u)
        done: Set[fx.Node] = set()
        for n in (r for s in sites if self._replicated_linear(s.node) for r in readers[s.node.args[1].target]):
            if n not in done:  # (the site itself is among its weight's readers)
                done.add(n)
                self._gathered_column(n)

    def _replicated_linear(self, n: fx.Node) -> bool:
        """A linear still in the graph with a replicated input and output and a weight held as an attribute."""
        rewritten = n in self.row_nodes or n in self.inserted or n in self.place
        return not rewritten and self._s(n.args[0]) is None and isinstance(n.args[1], fx.Node) \
            and n.args[1].op == "get_attr"

    def _gathered_column(self, n: fx.Node) -> None:
        spec = ShardSpec(n.meta["val"].dim() - 1, (int(n.meta["val"].shape[-1]),))
        self._shard_rows_of(n, spec, f"modulation linear {n.meta.get('dit_module_path', n.name)}",
                            "tensor_parallel(modulation='column')")
        users = list(n.users)
        full = self._gather(n, spec, n.next)
        for u in users:
            u.replace_input_with(n, full)
        self.counts["all_gather"] += 1

    # -- node insertion ---------------------------------------------------------------------------
    def _local(self, x: fx.Node, dim: int, spec: ShardSpec, before: fx.Node) -> fx.Node:
        """Slice a replicated full tensor ``x`` to this rank's part along ``dim``."""
        if spec.padded:  # what zero-padding would mean for it is unknown: refused (norm weights: tp_padded)
            raise ShardingError(f"replicated operand {x.name} has the full extent of a zero-padded dim (heads or "
                                f"MLP hidden padded to divide by tp={self.tp}) instead of being broadcast over it")
        with self.g.inserting_before(before):
            pieces = [self.emit(aten.slice.Tensor, (x, dim, s, s + n), like=before)
                      for s, n in segment_runs(spec.segments, self.tp, self.rank)]
            self.counts["slices"] += 1
            return pieces[0] if len(pieces) == 1 else self.emit(aten.cat.default, (pieces, dim), like=before)

    def _gather(self, x: fx.Node, spec: ShardSpec, before: fx.Node) -> fx.Node:
        """All-gather sharded ``x`` back to the full tensor, segment-major (inserted before ``before``). Zero-padded
        heads only before a context region (autocast: tp_heads proved the padding up to it): gathered, then each
        segment's padded heads dropped, so the region reads the real value as it does unpadded."""
        if spec.padded and before.target in oc.CONTEXT_WRAPPERS:
            full = self._gather(x, ShardSpec(spec.dim, spec.segments), before)
            with self.g.inserting_before(before):
                starts = [sum(spec.segments[:i]) for i in range(len(spec.segments))]
                parts = [self.emit(aten.slice.Tensor, (full, spec.dim, s, s + r), like=before)
                         for s, r in zip(starts, spec.real_segments)]
                return parts[0] if len(parts) == 1 else self.emit(aten.cat.default, (parts, spec.dim), like=before)
        if spec.padded:
            raise ShardingError(f"{x.name} holds zero-padded heads or MLP hidden, which only an output / down "
                                f"projection may read (not {before.name} ({before.target}))")
        loc = spec.local_segments(self.tp)
        runs = [(sum(loc[:i]), n) for i, n in enumerate(loc)] if len(loc) > 1 else None
        order = list(memory_order(x.meta["val"]))  # (still the full traced value: repropagate() comes later)
        with self.g.inserting_before(before):
            full = self.all_gather(x, spec.dim, [spec.local(self.tp)] * self.tp, before, runs)
            if order != sorted(order):  # the traced layout: an op after it may be a view that relies on it
                inverse = [order.index(d) for d in range(len(order))]
                full = self.emit(aten.permute.default, (full, order), like=before)
                full = self.emit(aten.permute.default, (self.emit(aten.contiguous.default, (full,), like=before),
                                                        inverse), like=before)
            return full

    # -- propagation -----------------------------------------------------------------------------
    def propagate(self) -> None:
        def rule(n: fx.Node):
            try:
                return self.rule(n)
            except ShardingError as e:
                raise PassError(f"tensor_parallel: cannot shard node {n.name} ({n.target}) at "
                                f"{n.meta.get('dit_module_path', '?')}: {e}") from None
        self.walk(list(self.g.nodes), rule)
        self._fallback(self.g.output_node(), "graph output")

    def repropagate(self) -> None:
        """Local shapes of everything the rewrite touched, from the resharded parameters on."""
        params = [n for n in self.g.nodes if n.op == "get_attr" and n.target in self.weights.shards]
        try:  # layouts too: a view that the traced layout allowed is checked on the rewritten one
            repropagate(self.g, self.inserted | set(self.place), changed=params, strides=True)
        except PropagationError as e:
            raise PassError(f"tensor_parallel: {e}; the rewrite would fail there, so it is refused") from None

    def _fallback(self, n: fx.Node, what: str) -> None:
        for a in list(n.all_input_nodes):
            s = self._s(a)
            if s is not None:
                full = self._gather(a, s, n)
                # the full value from here on: ``n`` keeps its shape and is not re-evaluated (a higher-order op
                # such as wrap_with_autocast cannot be, its submodule has no fake value)
                full.meta["val"] = a.meta["val"]
                n.replace_input_with(a, full)
                self.counts["fallback"] += 1
                self.fallback_ops.append(what)

    def rule(self, n: fx.Node):  # noqa: C901 - one dispatch over op classes
        t, args = n.target, n.args
        x = args[0] if args else None
        sx = self._s(x)
        if t is oc.GETITEM:
            src = self.place.get(x)
            return src[args[1]] if isinstance(src, list) else None
        if t is oc.LINEAR:
            return self._linear(n, sx)
        if sx is not None and t in oc.RESHAPES:
            return self._view(n, sx)
        if sx is not None and t in oc.COMPLEX_VIEWS:
            if sx.dim >= x.meta["val"].dim() - (t is aten.view_as_complex.default):
                raise ShardingError("complex view of the sharded last dim")
            return sx  # only the trailing (real, imag) dim changes
        if sx is not None and t is aten.expand.default:
            od = broadcast_dim(n, x, sx.dim)
            new = resize_view(n, od, sx.local(self.tp))
            if new is not None:
                n.args = new
                self.counts["views"] += 1
            return sx.with_dim(od)
        if t in oc.NEW_TENSORS and all(self._s(a) is None for a in args[1:]):
            return None  # its size is an argument: replicated, whatever lends it a dtype
        if t is aten.type_as.default and sx is None:
            return None  # a replicated value cast to a sharded one's dtype: argument 1 gives only the dtype
        if sx is not None and t in oc.SPLITS:
            return self._split(n, sx)
        if t in (aten.cat.default, aten.stack.default):
            return self._cat(n)
        if t is oc.SDPA:
            return tp_attention.sdpa(self, n)
        if t is oc.FLEX_ATTENTION:
            return tp_flex.flex_attention(self, n)
        if t in (aten.matmul.default, aten.bmm.default):
            out = tp_attention.batched_matmul(self, n)
            if out is not None:
                return out
        if sx is not None and sx.padded and (t in oc.REDUCTIONS or t in oc.LAYER_NORMS or t is aten.rms_norm.default):
            tp_padded.check_statistics(self, n, sx)
        if sx is not None and t is aten.rms_norm.default:
            return tp_norms.rms_norm(self, n, sx)
        if sx is not None and t is aten.layer_norm.default:
            return tp_norms.layer_norm(self, n, sx)
        if sx is not None and t in {aten.native_layer_norm.default, aten.group_norm.default}:
            nd = len(args[1]) if t is not aten.group_norm.default else n.meta["val"].dim()
            if sx.dim >= n.meta["val"].dim() - nd:
                raise ShardingError(f"{t} normalises over the sharded hidden size; only RMSNorm and "
                                    "aten.layer_norm over a sharded dim are supported")
            return sx if t is not aten.native_layer_norm.default else [sx, None, None]
        if sx is not None and t is aten.slice.Tensor and int(arg(n, 1, "dim", 0)) % x.meta["val"].dim() == sx.dim:
            return self._slice(n, sx)
        if sx is not None and t is aten.repeat_interleave.self_int and self._repeats_heads(n, sx):
            return sx if int(args[1]) == 1 else ShardSpec(sx.dim, tuple(s * int(args[1]) for s in sx.segments))
        if sx is not None and t in oc.PADS | {aten.index.Tensor} and self._leaves_shard(n, sx):
            return sx
        if sx is not None and t in oc.REDUCTIONS and oc.REDUCTIONS[t][1]:
            return self._reduction(n, sx)
        if t in oc.COPIES:
            return self._pointwise(n, [0, 1])
        if t is aten.slice_scatter.default:
            dim = int(args[2] if len(args) > 2 else n.kwargs.get("dim", 0)) % n.meta["val"].dim()
            if dim == (sx or self._s(args[1])).dim:
                raise ShardingError("slice_scatter along the sharded dim")
            return self._pointwise(n, [0, 1])
        if oc.is_pointwise(t):
            return self._pointwise(n, range(len(args)))
        if sx is not None:
            try:
                d = moved_dim(n, sx.dim)
                return [sx.with_dim(d)] * len(n.meta["val"]) if t is aten.unbind.int else sx.with_dim(d)
            except Touches:
                verb = {aten.slice.Tensor: "slicing", aten.select.int: "selecting", aten.unbind.int: "unbind"}.get(t)
                if verb:  # other ops that touch the shard are all-gathered below
                    raise ShardingError(f"{verb} along the sharded dim") from None
            except KeyError:
                pass
        self._fallback(n, str(t))

    def _linear(self, n: fx.Node, sx: Optional[ShardSpec]):
        x, w = n.args[0], n.args[1]
        if sx is None:
            return self._fallback(n, "linear weight/bias from a sharded value")
        if sx.dim != x.meta["val"].dim() - 1:
            if sx.padded:  # tp_heads proved the padding up to the linears over it, not beyond
                raise ShardingError("a linear over another dim of a zero-padded value")
            return sx  # linear over another dim: the shard passes through
        if any(self._s(a) is not None for a in n.args[1:]):
            return self._fallback(n, "linear weight from a sharded value")
        in_features = int(x.meta["val"].shape[-1])  # (the weight's may be a shard already: read twice)
        if sum(sx.real_segments) != in_features:
            raise ShardingError(f"input sharded over {sum(sx.real_segments)} features, the weight has {in_features}")
        bias = n.args[2] if len(n.args) > 2 else None
        with self.g.inserting_before(n.next):  # (inserting_after would stack new nodes in reverse order)
            local = self.emit(aten.linear.default, (x, w), like=n)
            self.weights.shard(w, 1, sx, [local])  # padded: zero columns where the hidden is padded
            out = self.all_reduce(local, n)
            if bias is not None:
                out = self.emit(aten.add.Tensor, (out, bias), like=n)  # full bias, once, after the sum
        out.meta["val"] = n.meta["val"]  # full shape until repropagate(); later rules read it
        n.replace_all_uses_with(out)
        self.g.erase_node(n)
        self.row_nodes.append(n)  # the original node: compared with the structure's row-parallel sites
        self.counts["all_reduce"] += 1

    def _view(self, n: fx.Node, sx: ShardSpec) -> ShardSpec:
        if sx.padded:
            return tp_padded.view(self, n, sx)
        in_shape, out_shape = list(n.args[0].meta["val"].shape), list(n.meta["val"].shape)
        stacked = self._stacked_view(in_shape, out_shape, sx)
        if stacked is not None:
            return self._resized(n, stacked, out_shape)
        k = map_view_dim(in_shape, out_shape, sx.dim, self.tp)
        if len(sx.segments) > 1 and in_shape[sx.dim] != out_shape[k]:
            raise ShardingError(f"a view that splits or merges a dim made of {len(sx.segments)} sharded "
                                f"segments {list(sx.segments)}")
        return self._resized(n, ShardSpec(k, sx.segments if len(sx.segments) > 1 else (out_shape[k],)), out_shape)

    def _resized(self, n: fx.Node, spec: ShardSpec, out_shape) -> ShardSpec:
        new = resize_view(n, spec.dim, out_shape[spec.dim] // self.tp)
        if new is not None:
            n.args = new
            self.counts["views"] += 1
        return spec

    def _stacked_view(self, in_shape, out_shape, sx: ShardSpec) -> Optional[ShardSpec]:
        """A view that unstacks ``c`` equal sharded segments into a dim of size ``c`` (a fused QKV viewed
        ``(B, S, 3, H, D)``): the shard moves into each segment's own dims (``H``), the ``c`` dim stays whole."""
        count, size = len(sx.segments), sx.segments[0]
        if count < 2 or len(set(sx.segments)) != 1:
            return None
        pre = math.prod(in_shape[:sx.dim])
        for e in range(len(out_shape)):
            if math.prod(out_shape[:e]) == pre and out_shape[e] == count:
                inner = in_shape[:sx.dim] + [count, size] + in_shape[sx.dim + 1:]
                k = map_view_dim(inner, out_shape, sx.dim + 1, self.tp)
                return ShardSpec(k, (out_shape[k],)) if k > e else None
        return None

    def _slice(self, n: fx.Node, sx: ShardSpec) -> ShardSpec:
        """A slice along the sharded dim that starts and ends at segment boundaries (a SwiGLU's
        ``x[..., :h]`` / ``x[..., h:]`` of a fused up projection): the same segments, sliced locally."""
        full = sum(sx.real_segments)
        rng = slice_range(n, full)
        idx = segment_cut(sx.real_segments, rng) if rng is not None else None
        if idx is None:
            raise ShardingError(f"slicing along the sharded dim at {rng if rng else 'a step'} cuts through its "
                                f"segments {list(sx.real_segments)}")
        loc = sx.local_segments(self.tp)
        n.args = (n.args[0], sx.dim, sum(loc[:idx[0]]), sum(loc[:idx[1]]))
        self.counts["views"] += 1
        return sx.piece(*idx)

    def _leaves_shard(self, n: fx.Node, sx: ShardSpec) -> bool:
        """A pad that pads other dims only, or an index with replicated indices on dims after the sharded one
        (Mochi's valid text tokens ``x[:, :, idx]``): local, the sharded dim where it was."""
        nd = n.args[0].meta["val"].dim()
        if n.target is aten.index.Tensor:
            indices = list(n.args[1])
            used = [i for i, a in enumerate(indices) if a is not None]
            return bool(used) and sx.dim < used[0] and not any(self._s(indices[i]) for i in used)
        pads = list(n.args[1])
        covered = nd - 1 - sx.dim  # pairs run from the last dim backwards
        return len(pads) <= 2 * covered or not any(pads[2 * covered:2 * covered + 2])

    def _repeats_heads(self, n: fx.Node, sx: ShardSpec) -> bool:
        """``repeat_interleave(kv, r, dim=heads)`` (GQA) on kv sharded over heads: each rank repeats its own
        heads, which are the kv heads of its q heads. Zero-padded heads only ``r = 1`` (Cosmos repeats its kv
        heads to the q heads' count, equal to it): the padded layout of ``r`` copies would not be q's."""
        dim = arg(n, 2, "dim", None)
        return dim is not None and int(dim) % n.args[0].meta["val"].dim() == sx.dim and isinstance(n.args[1], int) \
            and (not sx.padded or n.args[1] == 1)

    def _split(self, n: fx.Node, sx: ShardSpec):
        x, dim = n.args[0], split_dim(n)
        sizes = split_sizes(n, int(x.meta["val"].shape[dim]))
        if dim != sx.dim:
            return [sx] * len(sizes)
        idx = segment_cut(sx.real_segments, [sum(sizes[:i]) for i in range(len(sizes) + 1)])
        if idx is None:
            raise ShardingError(f"split sizes {list(sizes)} cut through the sharded segments {list(sx.real_segments)}")
        pieces = [sx.piece(i, j) for i, j in zip(idx, idx[1:])]
        local = [p.local(self.tp) for p in pieces]
        if n.target is aten.chunk.default:
            if len(set(local)) != 1:
                raise ShardingError(f"chunk into unequal local pieces {local}")
        else:
            one = n.target is aten.split.Tensor and len(set(local)) == 1  # split(x, size): one size
            n.args = (x, local[0] if one else local) + tuple(n.args[2:])
            self.counts["views"] += 1
        return pieces

    def _cat(self, n: fx.Node) -> ShardSpec:
        tensors = list(n.args[0])
        dim = int(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
        ref = next(self._s(a) for a in tensors if self._s(a) is not None)
        dim %= tensors[0].meta["val"].dim() + (n.target is aten.stack.default)
        along = n.target is aten.cat.default and dim == ref.dim
        segs, real, new = [], [], []
        for a in tensors:
            s = self._s(a)
            if s is None and along:  # a replicated piece becomes one more sharded segment
                s = ShardSpec(dim, (int(a.meta["val"].shape[dim]),))
                check_divisible(s.segments, self.tp, f"replicated input {a.name} of a cat along the shard")
                a = self._local(a, dim, s, n)
            elif s is None and ref.padded:  # a cat moves data: its zero heads stay zero, like the others' (KV cache)
                a = tp_padded.local_operand(self, a, ref.dim, ref, n)
            elif s is None:
                a = self._local(a, ref.dim, ref, n)
            elif s != ref and not along:
                raise ShardingError(f"cat/stack of values sharded differently: {s} vs {ref}")
            segs.extend(s.segments if s is not None else ())
            real.extend(s.real_segments if s is not None else ())
            new.append(a)
        n.args = (new,) + tuple(n.args[1:])
        if along:
            return ShardSpec(dim, tuple(segs), tuple(real) if real != segs else ())
        return ref.with_dim(ref.dim + (n.target is aten.stack.default and dim <= ref.dim))

    def _reduction(self, n: fx.Node, sx: ShardSpec) -> ShardSpec:
        """Reduction over some dims: local if the sharded dim is kept, else completed by an all-reduce
        (a decomposed RMSNorm over the full hidden: mean of squares = sum of the ranks' means / tp)."""
        try:
            return sx.with_dim(moved_dim(n, sx.dim))
        except Touches:
            pass
        users = list(n.users)
        with self.g.inserting_before(n.next):
            out = self.all_reduce(n, n, oc.REDUCTIONS[n.target][1])
            if n.target is aten.mean.dim:
                out = self.emit(aten.div.Tensor, (out, tp_padded.mean_divisor(sx, self.tp)), like=n)
        out.meta["val"] = n.meta["val"]
        for u in users:
            u.replace_input_with(n, out)
        self.inserted.add(n)  # recompute its (local) shape
        self.counts["norm_all_reduce"] += 1

    def _pointwise(self, n: fx.Node, positions):
        """Broadcasting op: sharded inputs must agree; replicated full-size operands are sliced."""
        ref = agree(n, self._s, [n.args[i] for i in positions], ShardingError)
        if ref is None:
            return self._fallback(n, f"{n.target} with a sharded non-tensor-position input")
        new = list(n.args)
        for i in positions:
            d = None if self._s(new[i]) is not None else aligned_dim(n, new[i], ref.dim)
            if d is not None:
                if n.target is aten.copy_.default and i == 0:  # would write a shard into a full tensor
                    raise ShardingError("in-place copy of a sharded value into a replicated tensor")
                if ref.padded and n.target in oc.FINITE_POINTWISE:  # zero there: finite with the padding
                    new[i] = tp_padded.local_operand(self, new[i], d, ref.with_dim(d), n)
                else:
                    new[i] = self._local(new[i], d, ref.with_dim(d), n)
        n.args = tuple(new)
        return ref
