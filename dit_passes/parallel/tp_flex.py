"""Tensor parallelism of a ``flex_attention`` (Kandinsky 6 SR's NABLA mask, Wan-Animate 2, AnyFlow-FAR): heads
sharded, each rank attends its heads with its heads' part of the block mask.

``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_buffers, mask_buffers)`` is
independent per head as long as neither ``score_mod`` nor ``mask_mod`` reads the head index (a rank's local head
``h`` is global head ``rank * H / tp + h``); the block mask's tensors (``kv_num_blocks``, ``kv_indices``, ... of
shape ``(B, H or 1, ...)``) are per head, so a rank takes its heads' rows of them. Before / after (rank 0 of 2)::

    flex_attention = higher_order.flex_attention(q, k, v, score0, (128, 128, kv_num, kv_idx, ..., mask0), ...)
    #   q, k, v: f32[1, 2, 128, 16]; kv_num: i32[1, 2, 2]

    kv_num_0 = aten.slice(kv_num, 1, 0, 1) ...                                  # this rank's head of the mask
    flex_attention = higher_order.flex_attention(q, k, v, score0, (128, 128, kv_num_0, kv_idx_0, ..., mask0), ...)
    #   q, k, v: f32[1, 1, 128, 16] (the heads the sharded projections give)

Refused (a ``ShardingError``, named by the pass): a score or mask function that reads the head index, q / k / v
sharded along another dim, a buffer of the score or mask function that is sharded, block-mask tensors whose head
dim is neither 1 nor the query's heads, kv heads that are neither the query's heads nor 1 (GQA) nor divisible.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .propagate import val
from .tp_plan import divisors

# the head index's position among the placeholders: score_mod(score, b, h, q_idx, kv_idx), mask_mod(b, h, q, kv)
_HEAD_ARG = {"score_mod": 2, "mask_mod": 1}


def _reads_head(rules, fn, which: str) -> bool:
    """Whether the score / mask function ``fn`` (a get_attr of its graph module, or None) uses the head index."""
    if not isinstance(fn, fx.Node) or fn.op != "get_attr":
        return fn is not None  # a function that is not a graph: cannot be read, assume it does
    body = operator.attrgetter(fn.target)(rules.gm)
    holders = [p for p in body.graph.nodes if p.op == "placeholder"]
    i = _HEAD_ARG[which]
    return i < len(holders) and bool(holders[i].users)


def flex_attention(rules, n: fx.Node):
    """The TP rule of a flex attention node: see the module docstring. Returns the outputs' placements."""
    from .tp_sharding import ShardingError, ShardSpec, check_divisible

    q, k, v, score_mod, block_mask = n.args[:5]
    score_buffers, mask_buffers = (tuple(n.args[7]) if len(n.args) > 7 else ()), \
        (tuple(n.args[8]) if len(n.args) > 8 else ())
    specs = [rules._s(a) for a in (q, k, v)]
    heads = int(val(q).shape[1])
    if any(s is not None and s.dim != 1 for s in specs):
        # The usual cause: the heads do not divide over the ranks, so the projections' columns were split without
        # regard to heads and the split landed inside one (flex attention cannot take zero-padded heads).
        cause = (f"its {heads} head(s) do not divide by tp={rules.tp} and flex attention cannot take zero-padded "
                 f"heads; tensor-parallel sizes that divide them: {divisors(heads)}"
                 if heads % rules.tp else
                 "the projections feeding it are split along another dim")
        raise ShardingError(f"flex attention needs q, k, v sharded over heads (dim 1), got dims "
                            f"{[s.dim if s is not None else None for s in specs]}: {cause}")
    check_divisible([heads], rules.tp, "flex attention query heads")
    for fn, which in ((score_mod, "score_mod"), (block_mask[-1] if block_mask else None, "mask_mod")):
        if _reads_head(rules, fn, which):
            raise ShardingError(f"the flex attention's {which} reads the head index, which is local on each rank")
    if any(rules._s(b) is not None for b in score_buffers + mask_buffers if isinstance(b, fx.Node)):
        raise ShardingError("a buffer of the flex attention's score / mask function is sharded")
    for a, s in zip((q, k, v), specs):
        h = int(val(a).shape[1])
        if s is None and h > 1:  # replicated (or GQA kv heads): this rank's heads
            if h != heads and h % rules.tp:
                raise ShardingError(f"flex attention kv heads {h} do not divide by tp={rules.tp}")
            n.replace_input_with(a, rules._local(a, 1, ShardSpec(1, (h,)), n))
    local_mask = []
    for t in block_mask:
        if isinstance(t, fx.Node) and isinstance(val(t), torch.Tensor) and val(t).dim() >= 2 \
                and int(val(t).shape[1]) > 1:
            if int(val(t).shape[1]) != heads:
                raise ShardingError(f"block-mask tensor {t.name} has {int(val(t).shape[1])} heads, the query "
                                    f"{heads}")
            t = rules._local(t, 1, ShardSpec(1, (heads,)), n)
        local_mask.append(t)
    n.args = n.args[:4] + (tuple(local_mask),) + n.args[5:]
    out = specs[0] or ShardSpec(1, (heads,))
    return [out if isinstance(x, torch.Tensor) and x.dim() >= 2 else None for x in val(n)]


__all__ = ["flex_attention"]
