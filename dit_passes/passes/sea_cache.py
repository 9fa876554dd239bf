"""SeaCache: diffusers 0.42's SeaCache as a graph pass (decision on the device, ``torch.cond``).

Requires: ``structure``. Provides: the cache branch (facts ``state_io``, ``cache_cut``, ``structure_at_cut``).
Invalidates: ``structure``. Same rewrite as ``MagCache`` (:mod:`~dit_passes.passes.cache_branch`, the whole
block range is cached: Fn=0, Bn=0, as diffusers' leader / tail hooks on the first and last block) with
diffusers' SeaCache rule (:class:`~dit_passes.cache.peer_rules_gating.SeaProgram`): the decision reads the
transformer's ``hidden_states`` input (the SEA indicator is a spectral filter of it, computed on the device)
and the timestep (sigma = timestep / ``timestep_scale``); the accumulated distance, the consecutive-skip
count and a two-entry residual history are state. A skip adds the latest residual, or its linear
extrapolation from the last two computed steps (``residual_order=1``).

What differs from diffusers' hook, by design: the step index is counted on the device from the generation's
first call (diffusers reads ``step_index`` / ``sigma`` / ``num_inference_steps`` from the pipeline's
``cache_context``; here ``num_inference_steps`` and ``timestep_scale`` are config fields); the indicator of a
3-D token input (Flux, QwenImage) is its square token grid (diffusers has no adapter there and never skips);
``raw_vision_callback`` is refused.

Before (three blocks)::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)
    h2 = <block 1>(h1, temb)
    h3 = <block 2>(h2, temb)
    out = proj_out(norm_out(h3))

After::

    h0 = x_embedder(hidden_states)
    decide = self.sea_cache_decide(hidden_states, timestep, *cache_state)   # indicator, gate: on the device
    use_cache = decide[0]
    cond = torch.ops.higher_order.cond(use_cache, self.sea_cache_cached, self.sea_cache_compute,
                                       (h0, temb, residual_to_add))
    h3 = cond[0]                                          # blocks 0..n-1, or h0 + the (extrapolated) residual
    new_state = self.sea_cache_commit(use_cache, cond[1], *decided_state)   # residual history
    out = proj_out(norm_out(h3))
    return (out, *new_state, use_cache, accumulated_distance)
"""
from __future__ import annotations

import functools

import torch.fx as fx

from ..infra.pass_base import PassContext, PassError, PassResult
from .cache_branch import PeerCachePass, image_stream_index, insert_cache_branch
from .segments import MiddleSegment


class SeaCache(PeerCachePass):
    """diffusers' ``SeaCacheConfig`` semantics (``threshold``, ``residual_order``, ``retention_steps``,
    ``cache_end_steps``, ``max_consecutive_cached``, ``power_exp``) plus ``num_inference_steps`` and
    ``timestep_scale`` (what diffusers reads from the cache context)."""

    name = "sea_cache"
    config_class = "SeaCacheConfig"

    def _hidden_states_input(self, gm: fx.GraphModule, seg: MiddleSegment) -> fx.Node:
        from ..cache.peer_rules_gating import sea_latents

        node = next((p for p in gm.graph.nodes if p.op == "placeholder" and p.target == "hidden_states"), None)
        if node is None:
            raise PassError("sea_cache: the graph has no 'hidden_states' input, from which SeaCache's indicator is "
                            "built; use another cache pass for this model")
        try:
            sea_latents(node.meta["val"])
        except ValueError as e:
            raise PassError(f"sea_cache: {e}") from None
        return node

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.peer_rules_gating import build_sea_program
        from ..cache.store import CacheStore

        return insert_cache_branch(gm, ctx, name=self.name, fn=0, bn=0, tag=self.config.strify(),
                                   make_program=functools.partial(build_sea_program, self.config),
                                   make_store=lambda: CacheStore(self.config),
                                   check_segment=functools.partial(image_stream_index, self.name),
                                   decide_input=self._hidden_states_input)
