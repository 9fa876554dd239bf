"""TeaCache: timestep-embedding-aware caching (Liu et al. 2024) as a graph pass (device decision, ``torch.cond``).

Requires: ``structure``. Provides: the cache branch (facts ``state_io``, ``cache_cut``, ``structure_at_cut``).
Invalidates: ``structure``. diffusers ships no TeaCache hook: the rule is the paper's
(:class:`~dit_passes.cache.peer_rules_gating.TeaProgram`; tested against a pure-python transcription of it).
Same rewrite as ``MagCache`` (:mod:`~dit_passes.passes.cache_branch`; the whole block range is cached:
Fn=0, Bn=0). The decision reads the first block's timestep-modulated input ``LN(x) * (1 + scale) + shift``:
the first node of block 0 with the image stream's shape that depends on both the image stream and the
timestep (extended by the ``+ shift`` that follows it). As the paper's implementation calls the first
block's norm before the blocks, the pass copies that node and the nodes of block 0 it depends on in front
of the branch (the AdaLN projection of the timestep embedding runs twice on a computed step: a few
``[B, D] x [D, 6D]`` products).

Before (three blocks)::

    h0 = x_embedder(hidden_states)
    h1 = <block 0>(h0, temb)            # norm1: mod = LN(h0) * (1 + scale_msa) + shift_msa, ...
    h2 = <block 1>(h1, temb)
    h3 = <block 2>(h2, temb)
    out = proj_out(norm_out(h3))

After::

    h0 = x_embedder(hidden_states)
    mod = LN(h0) * (1 + scale_msa(temb)) + shift_msa(temb)                 # copied from block 0
    decide = self.tea_cache_decide(mod, timestep, *cache_state)      # rel L1, polynomial, accumulator
    use_cache = decide[0]
    cond = torch.ops.higher_order.cond(use_cache, self.tea_cache_cached, self.tea_cache_compute,
                                       (h0, temb, stored_residual))
    h3 = cond[0]                                              # blocks 0..n-1, or h0 + the stored residual
    new_state = self.tea_cache_commit(use_cache, cond[1], *decided_state)
    out = proj_out(norm_out(h3))
    return (out, *new_state, use_cache, accumulated_rescaled_distance)

A block 0 with no such node (no timestep modulation of the image stream) is refused.
"""
from __future__ import annotations

import functools
from typing import Dict, Set

import torch
import torch.fx as fx

from ..infra.pass_base import PassContext, PassError, PassResult
from .cache_branch import PeerCachePass, image_stream_index, insert_cache_branch
from .segments import MiddleSegment


def _depends_on(nodes, roots: Set[fx.Node]) -> Set[fx.Node]:
    """The nodes of ``nodes`` (in graph order) that read one of ``roots``, directly or not."""
    out = set(roots)
    for n in nodes:
        if any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def modulated_input(gm: fx.GraphModule, seg: MiddleSegment) -> fx.Node:
    """Block 0's timestep-modulated input in ``seg`` (see the module docstring), or PassError."""
    nodes = list(gm.graph.nodes)
    timestep = [p for p in nodes if p.op == "placeholder" and p.target == "timestep"]
    if not timestep:
        raise PassError("tea_cache: the graph has no 'timestep' input; TeaCache gates on the timestep-modulated "
                        "input of the first block")
    on_image = _depends_on(nodes, {seg.image_in})
    on_time = _depends_on(nodes, set(timestep))
    shape = tuple(seg.image_in.meta["val"].shape)

    def both(n: fx.Node) -> bool:
        val = n.meta.get("val")
        return n in on_image and n in on_time and isinstance(val, torch.Tensor) and tuple(val.shape) == shape

    first = next((n for n in seg.nodes if both(n)), None)
    if first is None:
        raise PassError(f"tea_cache: no value of block 0 depends on both the image stream '{seg.image_in.name}' "
                        f"and the timestep with the stream's shape {shape}: the first block is not "
                        f"timestep-modulated; use FirstBlockCache or MagCache for this model")
    shift = [u for u in first.users if u.target in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor) and both(u)]
    return shift[0] if len(shift) == 1 else first


class TeaCache(PeerCachePass):
    """TeaCache's rule (paper): ``threshold`` (rel_l1_thresh), ``num_inference_steps``, ``coefficients`` (the
    rescaling polynomial, highest degree first; default the paper's FLUX.1 fit). No diffusers peer."""

    name = "tea_cache"
    config_class = "TeaCacheConfig"

    @staticmethod
    def _copy_modulated_input(gm: fx.GraphModule, seg: MiddleSegment, copied: Dict[str, int]) -> fx.Node:
        target = modulated_input(gm, seg)
        inside = set(seg.nodes)
        needed: Set[fx.Node] = set()
        stack = [target]
        while stack:
            n = stack.pop()
            if n in inside and n not in needed:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        env: Dict[fx.Node, fx.Node] = {}
        for n in seg.nodes:  # graph order
            if n in needed:
                env[n] = gm.graph.node_copy(n, lambda a: env.get(a, a))
                env[n].meta.pop("dit_module_path", None)  # not part of block 0 for the structure analysis
                env[n].meta.pop("nn_module_stack", None)
        copied["probe_nodes_copied"] = len(needed)
        return env[target]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.peer_rules_gating import build_tea_program
        from ..cache.store import CacheStore

        copied: Dict[str, int] = {}
        result = insert_cache_branch(gm, ctx, name=self.name, fn=0, bn=0, tag=self.config.strify(),
                                     make_program=functools.partial(build_tea_program, self.config),
                                     make_store=lambda: CacheStore(self.config),
                                     check_segment=functools.partial(image_stream_index, self.name),
                                     decide_input=functools.partial(self._copy_modulated_input, copied=copied))
        result.counts.update(copied)
        return result
