"""Tensor-parallel rule table (hidden / head sharding) over the shared driver.

A :class:`ShardSpec` ``(dim, segments)``: the full extent along ``dim`` is a concatenation of
``segments`` (one for a q projection, three for a fused QKV, ``(attention, MLP)`` for Flux single
blocks) and rank ``r`` holds the ``r``-th chunk of each, concatenated. Specific here: column-parallel
weight slicing, row-parallel linears (+ all-reduce, bias after), distributed RMSNorm, heads of SDPA,
slices of replicated operands, all-gather fallback.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.fx as fx

from ..infra.ownership import WeightLedger
from ..infra.pass_base import PassError
from . import op_classes as oc
from .propagate import (Placement, Propagation, Touches, agree, aligned_dim, broadcast_dim, moved_dim, repropagate,
                        resize_view, segment_cut, segment_runs, split_dim, split_sizes, view_dims)

aten = torch.ops.aten


class ShardingError(ValueError):
    """A value cannot be sharded consistently (a view that mixes the sharded dim, an odd size)."""


@dataclasses.dataclass(frozen=True)
class ShardSpec(Placement):
    dim: int                      # non-negative dim of the full tensor
    segments: Tuple[int, ...]     # full sizes of the concatenated segments along ``dim``

    @property
    def full(self) -> int:
        return sum(self.segments)

    def local_segments(self, tp: int) -> Tuple[int, ...]:
        return tuple(s // tp for s in self.segments)

    def local(self, tp: int) -> int:
        return self.full // tp


def divisors(n: int) -> List[int]:
    return [t for t in range(1, n + 1) if n % t == 0]


def check_divisible(segments: Sequence[int], tp: int, what: str) -> None:
    """Raise :class:`ShardingError` naming ``what`` unless every segment divides by ``tp``."""
    bad = [s for s in segments if s % tp]
    if bad:
        raise ShardingError(f"{what}: size(s) {list(segments)} are not divisible by tp={tp}; "
                            f"tensor-parallel sizes that divide them: {divisors(math.gcd(*segments))}")


def shard_along(t: torch.Tensor, dim: int, segments: Sequence[int], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``t`` along ``dim`` (see the module docstring), a new contiguous tensor."""
    if sum(segments) != t.shape[dim]:
        raise ShardingError(f"segments {list(segments)} sum to {sum(segments)}, tensor has {t.shape[dim]} along dim {dim}")
    return torch.cat([t.narrow(dim, s, n) for s, n in segment_runs(segments, tp, rank)], dim=dim).contiguous()


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
        raise ShardingError(f"{what} merges dims before the sharded dim {dim} into it: the shard would not be contiguous")
    raise ShardingError(f"{what}: the output dim that carries the shard is not divisible by tp={tp}")


def output_segments(linear: fx.Node) -> Tuple[int, ...]:
    """Segments of a column-parallel linear's output features, from how the graph splits them.

    A fused projection is split along its last dim right after the linear (QKV: ``chunk(3)``; a gated
    MLP: ``chunk(2)``; Flux2's ``split([3*inner, mlp])`` then ``chunk(3)``): each final piece is sharded
    on its own, so that after the split every rank holds matching heads of q, k and v (and matching
    columns of gate and value). No split: one segment.
    """
    val = linear.meta["val"]
    return tuple(_segments_of(linear, val.dim() - 1, int(val.shape[-1])))


def _segments_of(node: fx.Node, dim: int, full: int) -> List[int]:
    for u in node.users:
        if u.target not in oc.SPLITS or split_dim(u) != dim:
            continue
        sizes = split_sizes(u, full)
        out: List[int] = []
        pieces = {g.args[1]: g for g in u.users if g.target is operator.getitem}
        for i, s in enumerate(sizes):
            out.extend(_segments_of(pieces[i], dim, s) if i in pieces else [s])
        return out
    return [full]


class TPRules(Propagation):
    """Hidden / head sharding: the shard spec of every value reached from a column-parallel output, and
    the rewrite (row-parallel linears, distributed RMSNorm, slices of replicated operands, gathers)."""

    def __init__(self, gm: fx.GraphModule, tp: int, rank: int, group: dist.ProcessGroup, ledger: WeightLedger,
                 owner: Any):
        super().__init__(gm, group.group_name, tp, rank)
        self.tp = tp
        self.ledger, self.owner = ledger, owner      # where shards are recorded (infra/ownership.py), by whom
        self.new_params: set = set()                 # attribute paths replaced by shards
        self.row_nodes: List[fx.Node] = []
        self.fallback_ops: List[str] = []

    def _s(self, a) -> Optional[ShardSpec]:
        s = self.placed(a)
        return s if isinstance(s, ShardSpec) else None

    # -- parameters ------------------------------------------------------------------------------
    def _replace_param(self, attr_node: fx.Node, dim: int, segments, users_ok: Sequence[fx.Node]) -> None:
        path = attr_node.target
        if path in self.new_params:
            raise PassError(f"tensor_parallel: parameter {path} is used by several sharded linears")
        extra = [u for u in attr_node.users if u not in users_ok]
        if extra:
            raise PassError(f"tensor_parallel: parameter {path} is also read by {[u.name for u in extra]}; "
                            "shared (tied) weights are not supported")
        token = (dim, tuple(segments), self.rank, self.tp)
        rec = self.ledger.released(self.gm, path)
        if rec is not None:  # lowering again after the full weight was released: the shard made then
            shard = self.ledger.reuse(rec, by=self.owner, token=token, like=attr_node.meta["val"])
        else:
            full = functools.reduce(getattr, path.split("."), self.gm).detach()
            shard = torch.nn.Parameter(shard_along(full, dim, segments, self.rank, self.tp), requires_grad=False)
        # the graph's attribute becomes the shard; the ledger re-points the caller's model afterwards
        self.ledger.replace(self.gm, path, shard, by=self.owner, token=token,
                            how=f"sharded (rank {self.rank} of {self.tp}, dim {dim})")
        self.new_params.add(path)
        attr_node.meta["val"] = attr_node.meta["val"].fake_mode.from_tensor(shard, static_shapes=True)

    def _shard_rows_of(self, n: fx.Node, segments, what: str, who: str = "tensor_parallel") -> None:
        try:
            check_divisible(segments, self.tp, what)
        except ShardingError as e:
            raise PassError(f"{who}: {e}") from None
        for w in n.args[1:3]:
            if w is not None:
                self._replace_param(w, 0, segments, [n])

    def shard_column(self, site) -> None:
        n = site.node
        segments = output_segments(n)
        self._shard_rows_of(n, segments, f"{site.role} linear {site.module_path}")
        self.place[n] = ShardSpec(n.meta["val"].dim() - 1, segments)
        self.counts["column"] += 1

    def shard_modulation(self, site) -> None:
        n = site.node
        out = int(n.meta["val"].shape[-1])
        self._shard_rows_of(n, [out], f"modulation linear {site.module_path}", "tensor_parallel(modulation='column')")
        users = list(n.users)
        full = self._gather(n, ShardSpec(n.meta["val"].dim() - 1, (out,)), n.next)
        for u in users:
            u.replace_input_with(n, full)
        self.counts["all_gather"] += 1

    # -- node insertion ---------------------------------------------------------------------------
    def _local(self, x: fx.Node, dim: int, spec: ShardSpec, before: fx.Node) -> fx.Node:
        """Slice a replicated full tensor ``x`` to this rank's part along ``dim``."""
        with self.g.inserting_before(before):
            pieces = [self.emit(aten.slice.Tensor, (x, dim, s, s + n), like=before)
                      for s, n in segment_runs(spec.segments, self.tp, self.rank)]
            self.counts["slices"] += 1
            return pieces[0] if len(pieces) == 1 else self.emit(aten.cat.default, (pieces, dim), like=before)

    def _gather(self, x: fx.Node, spec: ShardSpec, before: fx.Node) -> fx.Node:
        """All-gather sharded ``x`` back to the full tensor, segment-major (inserted before ``before``)."""
        loc = spec.local_segments(self.tp)
        runs = [(sum(loc[:i]), n) for i, n in enumerate(loc)] if len(loc) > 1 else None
        with self.g.inserting_before(before):
            return self.all_gather(x, spec.dim, [spec.local(self.tp)] * self.tp, before, runs)

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
        params = [n for n in self.g.nodes if n.op == "get_attr" and n.target in self.new_params]
        repropagate(self.g, self.inserted | set(self.place), changed=params)

    def _fallback(self, n: fx.Node, what: str) -> None:
        for a in list(n.all_input_nodes):
            s = self._s(a)
            if s is not None:
                n.replace_input_with(a, self._gather(a, s, n))
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
        if t is aten.type_as.default and sx is None:
            return None  # a replicated value cast to a sharded one's dtype: argument 1 gives only the dtype
        if sx is not None and t in oc.SPLITS:
            return self._split(n, sx)
        if t in (aten.cat.default, aten.stack.default):
            return self._cat(n)
        if t is oc.SDPA:
            return self._sdpa(n)
        if sx is not None and t is aten.rms_norm.default:
            return self._rms_norm(n, sx)
        if sx is not None and t in oc.LAYER_NORMS | {aten.group_norm.default}:
            nd = len(args[1]) if t is not aten.group_norm.default else n.meta["val"].dim()
            if sx.dim >= n.meta["val"].dim() - nd:
                raise ShardingError(f"{t} normalises over the sharded hidden size; only RMSNorm over a sharded "
                                    "dim is supported (run without TensorParallel for this model)")
            return sx if t is not aten.native_layer_norm.default else [sx, None, None]
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
            return sx  # linear over another dim: the shard passes through
        if any(self._s(a) is not None for a in n.args[1:]):
            return self._fallback(n, "linear weight from a sharded value")
        in_features = int(w.meta["val"].shape[1])
        if sx.full != in_features:
            raise ShardingError(f"input sharded over {sx.full} features, the weight has {in_features}")
        self._replace_param(w, 1, sx.segments, [n])
        bias = n.args[2] if len(n.args) > 2 else None
        with self.g.inserting_before(n.next):  # (inserting_after would stack new nodes in reverse order)
            out = self.all_reduce(self.emit(aten.linear.default, (x, w), like=n), n)
            if bias is not None:
                out = self.emit(aten.add.Tensor, (out, bias), like=n)  # full bias, once, after the sum
        out.meta["val"] = n.meta["val"]  # full shape until repropagate(); later rules read it
        n.replace_all_uses_with(out)
        self.g.erase_node(n)
        self.row_nodes.append(n)  # the original node: compared with the structure's row-parallel sites
        self.counts["all_reduce"] += 1

    def _view(self, n: fx.Node, sx: ShardSpec) -> ShardSpec:
        in_shape, out_shape = list(n.args[0].meta["val"].shape), list(n.meta["val"].shape)
        k = map_view_dim(in_shape, out_shape, sx.dim, self.tp)
        if len(sx.segments) > 1 and in_shape[sx.dim] != out_shape[k]:
            raise ShardingError(f"a view that splits or merges a dim made of {len(sx.segments)} sharded "
                                f"segments {list(sx.segments)}")
        new = resize_view(n, k, out_shape[k] // self.tp)
        if new is not None:
            n.args = new
            self.counts["views"] += 1
        return ShardSpec(k, sx.segments if len(sx.segments) > 1 else (out_shape[k],))

    def _split(self, n: fx.Node, sx: ShardSpec):
        x, dim = n.args[0], split_dim(n)
        sizes = split_sizes(n, int(x.meta["val"].shape[dim]))
        if dim != sx.dim:
            return [sx] * len(sizes)
        idx = segment_cut(sx.segments, [sum(sizes[:i]) for i in range(len(sizes) + 1)])
        if idx is None:
            raise ShardingError(f"split sizes {list(sizes)} cut through the sharded segments {list(sx.segments)}")
        pieces = [ShardSpec(dim, sx.segments[i:j]) for i, j in zip(idx, idx[1:])]
        local = [p.local(self.tp) for p in pieces]
        if n.target is aten.chunk.default:
            if len(set(local)) != 1:
                raise ShardingError(f"chunk into unequal local pieces {local}")
        else:
            n.args = (x, local if n.target is not aten.split.Tensor or len(set(local)) > 1 else local[0]) + tuple(n.args[2:])
            self.counts["views"] += 1
        return pieces

    def _cat(self, n: fx.Node) -> ShardSpec:
        tensors = list(n.args[0])
        dim = int(n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
        ref = next(self._s(a) for a in tensors if self._s(a) is not None)
        dim %= tensors[0].meta["val"].dim() + (n.target is aten.stack.default)
        along = n.target is aten.cat.default and dim == ref.dim
        segs, new = [], []
        for a in tensors:
            s = self._s(a)
            if s is None and along:  # a replicated piece becomes one more sharded segment
                s = ShardSpec(dim, (int(a.meta["val"].shape[dim]),))
                check_divisible(s.segments, self.tp, f"replicated input {a.name} of a cat along the shard")
                a = self._local(a, dim, s, n)
            elif s is None:
                a = self._local(a, ref.dim, ref, n)
            elif s != ref and not along:
                raise ShardingError(f"cat/stack of values sharded differently: {s} vs {ref}")
            segs.extend(s.segments if s is not None else ())
            new.append(a)
        n.args = (new,) + tuple(n.args[1:])
        if along:
            return ShardSpec(dim, tuple(segs))
        return ref.with_dim(ref.dim + (n.target is aten.stack.default and dim <= ref.dim))

    def _sdpa(self, n: fx.Node) -> ShardSpec:
        q, k, v = n.args[:3]
        specs = [self._s(a) for a in (q, k, v)]
        if any(s is not None and s.dim != 1 for s in specs):
            raise ShardingError(f"attention needs q, k, v sharded over heads (dim 1), got {specs}")
        for a, s in zip((q, k, v), specs):
            if s is None:  # a replicated q/k/v (computed outside the sharded linears): take the local heads
                heads = int(a.meta["val"].shape[1])
                check_divisible([heads], self.tp, f"attention input {a.name}")
                n.replace_input_with(a, self._local(a, 1, ShardSpec(1, (heads,)), n))
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            mv = mask.meta["val"]
            hd = mv.dim() - 3
            if self._s(mask) is None and hd >= 0 and int(mv.shape[hd]) > 1:
                n.replace_input_with(mask, self._local(mask, hd, ShardSpec(hd, (int(mv.shape[hd]),)), n))
        return specs[0] or ShardSpec(1, (int(q.meta["val"].shape[1]),))

    def _rms_norm(self, n: fx.Node, sx: ShardSpec) -> Optional[ShardSpec]:
        x, shape = n.args[0], list(n.args[1])
        weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        eps = n.args[3] if len(n.args) > 3 else n.kwargs.get("eps")
        xv = x.meta["val"]
        first = xv.dim() - len(shape)
        if sx.dim < first:  # per-head norm: the sharded dim is not normalised over
            return sx
        # Distributed RMSNorm (the norm covers the sharded hidden): sum of squares over the local part,
        # one all-reduce, division by the full count; same op order as aten.rms_norm.
        low = xv.dtype in (torch.float16, torch.bfloat16)
        eps = torch.finfo(torch.float32 if low else xv.dtype).eps if eps is None else eps
        emit = self.emit
        with self.g.inserting_before(n):
            xf = emit(aten._to_copy.default, (x,), {"dtype": torch.float32}, like=n) if low else x
            ss = emit(aten.sum.dim_IntList, (emit(aten.pow.Tensor_Scalar, (xf, 2), like=n),
                                             list(range(first, xv.dim())), True), like=n)
            ms = emit(aten.div.Tensor, (self.all_reduce(ss, n), math.prod(int(s) for s in shape)), like=n)
            r = emit(aten.rsqrt.default, (emit(aten.add.Tensor, (ms, eps), like=n),), like=n)
            y = emit(aten.type_as.default, (emit(aten.mul.Tensor, (xf, r), like=n), x), like=n)
            if weight is not None:
                wd = sx.dim - first
                y = emit(aten.mul.Tensor, (y, self._local(weight, wd, ShardSpec(wd, sx.segments), n)), like=n)
        y.meta["val"] = n.meta["val"]  # full shape until repropagate(); later rules read it
        n.replace_all_uses_with(y)
        self.g.erase_node(n)
        self.place[y] = sx
        self.counts["norm_all_reduce"] += 1

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
                out = self.emit(aten.div.Tensor, (out, self.tp), like=n)
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
                new[i] = self._local(new[i], d, ref.with_dim(d), n)
        n.args = tuple(new)
        return ref
