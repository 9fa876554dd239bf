"""Tensor-parallel rules of attention over sharded heads: SDPA (heads sharded or zero-padded alike in q, k, v; a
replicated input or per-head mask sliced to the rank's heads) and per-head batched matmuls (Kandinsky 6 SR's block
scores, Sana's linear attention). The flex attention's rule is :mod:`~dit_passes.parallel.tp_flex`.
"""
from __future__ import annotations

import torch.fx as fx

from . import tp_padded
from .tp_weights import ShardingError


def sdpa(rules, n: fx.Node):
    """SDPA over heads sharded (or zero-padded) alike in q, k and v: local; a replicated q / k / v or a per-head
    mask sliced to the rank's heads (zero-padded as the padded input's, e.g. Lumina-Next's one kv head repeated
    to the q heads), one kv head left to broadcast."""
    from .tp_sharding import ShardSpec, check_divisible
    q, k, v = n.args[:3]
    specs = [rules._s(a) for a in (q, k, v)]
    if any(s is not None and s.dim != 1 for s in specs):
        raise ShardingError(f"attention needs q, k, v sharded over heads (dim 1), got {specs}")
    padded = next((s for s in specs if s is not None and s.padded), None)
    if padded is not None:  # heads zero-padded (tp_heads)
        tp_padded.check_attention(n, specs, padded)
    for a, s in zip((q, k, v), specs):
        heads = int(a.meta["val"].shape[1])
        if s is None and heads > 1 and padded is not None:  # the rank's real heads, zero-padded as q's
            n.replace_input_with(a, tp_padded.local_operand(rules, a, 1, padded, n))
        elif s is None and heads > 1:  # a replicated q/k/v (computed outside the sharded linears, or GQA k / v
            # repeated to the q heads): take the local heads; one head broadcasts over the q heads as it is
            check_divisible([heads], rules.tp, f"attention input {a.name}")
            n.replace_input_with(a, rules._local(a, 1, ShardSpec(1, (heads,)), n))
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        mv = mask.meta["val"]
        hd = mv.dim() - 3
        if rules._s(mask) is None and hd >= 0 and int(mv.shape[hd]) > 1:
            n.replace_input_with(mask, tp_padded.attention_mask(rules, n, mask, hd, padded) if padded else
                                 rules._local(mask, hd, ShardSpec(hd, (int(mv.shape[hd]),)), n))
    return padded or specs[0] or ShardSpec(1, (int(q.meta["val"].shape[1]),))


def batched_matmul(rules, n: fx.Node):
    """A matmul whose operands are sharded alike along a batch dim (per-head scores of q and k, as
    Kandinsky 6 SR's sparse-mask selection computes), or one of them is and the other is broadcast along it:
    local, the shard in the output's batch dim. None: not that case (all-gathered by the fallback)."""
    a, b = n.args[:2]
    out_dim = n.meta["val"].dim()
    dims, ref = set(), None
    for x in (a, b):
        s, nd = rules._s(x), x.meta["val"].dim()
        if s is not None:
            if s.dim >= nd - 2 or (ref is not None and (s.segments, s.real) != (ref.segments, ref.real)):
                return None
            dims.add(s.dim + out_dim - nd)
            ref = s
    if len(dims) != 1:
        return None
    d = dims.pop()
    for x in (a, b):  # a replicated operand must be broadcast along the batch dim
        nd = x.meta["val"].dim()
        j = d - out_dim + nd
        if rules._s(x) is None and 0 <= j < nd - 2 and int(x.meta["val"].shape[j]) != 1:
            return None
    return ref.with_dim(d)


__all__ = ["batched_matmul", "sdpa"]
