"""The rewrite half of sequence sharding: a :class:`~dit_passes.parallel.sequence_sharding.ShardingPlan`
applied to the graph. Inserts ``shard_sequence`` for the streams entering block 0 (prologue) and for
replicated full-length operands (after their definition, cached), ``permute_sequence`` for masks, the
distributed attention in place of each SDPA, and ``gather_sequence`` for values leaving the block range
(epilogue) or read by non-local ops; then recomputes ``meta["val"]``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch.fx as fx

from . import sequence_ops as ops
from .propagate import Propagation, map_args as _map_args, repropagate
from .sequence_sharding import Sharded, ShardingPlan, _Gather, _Permute, _Slice

__all__ = ["apply_plan"]


def _runs_args(runs) -> Tuple[List[int], List[int]]:
    return [r[0] for r in runs], [r[1] for r in runs]


def apply_plan(gm: fx.GraphModule, plan: ShardingPlan, group_name: str, attention_op: Callable,
               attention_groups: Sequence[str]) -> Dict[str, int]:
    """Rewrite ``gm`` in place as ``plan`` says. ``group_name`` names the group whose ranks share the
    sequence (the gathers run on it); each distributed attention becomes ``attention_op`` (a
    :mod:`~dit_passes.parallel.sequence_ops` wrapper) on the groups named ``attention_groups``. Returns
    counts of what was inserted."""
    g, spec = gm.graph, plan.spec
    pos = {n: i for i, n in enumerate(g.nodes)}
    first, last = plan.region[0], plan.region[-1]
    counts = dict(inputs_sharded=0, operands_sliced=0, masks_permuted=0, attention_replaced=0, attention_local=0,
                  outputs_gathered=0, nonlocal_gathers=len(plan.nonlocal_ops))
    prop = Propagation(gm, group_name, spec.world, spec.rank)  # what it inserts
    shape_fns: Dict[fx.Node, Callable] = {}
    cache: Dict[Any, fx.Node] = {}

    def new_node(target, args, like: fx.Node) -> fx.Node:
        node = prop.emit(target, args, like=like)
        if like.op != "call_function" or pos.get(like, -1) < pos[first]:
            node.meta["dit_module_path"] = ""  # inserted before block 0: part of the prologue
        return node

    def gather(node: fx.Node, layout: Sharded, after: fx.Node) -> fx.Node:
        with g.inserting_after(after):
            new = new_node(ops.gather_sequence, (node, layout.dim, group_name, list(spec.rank_lengths(layout.segments)),
                                                 *_runs_args(spec.inverse_runs(layout.segments))), like=node)
        shape_fns[new] = ops.gather_sequence_shape
        return new

    def point_after(a: fx.Node):
        # after the source (inside the block that computes it), or before block 0 for prologue values;
        # the new node takes the source's module path, so block ranges stay contiguous
        return g.inserting_before(first) if a.op != "call_function" or pos.get(a, 0) < pos[first] else g.inserting_after(a)

    stream_shard: Dict[fx.Node, fx.Node] = {}
    for s, lay in plan.streams.items():
        with g.inserting_before(first):
            stream_shard[s] = new_node(ops.shard_sequence, (s, lay.dim, *_runs_args(spec.local_runs(lay.segments))), s)
        counts["inputs_sharded"] += 1

    def materialise(m):
        if isinstance(m, fx.Node):
            return stream_shard.get(m, m)
        if isinstance(m, (_Slice, _Permute)):  # markers are frozen dataclasses: one node per distinct marker
            if m not in cache:
                slice_ = isinstance(m, _Slice)
                op, dims, runs = ((ops.shard_sequence, m.dim, spec.local_runs(m.segments)) if slice_ else
                                  (ops.permute_sequence, list(m.dims), spec.permutation_runs(m.segments)))
                with point_after(m.node):
                    cache[m] = new_node(op, (m.node, dims, *_runs_args(runs)), m.node)
                counts["operands_sliced" if slice_ else "masks_permuted"] += 1
            return cache[m]
        if isinstance(m, _Gather):
            if m.node in stream_shard:
                return m.node  # the full stream is still there
            if m not in cache:
                cache[m] = gather(m.node, m.layout, after=m.node)
            return cache[m]
        return m

    attention_of = {d.node: d for d in plan.attention}
    for n in plan.region:
        if n in attention_of:
            d = attention_of[n]
            q, k, v, mask = (materialise(x) for x in (d.q, d.k, d.v, d.mask))
            if d.distributed:
                with g.inserting_before(n):
                    new = prop.emit(attention_op, (q, k, v, mask, *attention_groups,
                                                   list(spec.rank_lengths(d.layout.segments)), d.scale,
                                                   list(d.out_order)), like=n)
                shape_fns[new] = ops.attention_shape
                n.replace_all_uses_with(new)
                g.erase_node(n)
                counts["attention_replaced"] += 1
            else:  # cross-attention over replicated keys: stays SDPA on the local queries
                n.args = (q, k, v, mask) + tuple(n.args[4:])
                n.kwargs = {key: val for key, val in n.kwargs.items() if key != "attn_mask"}
                counts["attention_local"] += 1
            continue
        target, args, kwargs = plan.edits.get(n, (n.target, n.args, n.kwargs))
        n.target = target
        n.args = _map_args(tuple(args), materialise)
        n.kwargs = _map_args(dict(kwargs), materialise)

    region_set = set(plan.region)
    for n in plan.exits:
        gathered = gather(n, plan.layouts[n], after=last)
        gathered.meta["dit_module_path"] = ""  # after the last block: epilogue
        n.replace_all_uses_with(gathered, delete_user_cb=lambda u: u not in region_set and u is not gathered)
        counts["outputs_gathered"] += 1

    repropagate(g, prop.inserted | set(plan.edits) | set(plan.layouts), shape_fns)
    g.lint()
    gm.recompile()
    return counts

