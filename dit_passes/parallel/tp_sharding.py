"""Tensor-parallel sharding helpers: shard specs, weight slicing, view-dim mapping, segment discovery.

A :class:`ShardSpec` says how a rank's local tensor relates to the full one: along ``dim`` the full
extent is a concatenation of ``segments`` (e.g. one segment ``(H*D,)`` for a q projection, ``(32, 128)``
for Flux single blocks' ``concat(attention, MLP)``, ``(inner, inner, inner)`` for a fused QKV), and
rank ``r`` of ``tp`` holds the ``r``-th contiguous chunk of **each** segment, concatenated in order.
Every other dim is whole (replicated).

The free functions only compute (no graph edits, no process groups). :class:`GraphSharder` holds the
graph edits the tensor-parallel pass makes (sharded parameters, inserted slices / collectives, shape
re-propagation); the propagation rules themselves live in :mod:`dit_passes.passes.tensor_parallel`.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.fx as fx

from ..infra.graph_utils import copy_meta
from ..infra.pass_base import PassError

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class ShardingError(ValueError):
    """A value cannot be sharded consistently (a view that mixes the sharded dim, an odd size)."""


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    dim: int                      # non-negative dim of the full tensor
    segments: Tuple[int, ...]     # full sizes of the concatenated segments along ``dim``

    @property
    def full(self) -> int:
        return sum(self.segments)

    def local_segments(self, tp: int) -> Tuple[int, ...]:
        return tuple(s // tp for s in self.segments)

    def local(self, tp: int) -> int:
        return self.full // tp

    def with_dim(self, dim: int) -> "ShardSpec":
        return ShardSpec(dim, self.segments)


def check_divisible(segments: Sequence[int], tp: int, what: str) -> None:
    """Raise :class:`ShardingError` naming ``what`` unless every segment divides by ``tp``."""
    bad = [s for s in segments if s % tp]
    if bad:
        g = math.gcd(*segments)
        valid = [t for t in range(1, g + 1) if g % t == 0]
        raise ShardingError(f"{what}: size(s) {list(segments)} are not divisible by tp={tp}; "
                            f"tensor-parallel sizes that divide them: {valid}")


def shard_along(t: torch.Tensor, dim: int, segments: Sequence[int], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``t`` along ``dim`` (see the module docstring), a new contiguous tensor."""
    if sum(segments) != t.shape[dim]:
        raise ShardingError(f"segments {list(segments)} sum to {sum(segments)}, tensor has {t.shape[dim]} along dim {dim}")
    pieces, start = [], 0
    for s in segments:
        c = s // tp
        pieces.append(t.narrow(dim, start + rank * c, c))
        start += s
    return torch.cat(pieces, dim=dim).contiguous()


def map_view_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, tp: int) -> int:
    """The output dim of a reshape ``in_shape -> out_shape`` that carries input ``dim``'s sharding.

    A rank's contiguous chunk of ``dim`` stays a rectangular block after the view only when ``dim`` is
    the outermost non-trivial dim of its group of merged/split dims, and the outermost non-trivial
    output dim of that group is divisible by ``tp`` (e.g. ``(B, S, H*D) -> (B, S, H, D)`` shards H;
    ``(B, S, H, D) -> (B, S, H*D)`` shards the merged dim). Otherwise :class:`ShardingError`.
    """
    def prefix(shape):
        out = [1]
        for s in shape:
            out.append(out[-1] * int(s))
        return out

    pi, po = prefix(in_shape), prefix(out_shape)
    if pi[-1] != po[-1]:
        raise ShardingError(f"view {list(in_shape)} -> {list(out_shape)} changes the element count")
    po_set = set(po)
    a = max(t for t in range(dim + 1) if pi[t] in po_set)
    if a != dim:
        raise ShardingError(f"view {list(in_shape)} -> {list(out_shape)} merges dims before the sharded dim "
                            f"{dim} into it: the shard would not be contiguous")
    start = min(s for s in range(len(po)) if po[s] == pi[dim])
    stop = min(t for t in range(dim + 1, len(pi)) if pi[t] in po_set)
    end = max(s for s in range(len(po)) if po[s] == pi[stop])
    for k in range(start, end):
        if int(out_shape[k]) != 1:
            if int(out_shape[k]) % tp:
                raise ShardingError(f"view {list(in_shape)} -> {list(out_shape)}: output dim {k} of size "
                                    f"{out_shape[k]} carries the shard but is not divisible by tp={tp}")
            return k
    raise ShardingError(f"view {list(in_shape)} -> {list(out_shape)}: no output dim carries the sharded dim {dim}")


_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default,
           aten.split.sizes if hasattr(aten.split, "sizes") else aten.split_with_sizes.default}


def split_sizes(node: fx.Node, full: int) -> Optional[Tuple[int, ...]]:
    """Piece sizes of a split/chunk node applied to a dim of ``full`` elements (None: not a split)."""
    if node.target not in _SPLITS:
        return None
    arg = node.args[1]
    if node.target is aten.chunk.default:
        n = int(arg)
        c = -(-full // n)
        sizes = [c] * (full // c) + ([full % c] if full % c else [])
        return tuple(sizes)
    if isinstance(arg, int):
        return tuple([arg] * (full // arg) + ([full % arg] if full % arg else []))
    return tuple(int(s) for s in arg)


def split_dim(node: fx.Node) -> int:
    d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return int(d) % node.args[0].meta["val"].dim()


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
        sizes = split_sizes(u, full)
        if sizes is None or split_dim(u) != dim:
            continue
        out: List[int] = []
        pieces = {g.args[1]: g for g in u.users if g.target is operator.getitem}
        for i, s in enumerate(sizes):
            out.extend(_segments_of(pieces[i], dim, s) if i in pieces else [s])
        return out
    return [full]


def linear_bytes(gm: fx.GraphModule, sites) -> int:
    """Bytes of the weights and biases the graph module holds for ``sites`` (LinearSite list)."""
    seen, total = set(), 0
    for s in sites:
        for name in (s.weight, s.bias):
            if name is None or name in seen:
                continue
            seen.add(name)
            try:
                t = gm.get_parameter(name)
            except AttributeError:
                t = gm.get_buffer(name)
            total += t.numel() * t.element_size()
    return total


class GraphSharder:
    """Holds the shard spec of every sharded value and rewrites the graph node by node."""

    def __init__(self, gm: fx.GraphModule, tp: int, rank: int, group: dist.ProcessGroup):
        self.gm, self.g, self.tp, self.rank = gm, gm.graph, tp, rank
        self.group_name = group.group_name
        self.spec: Dict[fx.Node, Any] = {}          # node -> ShardSpec, or list of them for tuple values
        self.new_params: set = set()                 # attribute paths replaced by shards
        self.inserted: set = set()
        self.row_nodes: List[fx.Node] = []
        self.fallback_ops: List[str] = []
        self.counts = {k: 0 for k in ("column", "all_reduce", "norm_all_reduce", "all_gather", "fallback",
                                       "views", "slices")}

    # -- parameters ------------------------------------------------------------------------------
    def _replace_param(self, attr_node: fx.Node, dim: int, segments, users_ok: Sequence[fx.Node]) -> None:
        path = attr_node.target
        if path in self.new_params:
            raise PassError(f"tensor_parallel: parameter {path} is used by several sharded linears")
        extra = [u for u in attr_node.users if u not in users_ok]
        if extra:
            raise PassError(f"tensor_parallel: parameter {path} is also read by {[u.name for u in extra]}; "
                            "shared (tied) weights are not supported")
        owner_path, _, leaf = path.rpartition(".")
        owner = self.gm.get_submodule(owner_path) if owner_path else self.gm
        full = getattr(owner, leaf)
        shard = shard_along(full.detach(), dim, segments, self.rank, self.tp)
        # a new Parameter on the GraphModule's own submodule: the caller's model keeps its tensors
        setattr(owner, leaf, torch.nn.Parameter(shard, requires_grad=False))
        self.new_params.add(path)
        mode = attr_node.meta["val"].fake_mode
        attr_node.meta["val"] = mode.from_tensor(shard, static_shapes=True)

    def shard_column(self, site) -> None:
        n = site.node
        segments = output_segments(n)
        try:
            check_divisible(segments, self.tp, f"{site.role} linear {site.module_path}")
        except ShardingError as e:
            raise PassError(f"tensor_parallel: {e}") from None
        self._replace_param(n.args[1], 0, segments, [n])
        if len(n.args) > 2 and n.args[2] is not None:
            self._replace_param(n.args[2], 0, segments, [n])
        self.spec[n] = ShardSpec(n.meta["val"].dim() - 1, segments)
        self.counts["column"] += 1

    def shard_modulation(self, site) -> None:
        n = site.node
        out = int(n.meta["val"].shape[-1])
        try:
            check_divisible([out], self.tp, f"modulation linear {site.module_path}")
        except ShardingError as e:
            raise PassError(f"tensor_parallel(modulation='column'): {e}") from None
        self._replace_param(n.args[1], 0, [out], [n])
        if len(n.args) > 2 and n.args[2] is not None:
            self._replace_param(n.args[2], 0, [out], [n])
        users = list(n.users)
        full = self._gather(n, ShardSpec(n.meta["val"].dim() - 1, (out,)), n.next)
        for u in users:
            u.replace_input_with(n, full)
        self.counts["all_gather"] += 1

    # -- node insertion ---------------------------------------------------------------------------
    def _call(self, target, args, kwargs=None, like: Optional[fx.Node] = None) -> fx.Node:
        new = self.g.call_function(target, tuple(args), kwargs or {})
        if like is not None:
            copy_meta(new, like)
        self.inserted.add(new)
        return new

    def _local(self, x: fx.Node, dim: int, spec: ShardSpec, before: fx.Node) -> fx.Node:
        """Slice a replicated full tensor ``x`` to this rank's part along ``dim``."""
        with self.g.inserting_before(before):
            pieces, start = [], 0
            for s in spec.segments:
                c = s // self.tp
                pieces.append(self._call(aten.slice.Tensor, (x, dim, start + self.rank * c, start + (self.rank + 1) * c), like=before))
                start += s
            self.counts["slices"] += 1
            return pieces[0] if len(pieces) == 1 else self._call(aten.cat.default, (pieces, dim), like=before)

    def _gather(self, x: fx.Node, spec: ShardSpec, before: fx.Node) -> fx.Node:
        """All-gather sharded ``x`` back to the full tensor (inserted before ``before``)."""
        full_shape = list(x.meta["val"].shape)  # still the full shape: meta is re-derived at the end
        d, tp = spec.dim, self.tp
        local_shape = list(full_shape)
        local_shape[d] = spec.local(tp)
        with self.g.inserting_before(before):
            y = self._call(aten.movedim.int, (x, d, 0), like=before) if d else x
            y = self._call(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, like=before)
            y = self._call(c10d.all_gather_into_tensor.default, (y, tp, self.group_name), like=before)
            y = self._call(c10d.wait_tensor.default, (y,), like=before)
            rest = [s for i, s in enumerate(local_shape) if i != d]
            if len(spec.segments) > 1:  # rank-major [seg0_r, seg1_r, ...] -> segment-major
                loc = list(spec.local_segments(tp))
                y = self._call(aten.reshape.default, (y, [tp, spec.local(tp)] + rest), like=before)
                parts = self._call(aten.split_with_sizes.default, (y, loc, 1), like=before)
                pieces = []
                for j, lj in enumerate(loc):
                    p = self._call(operator.getitem, (parts, j), like=before)
                    pieces.append(self._call(aten.reshape.default, (p, [tp * lj] + rest), like=before))
                y = self._call(aten.cat.default, (pieces, 0), like=before)
            y = self._call(aten.movedim.int, (y, 0, d), like=before) if d else y
        return y

    def _all_reduce(self, x: fx.Node, like: fx.Node) -> fx.Node:
        r = self._call(c10d.all_reduce.default, (x, "sum", self.group_name), like=like)
        return self._call(c10d.wait_tensor.default, (r,), like=like)

    # -- propagation -----------------------------------------------------------------------------
    def repropagate(self) -> None:
        """Recompute meta['val'] of every node whose inputs or arguments changed (graph order), running
        its target on the fake inputs in the graph's fake mode (the one of the new parameters)."""
        import torch.utils._pytree as pytree

        from ..infra.graph_utils import fake_of

        dirty = set(self.inserted) | set(self.spec)
        dirty |= {n for n in self.g.nodes if n.op == "get_attr" and n.target in self.new_params}
        modes = [n.meta["val"].fake_mode for n in self.g.nodes
                 if n.op in ("placeholder", "get_attr") and hasattr(n.meta.get("val"), "fake_mode")]
        if not modes:
            raise PassError("tensor_parallel: the graph carries no fake values to propagate shapes with")
        for n in self.g.nodes:
            if n.op == "get_attr" or n.op != "call_function" or n.meta.get("dit_no_val"):
                continue
            if n not in dirty and not any(a in dirty for a in n.all_input_nodes):
                continue
            dirty.add(n)
            args, kwargs = pytree.tree_map(fake_of, (n.args, n.kwargs))
            with modes[0]:
                n.meta["val"] = n.target(*args, **kwargs)
