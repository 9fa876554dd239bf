"""FirstBlockCache: diffusers' First Block Cache as a graph pass (decision on the device, ``torch.cond``).

Requires: ``structure``. Provides: the cache branch (facts ``state_io``, ``cache_cut``, ``structure_at_cut``).
Invalidates: ``structure``. Same rewrite as ``DBCache`` (:mod:`~dit_passes.passes.cache_branch`) with the
cut diffusers' hook uses (the first block always runs, every later block is cached: Fn=1, Bn=0) and its
rule (:class:`~dit_passes.cache.peer_rules.FirstBlockProgram`): cache iff a first-block residual of a
computed step is stored and ``mean|R - R_prev| / mean|R_prev| <= threshold``; no warm-up, no caps.

Before (three blocks)::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)
    h2 = <block 1>(h1, temb)
    h3 = <block 2>(h2, temb)
    out = proj_out(norm_out(h3))

After::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)                                              # the first block always runs
    fn_residual = h1 - h0
    decide = self.first_block_cache_decide(fn_residual, timestep, *cache_state)
    use_cache = decide[0]
    cond = torch.ops.higher_order.cond(use_cache, self.first_block_cache_cached,
                                       self.first_block_cache_compute, (h1, temb, cached_residual))
    h3 = cond[0]                                            # blocks 1..n-1, or h1 + the stored residual
    new_state = self.first_block_cache_commit(use_cache, cond[1], *decided_state)
    out = proj_out(norm_out(h3))
    return (out, *new_state, use_cache, diff)

State per cache context in ``compiled.runtime.state["first_block_cache"]`` (a ``CacheStore``, also the
report ``compiled.report("first_block_cache")``: per-step decisions and diffs).
"""
from __future__ import annotations

import functools

import torch.fx as fx

from ..infra.pass_base import PassContext, PassResult
from .cache_branch import PeerCachePass, insert_cache_branch


class FirstBlockCache(PeerCachePass):
    """diffusers' ``FirstBlockCacheConfig`` semantics (``threshold``, default 0.05)."""

    name = "first_block_cache"
    config_class = "FirstBlockCacheConfig"

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.peer_rules import build_first_block_program
        from ..cache.store import CacheStore

        return insert_cache_branch(gm, ctx, name=self.name, fn=1, bn=0, tag=self.config.strify(),
                                   make_program=functools.partial(build_first_block_program, self.config),
                                   make_store=lambda: CacheStore(self.config))
