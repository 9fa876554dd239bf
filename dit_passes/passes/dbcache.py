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

The state tensors travel as extra graph inputs and outputs (not buffers mutated inside the branch):
``torch.cond`` branches must be pure, and the caller-visible :class:`~dit_passes.cache.store.CacheStore`
(``compiled.runtime.state["dbcache"]``, also its report: ``compiled.report("dbcache")``) holds them per cache context (cond / uncond / CFG parity).
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..analysis.blocks import get_structure
from ..infra.facts import CacheCut, StateIO, facts_of
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from .segments import MiddleSegment, cut_middle, keep_loads_with_blocks


def _branch(gm: fx.GraphModule, seg: MiddleSegment, k: int, cached: bool) -> fx.GraphModule:
    """The two arms of the cond. Operands: (*live_in, *residual_to_use[k]). Outputs: (*live_out, *residual[k])."""
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    root = torch.nn.Module()
    for a in seg.live_in:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
    res_in = [g.placeholder(f"residual_{i}") for i in range(k)]
    for r, o in zip(res_in, seg.live_out):
        r.meta["val"] = o.meta["val"]
    def base(o: fx.Node):
        """The node the residual of ``o`` is taken against (None: ``o`` is cached whole)."""
        b = seg.before_of[o]
        if len(b.parts) == 1:
            return env[b.parts[0]]
        if not b.parts:
            return None
        return g.call_function(torch.ops.aten.cat.default, ([env[p] for p in b.parts], b.dim))

    if cached:
        outs = []
        for o, r in zip(seg.live_out, res_in):
            against = base(o)
            outs.append(g.call_function(torch.ops.aten.clone.default, (r,)) if against is None
                        else g.call_function(torch.ops.aten.add.Tensor, (against, r)))
        res = [g.call_function(torch.ops.aten.clone.default, (r,)) for r in res_in]  # outputs may not alias inputs
    else:
        from ..infra.graph_utils import _share_attr

        def lookup(a: fx.Node) -> fx.Node:
            if a not in env:
                if a.op != "get_attr":
                    raise PassError(f"dbcache: '{a.name}' is used by the middle blocks but not available")
                _share_attr(gm, root, a.target)
                env[a] = g.get_attr(a.target)
            return env[a]

        for n in seg.nodes:
            env[n] = g.node_copy(n, lookup)
        # both arms must return tensors of the same layout: a stream that leaves the middle as a view (Flux's
        # single blocks end with a slice of the joint sequence) is copied to a fresh contiguous tensor
        outs = [g.call_function(torch.ops.aten.clone.default, (env[o],), {"memory_format": torch.contiguous_format})
                if _is_view_like(o) else env[o] for o in seg.live_out]
        res = []
        for o in seg.live_out:
            against = base(o)
            res.append(g.call_function(torch.ops.aten.clone.default, (env[o],)) if against is None
                       else g.call_function(torch.ops.aten.sub.Tensor, (env[o], against)))
    g.output(tuple(outs + res))
    return fx.GraphModule(root, g, class_name="DBCacheCached" if cached else "DBCacheCompute")


def _is_view_like(n: fx.Node) -> bool:
    v = n.meta["val"]
    return v.storage_offset() != 0 or not v.is_contiguous()


def _fake_call(fn, args, mode):
    from torch.utils._pytree import tree_map
    fakes = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, args)
    with mode:
        return fn(*fakes)


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
        from ..cache.program import build_program
        from ..cache.store import CacheStore

        s = get_structure(gm)
        n = len(s.blocks)
        fn, bn = self.config.Fn_compute_blocks, self.config.Bn_compute_blocks
        if fn + bn >= n:
            raise PassError(f"dbcache: Fn_compute_blocks + Bn_compute_blocks = {fn} + {bn} must be smaller than "
                            f"the number of blocks ({n}, lists {[(b.name, b.count) for b in s.block_lists]}), "
                            f"so that at least one middle block can be cached")
        relocated, outside = keep_loads_with_blocks(gm, s, fn, bn, facts_of(gm).offload_loads)
        seg = cut_middle(gm, s, fn, bn, exclude=outside)
        k = len(seg.live_out)
        g = gm.graph
        mode = detect_fake_mode([a.meta["val"] for a in seg.live_in])
        placeholders = [p for p in g.nodes if p.op == "placeholder"]
        timestep = next((p for p in placeholders if p.target == "timestep"), None)

        group = facts_of(gm).parallel_group  # set by the context/tensor-parallel passes
        program = build_program(self.config, self.calibrator, image_residual=seg.image_at_cut.meta["val"],
                                stream_residuals=[o.meta["val"] for o in seg.live_out],
                                has_timestep=timestep is not None, group=group)
        gm.add_submodule("dbcache_decide", program.decide)
        gm.add_submodule("dbcache_commit", program.commit)
        gm.add_submodule("dbcache_compute", _branch(gm, seg, k, cached=False))
        gm.add_submodule("dbcache_cached", _branch(gm, seg, k, cached=True))

        # state placeholders, after the user inputs
        state_in: List[fx.Node] = []
        with g.inserting_after(placeholders[-1]):
            for spec in reversed(program.input_spec):
                ph = g.placeholder(f"cache_{spec.name}")
                with mode:
                    ph.meta["val"] = torch.empty(spec.shape, dtype=spec.dtype, device=seg.image_at_cut.meta["val"].device)
                state_in.insert(0, ph)

        state_names = [spec.name for spec in program.state_spec]

        def getitems(node: fx.Node, vals, names: Sequence[str]) -> List[fx.Node]:
            out = []
            for i, (v, name) in enumerate(zip(vals, names)):
                it = g.create_node("call_function", operator.getitem, (node, i), name=name)  # readable prints
                it.meta["val"] = v
                out.append(it)
            return out

        first_after = seg.nodes[-1].next
        with g.inserting_before(seg.nodes[0]):
            r = g.create_node("call_function", torch.ops.aten.sub.Tensor, (seg.image_at_cut, seg.image_in),
                              name="fn_residual")
            with mode:
                r.meta["val"] = seg.image_at_cut.meta["val"] - seg.image_in.meta["val"]
            t_arg = timestep if timestep is not None else r
            d_args = (r, t_arg, *state_in)
            dec = g.call_module("dbcache_decide", d_args)
            dec_vals = _fake_call(program.decide, d_args, mode)
            dec.meta["val"] = dec_vals
            dec_items = getitems(dec, dec_vals, ["use_cache", "residual_diff"] + [f"hit_residual_{i}" for i in range(k)]
                                 + [f"decided_{n}" for n in state_names])
            use_cache, diff = dec_items[0], dec_items[1]
            use_res = dec_items[2:2 + k]
            state_mid = dec_items[2 + k:]
            t_graph, f_graph = g.get_attr("dbcache_cached"), g.get_attr("dbcache_compute")
            operands = tuple(seg.live_in) + tuple(use_res)
            cond = g.call_function(torch.ops.higher_order.cond, (use_cache, t_graph, f_graph, operands))
            cond_vals = _fake_call(gm.dbcache_compute, operands, mode)
            cond.meta["val"] = tuple(cond_vals)
            cond_items = getitems(cond, cond_vals, [f"stream_{i}" for i in range(k)] + [f"middle_residual_{i}" for i in range(k)])
        outs, new_res = cond_items[:k], cond_items[k:]
        for o, new in zip(seg.live_out, outs):
            o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in set(seg.nodes))
        with g.inserting_before(first_after):
            c_args = (use_cache, *new_res, *state_mid)
            com = g.call_module("dbcache_commit", c_args)
            com_vals = _fake_call(program.commit, c_args, mode)
            com.meta["val"] = com_vals
            state_out = getitems(com, com_vals, [f"next_{n}" for n in state_names])
        for node in reversed(seg.nodes):
            g.erase_node(node)
        out_node = g.output_node()
        user_outs = list(out_node.args[0])
        facts = facts_of(gm)
        prev_user = facts.num_user_outputs if facts.num_user_outputs is not None else len(user_outs)
        out_node.args = (tuple(user_outs[:prev_user]) + tuple(user_outs[prev_user:]) + tuple(state_out) + (use_cache, diff),)
        g.eliminate_dead_code()
        gm.recompile()

        cut = CacheCut(fn, bn, n, len(seg.nodes), k)
        store = ctx.runtime.state.setdefault(self.name, CacheStore(self.config, self.calibrator))
        ctx.runtime.register_report(self.name, store)
        graph_id = ctx.graph_id
        store.register_graph(graph_id, program, seg.image_at_cut.meta["val"].device, cut)
        facts.num_user_outputs = prev_user
        facts.inference_only = True
        facts.structure_at_cut = s
        facts.state_io.append(StateIO(inputs=lambda rt, _s=store, _g=graph_id: _s.inputs(_g, rt.context),
                                      outputs=lambda rt, vals, _s=store, _g=graph_id: _s.outputs(_g, rt.context, vals),
                                      num_outputs=len(state_out) + 2))
        facts.cache_cut = cut
        bases = [len(b.parts) for b in seg.before_of.values()]
        counts = {"blocks_in_branch": n - fn - bn, "cond": 1, "state_tensors": len(state_in), "streams_cached": k,
                  # leaving streams that are the join of entering ones (a hand-over inside the range), and
                  # those with no entering stream of their shape, cached whole
                  "streams_joined": sum(p > 1 for p in bases), "streams_cached_whole": sum(p == 0 for p in bases),
                  "offload_loads_moved": relocated}
        return PassResult(True, counts, f"blocks {fn}..{n - bn - 1} of {n} moved into a torch.cond branch "
                                        f"({len(seg.nodes)} nodes); {k} stream residual(s) cached; tag {self.config.strify()}")
