"""FasterCache: diffusers' FasterCache as a graph pass (one decision per call, a ``torch.cond`` per attention
module, each module's last two outputs as graph state, and the CFG part after the model).

Requires: the structure's attention sites, the module paths capture records, a ``timestep`` input; with
``is_guidance_distilled=False`` a batched CFG call (batch 2B, unconditional half first) whose first output is a
``tensor_format`` tensor. Provides: state I/O. Invalidates: ``structure``. The sites are the attention modules
diffusers' hook wraps (paths matching ``^blocks.*attn``, ``^transformer_blocks.*attn``,
``^single_transformer_blocks.*attn``, ``^temporal_transformer_blocks.*attn``, then the kind's identifiers;
cross attention excluded). The rule is :mod:`~dit_passes.cache.attention_reuse`'s.

Before::

    a = <attn>(n1, rotary)
    ...
    return (out0,)

After::

    decide = self.faster_cache_decide(timestep, *scalars)    # skip_uncond, w_low, w_high, first, reuse_spatial ...
    cond = torch.ops.higher_order.cond(reuse_spatial, self.faster_cache_reuse_0, self.faster_cache_compute_0,
                                       (n1, rotary, prev_0, last_0))
    a = cond[0]                                              # the module, or last + (last - prev) * weight
    prev_0', last_0' = self.faster_cache_update_0(first, a, prev_0, last_0)
    ...
    guided = self.faster_cache_guidance(skip_uncond, w_low, w_high, out0, d_low, d_high)   # CFG part only
    return (guided[0], *state', use_cache, diff)

diffusers runs the transformer on the conditional half alone on the calls that approximate the unconditional
half; a graph captured at the CFG batch cannot change its batch, so it runs both halves and replaces the
unconditional one (the same outputs; the skipped attention modules are saved, the rest of the unconditional
half's work is not). State in ``compiled.runtime.state["faster_cache"]``; ``fidelity_stats()`` gives
``executed_attention_fraction``.
"""
from __future__ import annotations

from ..cache.peer_configs import FASTER_SPATIAL_IDENTIFIERS, FASTER_TEMPORAL_IDENTIFIERS
from .attention_reuse_branch import AttentionReusePass


class FasterCache(AttentionReusePass):
    """diffusers' ``FasterCacheConfig`` semantics (fields as keywords, or ``config=``)."""

    name = "faster_cache"
    config_class = "FasterCacheConfig"
    rule = "faster"
    kinds = ("spatial", "temporal")
    prefilter = FASTER_SPATIAL_IDENTIFIERS + FASTER_TEMPORAL_IDENTIFIERS
