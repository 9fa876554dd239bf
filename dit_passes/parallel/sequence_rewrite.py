"""The rewrite half of sequence sharding: a :class:`~dit_passes.parallel.sequence_sharding.ShardingPlan`
applied to the graph. Inserts ``shard_sequence`` for the streams entering block 0 (prologue) and for
replicated full-length operands (after their definition, cached), ``permute_sequence`` for masks, the
distributed attention in place of each SDPA, an all-reduce after each partial sum over the tokens,
``gather_sequence`` for values leaving the block range (epilogue) or read by non-local ops (in the memory
order the value had, which later views may rely on), and this rank's copy of each context region's body
(rewritten the same way); then recomputes ``meta["val"]``, layouts included: an op that fails on its
rewritten inputs is a :class:`~dit_passes.parallel.propagate.PropagationError` here, before anything runs.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from . import op_classes as oc
from . import sequence_ops as ops
from .propagate import c10d
from .ulysses_async import ISSUE_ORDER, AsyncUlysses, overlap
from .propagate import Propagation, map_args as _map_args, memory_order, repropagate, val
from .sequence_plan import Sharded, ShardingPlan, _Gather, _Permute, _Slice

__all__ = ["apply_plan"]


def _runs_args(runs) -> Tuple[List[int], List[int]]:
    return [r[0] for r in runs], [r[1] for r in runs]


def _order_arg(node: fx.Node) -> tuple:
    """``(order,)`` when the traced value is not contiguous (a copy of it must keep its memory order), else ()."""
    order = memory_order(val(node))
    return () if list(order) == list(range(len(order))) else (list(order),)


def apply_plan(gm: fx.GraphModule, plan: ShardingPlan, group_name: str, attention_op: Callable,
               attention_groups: Sequence[str], async_ulysses: Optional[AsyncUlysses] = None) -> Dict[str, int]:
    """Rewrite ``gm`` in place as ``plan`` says. ``group_name`` names the group whose ranks share the
    sequence (the gathers and all-reduces run on it); each distributed attention becomes ``attention_op`` (a
    :mod:`~dit_passes.parallel.sequence_ops` wrapper) on the groups named ``attention_groups``. Returns
    counts of what was inserted. ``async_ulysses`` (Ulysses, or USP: the first of ``attention_groups``): each
    attention's q / k / v all-to-alls become graph nodes overlapped with the projections
    (:mod:`~dit_passes.parallel.ulysses_async`)."""
    counts = dict(inputs_sharded=0, operands_sliced=0, masks_permuted=0, attention_replaced=0, attention_local=0,
                  outputs_gathered=0, nonlocal_gathers=0, all_reduce=0, regions=0, async_overlapped=0,
                  async_in_order=0)
    rewrite = _Rewrite(gm, plan, group_name, attention_op, attention_groups, counts)
    rewrite.async_ulysses = async_ulysses
    rewrite.shard_streams()
    rewrite.region()
    rewrite.exits()
    rewrite.repropagate()
    gm.graph.lint()
    gm.recompile()
    return counts


class _Rewrite:
    """One graph's rewrite (the top graph, or a context region's body with its own plan)."""

    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, group_name: str, attention_op: Callable,
                 attention_groups: Sequence[str], counts: Dict[str, int], body: bool = False):
        self.gm, self.g, self.plan, self.spec = gm, gm.graph, plan, plan.spec
        # the streams whose full value stays in the graph beside their shard (a body's inputs are the shards)
        self.full = set() if body else set(plan.streams) | set(plan.late_streams)
        self.group_name, self.attention_op, self.attention_groups = group_name, attention_op, attention_groups
        self.counts = counts
        self.async_ulysses: Optional[AsyncUlysses] = None
        self.pos = {n: i for i, n in enumerate(self.g.nodes)}
        self.first = plan.region[0]
        self.prop = Propagation(gm, group_name, self.spec.world, self.spec.rank)  # what it inserts
        self.shape_fns: Dict[fx.Node, Callable] = {}
        self.cache: Dict[Any, fx.Node] = {}
        self.now: Dict[fx.Node, fx.Node] = {}  # a sharded stream -> its shard; a partial sum -> its all-reduce
        # an SDPA -> the distributed attention that replaced it (and was erased): a gather planned on the SDPA's
        # output (a non-local reader, as Mochi's pad of each sample's valid tokens) reads the replacement
        self.replaced: Dict[fx.Node, fx.Node] = {}

    def new_node(self, target, args, like: fx.Node) -> fx.Node:
        node = self.prop.emit(target, args, like=like)
        if like.op != "call_function" or self.pos.get(like, -1) < self.pos[self.first]:
            node.meta["dit_module_path"] = ""  # inserted before block 0: part of the prologue
        return node

    def gather(self, node: fx.Node, layout: Sharded, after: fx.Node, traced: Optional[fx.Node] = None) -> fx.Node:
        """All-gather ``node`` (sharded as ``layout``) in the memory order of ``traced`` (default ``node``: the
        value the graph was traced with, whose later views may rely on its strides)."""
        spec = self.spec
        with self.g.inserting_after(after):
            new = self.new_node(ops.gather_sequence, (node, layout.dim, self.group_name,
                                                      list(spec.rank_lengths(layout.segments)),
                                                      *_runs_args(spec.inverse_runs(layout.segments)),
                                                      *_order_arg(traced or node)), like=node)
        self.shape_fns[new] = ops.gather_sequence_shape
        return new

    def point_after(self, a: fx.Node):
        # after the source (inside the block that computes it), or before block 0 for prologue values;
        # the new node takes the source's module path, so block ranges stay contiguous
        if a.op != "call_function" or self.pos.get(a, 0) < self.pos[self.first]:
            return self.g.inserting_before(self.first)
        return self.g.inserting_after(a)

    def shard_streams(self) -> None:
        for s, lay in self.plan.streams.items():
            with self.g.inserting_before(self.first):
                self.now[s] = self.new_node(ops.shard_sequence, (s, lay.dim, *_runs_args(self.spec.local_runs(
                    lay.segments))), s)
            self.counts["inputs_sharded"] += 1

    def materialise(self, m):
        if isinstance(m, fx.Node):
            return self.now.get(m, m)
        if isinstance(m, (_Slice, _Permute)):  # markers are frozen dataclasses: one node per distinct marker
            if m not in self.cache:
                slice_ = isinstance(m, _Slice)
                op, dims, runs = ((ops.shard_sequence, m.dim, self.spec.local_runs(m.segments)) if slice_ else
                                  (ops.permute_sequence, list(m.dims), self.spec.permutation_runs(m.segments)))
                extra = _order_arg(m.node) if slice_ and len(runs) > 1 else ()
                with self.point_after(m.node):
                    self.cache[m] = self.new_node(op, (m.node, dims, *_runs_args(runs), *extra), m.node)
                self.counts["operands_sliced" if slice_ else "masks_permuted"] += 1
            return self.cache[m]
        if isinstance(m, _Gather):
            if m.node in self.full:
                return m.node  # the full stream is still there
            if m not in self.cache:
                src = self.replaced.get(m.node, m.node)
                self.cache[m] = self.gather(src, m.layout, after=src, traced=m.node)
                self.counts["nonlocal_gathers"] += 1
            return self.cache[m]
        return m

    def region(self) -> None:
        attention_of = {d.node: d for d in self.plan.attention}
        reduced = set(self.plan.reduced)
        late: Dict[fx.Node, List[Tuple[fx.Node, Sharded]]] = {}
        for s, (at, lay) in self.plan.late_streams.items():
            late.setdefault(at, []).append((s, lay))
        for n in self.plan.region:
            for s, lay in late.get(n, ()):  # a later block list's stream: its readers from here on take the shard
                with self.g.inserting_before(n):
                    self.now[s] = self.new_node(ops.shard_sequence, (s, lay.dim, *_runs_args(self.spec.local_runs(
                        lay.segments))), n)
                self.counts["inputs_sharded"] += 1
            if n in attention_of:
                self.attention(n, attention_of[n])
                continue
            if n in self.plan.bodies:
                self.body(n, *self.plan.bodies[n])
                continue
            target, args, kwargs = self.plan.edits.get(n, (n.target, n.args, n.kwargs))
            n.target = target
            n.args = _map_args(tuple(args), self.materialise)
            n.kwargs = _map_args(dict(kwargs), self.materialise)
            if n in reduced:  # this rank's partial sum over its tokens: the sum over the group is the full one
                with self.g.inserting_before(n.next):  # (inserting_after(n) would put each new node next to n)
                    total = self.prop.all_reduce(n, like=n)
                reduce_node = total.args[0]
                n.replace_all_uses_with(total, delete_user_cb=lambda u: u is not reduce_node)
                self.now[n] = total
                self.counts["all_reduce"] += 1

    def attention(self, n: fx.Node, d) -> None:
        q, k, v, mask = (self.materialise(x) for x in (d.q, d.k, d.v, d.mask))
        if d.distributed and self.async_ulysses:
            self.async_attention(n, d, q, k, v, mask)
        elif d.distributed:
            with self.g.inserting_before(n):
                new = self.prop.emit(self.attention_op, (q, k, v, mask, *self.attention_groups,
                                                         list(self.spec.rank_lengths(d.layout.segments)), d.scale,
                                                         list(d.out_order)), like=n)
            self.shape_fns[new] = ops.attention_shape
            n.replace_all_uses_with(new)
            self.g.erase_node(n)
            self.replaced[n] = new
            self.counts["attention_replaced"] += 1
        else:  # queries over full keys / values (cross-attention, or keys gathered): SDPA on the local queries
            n.args = (q, k, v, mask) + tuple(n.args[4:])
            n.kwargs = {key: value for key, value in n.kwargs.items() if key != "attn_mask"}
            self.counts["attention_local"] += 1

    def async_attention(self, n: fx.Node, d, q, k, v, mask) -> None:
        """Ulysses with each input's all-to-all issued after its input, waited for before the attention, and the
        chains reordered so that each all-to-all runs while the next input is projected."""
        form = self.async_ulysses
        sizes = list(self.spec.rank_lengths(d.layout.segments))
        world, block = form.size, self.spec.rank // form.size  # USP: this rank's ring block of Ulysses shards
        inner, local = sizes[block * world:(block + 1) * world], sizes[self.spec.rank]
        batch, heads = (int(s) for s in val(d.q).shape[:2])
        rows_op = ops.ulysses_fp8_rows if form.float8 else ops.ulysses_rows
        sent = {}
        for role, x in zip("qkv", (q, k, v)):
            with self.point_after(x):
                rows = self.prop.emit(rows_op, (x, batch, heads, world), like=n)
            with self.g.inserting_after(rows):
                sent[role] = self.prop.emit(c10d.all_to_all_single.default,
                                            (rows, inner, [local] * world, self.attention_groups[0]), like=n)
        with self.g.inserting_before(n):
            waits = {role: self.prop.emit(c10d.wait_tensor.default, (sent[role],), like=n) for role in ISSUE_ORDER}
            got = dict(waits)
            if form.float8:  # each back in the dtype it was projected in, as synchronous float8 Ulysses does
                got = {role: self.prop.emit(ops.from_fp8_rows, (waits[role], val(getattr(d, role)).dtype), like=n)
                       for role in ISSUE_ORDER}
            new = self.prop.emit(form.received_op, (got["q"], got["k"], got["v"], mask, *self.attention_groups,
                                                    sizes, d.scale, list(d.out_order), heads), like=n)
        self.shape_fns[new] = ops.received_shape
        n.replace_all_uses_with(new)
        self.g.erase_node(n)
        self.replaced[n] = new
        self.counts["attention_replaced"] += 1
        moved = overlap(self.g, waits[ISSUE_ORDER[0]], [sent[role] for role in ISSUE_ORDER])
        self.counts["async_overlapped" if moved else "async_in_order"] += 1

    def body(self, n: fx.Node, body: fx.GraphModule, plan: ShardingPlan) -> None:
        """Rewrite this rank's copy of a context region's body, call it instead of the original; its values
        are recomputed when the call's are (the call's shape function repropagates the body)."""
        inner = _Rewrite(body, plan, self.group_name, self.attention_op, self.attention_groups, self.counts, body=True)
        inner.async_ulysses = self.async_ulysses
        inner.region()
        at = oc.CONTEXT_WRAPPERS[n.target]
        old = n.args[at]
        name = _free_name(self.gm, f"{old.target}_rank{self.spec.rank}")
        self.gm.add_submodule(name, body)
        with self.g.inserting_before(n):
            new = self.g.get_attr(name)
        n.args = tuple(_map_args(tuple(n.args[:at]), self.materialise)) + (new,) + tuple(
            _map_args(tuple(n.args[at + 1:]), self.materialise))
        if not old.users:
            self.g.erase_node(old)
            if not any(m.op == "get_attr" and m.target == old.target for m in self.g.nodes):
                self.gm.delete_submodule(old.target)  # the original body: no call reads it any more
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        (out,) = [p for p in body.graph.nodes if p.op == "output"]
        touched = inner.prop.inserted | set(plan.edits) | set(plan.layouts) | set(plan.reduced)

        def body_val(*args):
            for p, a in zip(placeholders, args[at + 1:]):
                p.meta["val"] = a
            repropagate(body.graph, touched, inner.shape_fns, changed=placeholders, strides=True)
            body.graph.lint()
            body.recompile()
            return tuple(val(o) for o in out.args[0])
        self.shape_fns[n] = body_val
        self.counts["regions"] += 1

    def exits(self) -> None:
        region_set = set(self.plan.region)
        last = self.plan.region[-1]
        for n in self.plan.exits:
            gathered = self.gather(n, self.plan.layouts[n], after=last)
            gathered.meta["dit_module_path"] = ""  # after the last block: epilogue
            n.replace_all_uses_with(gathered, delete_user_cb=lambda u: u not in region_set and u is not gathered)
            self.counts["outputs_gathered"] += 1

    def repropagate(self) -> None:
        plan = self.plan
        touched = self.prop.inserted | set(plan.edits) | set(plan.layouts) | set(plan.bodies) | set(plan.reduced)
        repropagate(self.g, touched, self.shape_fns, strides=True)


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name
