"""MagCache: diffusers' MagCache as a graph pass (decision on the device, ``torch.cond``), with calibration.

Requires: ``structure``. Provides: the cache branch (facts ``state_io``, ``cache_cut``, ``structure_at_cut``).
Invalidates: ``structure``. Same rewrite as ``DBCache`` (:mod:`~dit_passes.passes.cache_branch`) with
diffusers' cut for MagCache (the whole block range is skipped: Fn=0, Bn=0) and its rule
(:class:`~dit_passes.cache.peer_rules.MagProgram`): the decision reads no activation, only the stored
magnitude ratios and three accumulators (ratio, error, skipped steps) carried as state. The ratios are a
state tensor too (a constant table, indexed by the step on the device). ``MagCacheConfig(calibrate=True)``
never skips and measures the ratios instead: ``compiled.report("mag_cache").mag_ratios()``.

Before (three blocks)::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)
    h2 = <block 1>(h1, temb)
    h3 = <block 2>(h2, temb)
    out = proj_out(norm_out(h3))

After::

    h0 = x_embedder(hidden_states)
    decide = self.mag_cache_decide(h0, timestep, *cache_state)    # ratios[step], accumulators: no activation
    use_cache = decide[0]
    cond = torch.ops.higher_order.cond(use_cache, self.mag_cache_cached, self.mag_cache_compute,
                                       (h0, temb, stored_residual))
    h3 = cond[0]                                              # blocks 0..n-1, or h0 + the stored residual
    new_state = self.mag_cache_commit(use_cache, cond[1], *decided_state)   # residual (+ calibration ratio)
    out = proj_out(norm_out(h3))
    return (out, *new_state, use_cache, accumulated_error)

Streams other than the image stream leave the range unchanged on a skipped step (diffusers returns the
block inputs). A range whose leaving streams do not keep their entering shapes is refused (diffusers'
shape heuristics for joined sequences are not reproduced).
"""
from __future__ import annotations

import functools

import torch.fx as fx

from ..infra.pass_base import PassContext, PassResult
from .cache_branch import PeerCachePass, image_stream_index, insert_cache_branch


class MagCache(PeerCachePass):
    """diffusers' ``MagCacheConfig`` semantics (``threshold``, ``max_skip_steps``, ``retention_ratio``,
    ``num_inference_steps``, ``mag_ratios``, ``calibrate``)."""

    name = "mag_cache"
    config_class = "MagCacheConfig"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.peer_rules import MagCacheStore, build_mag_program

        return insert_cache_branch(gm, ctx, name=self.name, fn=0, bn=0, tag=self.config.strify(),
                                   make_program=functools.partial(build_mag_program, self.config),
                                   make_store=lambda: MagCacheStore(self.config),
                                   check_segment=functools.partial(image_stream_index, self.name))
