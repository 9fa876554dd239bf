"""DBCache: skip the middle blocks on steps where the first blocks' residual barely changed.

Requires: ``structure`` (block discovery). Provides: ``cache_branch``. Invalidates: ``structure``
(the middle blocks move into a branch subgraph). Runs after the parallel and quantization passes, so the
blocks it moves into the branch are already rewritten.

Before (Fn=1, Bn=0, three blocks)::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)
    h2 = <block 1>(h1, temb)
    h3 = <block 2>(h2, temb)
    out = proj_out(norm_out(h3))

After::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)                                   # Fn blocks always run
    fn_residual = h1 - h0
    decide = self.dbcache_decide(fn_residual, timestep, *cache_state)   # device-side, no .item()
    use_cache = decide[0]
    cond = torch.ops.higher_order.cond(use_cache, self.dbcache_cached, self.dbcache_compute,
                                       (h1, temb, cached_residual))
    h3 = cond[0]                                                # middle blocks or h1 + cached residual
    new_state = self.dbcache_commit(use_cache, cond[1], *state)  # residual stored on compute steps
    out = proj_out(norm_out(h3))
    return (out, *new_state, use_cache, diff)                  # state out: CompiledDiT keeps it

With a calibrator (TaylorSeer, FoCa, DMD) the cached residual is a prediction, formed in the cached arm only::

    decide = self.dbcache_decide(fn_residual, timestep, *cache_state)   # use_cache, diff, *decided_state
    cond = torch.ops.higher_order.cond(use_cache, self.dbcache_cached, self.dbcache_compute,
                                       (h1, temb, step, last_compute_step, *ladder))
    # dbcache_cached: predicted = self.hit(step, last_compute_step, *ladder); h3 = h1 + predicted[0]

The rewrite itself is :func:`~dit_passes.passes.cache_branch.insert_cache_branch` (shared with the other
block-range caches); this pass supplies the cut (Fn, Bn) and cache-dit's rule (``DBCacheProgram``).
The state tensors travel as extra graph inputs and outputs (not buffers mutated inside the branch):
``torch.cond`` branches must be pure, and the caller-visible :class:`~dit_passes.cache.store.CacheStore`
(``compiled.runtime.state["dbcache"]``, also its report: ``compiled.report("dbcache")``) holds them per cache context (cond / uncond / CFG parity).
With ``enable_separate_cfg=None`` the state is kept per CFG branch, the branch told apart in the graph from each
call's timestep and latents (:mod:`dit_passes.cache.branches`, ``passes.cache_branch.route_branches``).
"""
from __future__ import annotations

import functools
from typing import Any, Dict

import torch.fx as fx

from ..infra.pass_base import Pass, PassContext, PassResult
from ..infra.phases import Phase
from .cache_branch import insert_cache_branch, said_if_never_cached


class DBCache(Pass):
    """The reference's DBCache (same field names and defaults as cache-dit's ``DBCacheConfig``)."""

    name = "dbcache"
    phase = Phase.CACHE
    reads = ("structure", "offload_loads", "parallel_group", "num_user_outputs")
    writes = ("num_user_outputs", "state_io", "inference_only", "structure_at_cut", "cache_cut")
    invalidates = ("structure",)

    def __init__(self, config=None, calibrator=None, **fields: Any):
        from ..cache.config import DBCacheConfig
        if config is not None and fields:
            raise TypeError("pass either config=DBCacheConfig(...) or its fields as keywords, not both")
        self.config = config if config is not None else DBCacheConfig(**fields)
        self.calibrator = calibrator

    def config_items(self) -> Dict[str, Any]:
        return {"tag": self.config.strify() + ("" if self.calibrator is None else f"_{self.calibrator.strify()}")}

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.branches import split_for
        from ..cache.program import build_program
        from ..cache.store import CacheStore

        result = insert_cache_branch(
            gm, ctx, name=self.name, fn=self.config.Fn_compute_blocks, bn=self.config.Bn_compute_blocks,
            tag=self.config.strify(), make_program=functools.partial(build_program, self.config, self.calibrator),
            make_store=lambda: CacheStore(self.config, self.calibrator), split=split_for(self.config))
        return said_if_never_cached(self.name, self.config, result)
