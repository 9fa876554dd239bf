"""PyramidAttentionBroadcast: diffusers' Pyramid Attention Broadcast as a graph pass (one decision per call, a
``torch.cond`` per attention module, the modules' last outputs as graph state).

Requires: the structure's attention sites and the module paths capture records (``meta["dit_module_path"]``), a
``timestep`` input. Provides: state I/O (``state_io``). Invalidates: ``structure`` (attention modules move into
branch subgraphs). The sites are the attention modules whose path matches a kind's identifiers (``re.search``:
spatial, temporal, then cross, for the kinds given a ``block_skip_range``). The rule
(:mod:`~dit_passes.cache.attention_reuse`): a module computes on the generation's first call, outside its kind's
timestep range and on every ``block_skip_range``-th call; otherwise it returns its stored output.

Before::

    a = <attn: to_q/k/v, sdpa, to_out>(n1, rotary)          # nodes with module path transformer_blocks.0.attn

After::

    decide = self.pab_decide(timestep, *scalars)            # reuse_spatial / _temporal / _cross, once per call
    cond = torch.ops.higher_order.cond(reuse_spatial, self.pab_reuse_0, self.pab_compute_0, (n1, rotary, last_0))
    a = cond[0]                                             # the module, or a copy of its last output
    return (out, *scalars', a, ..., use_cache, diff)        # a becomes last_0 for the next call

State per cache context in ``compiled.runtime.state["pab"]`` (the report ``compiled.report("pab")``: a call
counts as cached when any module reused; ``fidelity_stats()["executed_attention_fraction"]``: the fraction of
attention module calls computed).
"""
from __future__ import annotations

from .attention_reuse_branch import AttentionReusePass


class PyramidAttentionBroadcast(AttentionReusePass):
    """diffusers' ``PyramidAttentionBroadcastConfig`` semantics (fields as keywords, or ``config=``)."""

    name = "pab"
    config_class = "PyramidAttentionBroadcastConfig"
    rule = "pab"
    kinds = ("spatial", "temporal", "cross")
