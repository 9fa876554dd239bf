"""TaylorSeerCache: diffusers' TaylorSeer cache as a graph pass (one decision per call, a ``torch.cond`` per
attention module, Taylor factors as graph state).

Requires: the module paths capture records on every node (``meta["dit_module_path"]``). Provides: state I/O
(``state_io``). Invalidates: ``structure`` (attention modules move into branch subgraphs). The sites are the
modules diffusers' hook would wrap: module names (paths) matching ``cache_identifiers`` with ``re.fullmatch``,
by default diffusers' attention patterns (``^transformer_blocks.*attn``, ``^single_transformer_blocks.*attn``,
``^blocks.*attn``, ``^temporal_transformer_blocks.*attn``). The rule is
:mod:`~dit_passes.cache.attention_taylorseer`'s. ``skip_predict_identifiers`` / ``use_lite_mode`` (modules
returning zeros) are refused.

Before (one attention module in a block)::

    n1 = norm1(h, temb)
    a = <attn: to_q/k/v, sdpa, to_out>(n1, rotary)          # nodes with module path transformer_blocks.0.attn
    h = h + gate * a

After::

    decide = self.taylorseer_decide(timestep, *scalar_state)   # once per call: use_cache = predict this step
    use_cache, n_valid, offset = decide[0], decide[2], decide[3]
    ...
    n1 = norm1(h, temb)
    cond = torch.ops.higher_order.cond(use_cache, self.taylorseer_predict_0, self.taylorseer_compute_0,
                                       (n1, rotary, *factors_0, n_valid, offset))
    a = cond[0]                                             # the module, or sum_j F_j * offset**j / j!
    factors_0' = self.taylorseer_update_0(use_cache, n_valid, offset, a, *factors_0)
    h = h + gate * a
    return (out, *scalar_state', *factors', use_cache, diff)

State per cache context in ``compiled.runtime.state["taylorseer_cache"]`` (a ``CacheStore``; the report
``compiled.report("taylorseer_cache")`` lists the predicted steps as cached).
"""
from __future__ import annotations

import functools
import math
import re
from typing import Dict, List

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..infra.pass_base import PassContext, PassError, PassResult
from .cache_branch import (PeerCachePass, _fake_call, _getitems, add_state_inputs, finish_state_io, module_arm,
                           module_path, module_sites, site_io)

DEFAULT_IDENTIFIERS = ("^blocks.*attn", "^transformer_blocks.*attn", "^single_transformer_blocks.*attn",
                       "^temporal_transformer_blocks.*attn")


def _sites(gm: fx.GraphModule, patterns) -> Dict[str, List[fx.Node]]:
    """Matched module path -> its nodes (graph order); refuses nested matches and interleaved modules."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    prefixes = {".".join(p.split(".")[:i]) for p in map(module_path, calls) if p for i in range(1, p.count(".") + 2)}
    matched = [p for p in prefixes if any(re.fullmatch(pat, p) for pat in patterns)]
    return module_sites(gm, matched, "taylorseer_cache", "give cache_identifiers that match one level")


def _predict_arm(num_live_in: int, out_dtypes, max_order: int) -> fx.GraphModule:
    """``(*live_in, *factors, n_valid, offset) -> outputs``: ``sum_j F_j * offset**j / j!`` per output, over the
    stored factors (``n_valid``), in the output's dtype, as diffusers' ``predict``."""
    g = fx.Graph()
    ins = [g.placeholder(f"in_{i}") for i in range(num_live_in)]
    factors = [g.placeholder(f"factor_{i}") for i in range((max_order + 1) * len(out_dtypes))]
    n_valid, offset = g.placeholder("n_valid"), g.placeholder("offset")
    del ins
    aten = torch.ops.aten
    outs = []
    for j, dt in enumerate(out_dtypes):
        ladder = factors[j * (max_order + 1):(j + 1) * (max_order + 1)]
        y = g.call_function(aten.zeros_like.default, (ladder[0],), {"dtype": dt})
        for o, f in enumerate(ladder):
            coeff = g.call_function(aten.div.Tensor, (g.call_function(aten.pow.Tensor_Scalar, (offset, o)),
                                                      float(math.factorial(o))))
            term = g.call_function(aten.mul.Tensor, (g.call_function(aten._to_copy.default, (f,), {"dtype": dt}),
                                                     coeff))
            added = g.call_function(aten.add.Tensor, (y, term))
            y = added if o == 0 else g.call_function(
                aten.where.self, (g.call_function(aten.gt.Scalar, (n_valid, o)), added, y))
        outs.append(y)
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g, class_name="TaylorSeerPredict")


class TaylorSeerCache(PeerCachePass):
    """diffusers' ``TaylorSeerCacheConfig`` semantics (active modules only)."""

    name = "taylorseer_cache"
    config_class = "TaylorSeerCacheConfig"
    reads = ("num_user_outputs",)
    writes = ("num_user_outputs", "state_io", "inference_only")
    invalidates = ("structure",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.attention_taylorseer import SiteUpdate, TaylorSeerDecide, build_taylorseer_program
        from ..cache.store import CacheStore

        cfg = self.config
        if cfg.use_lite_mode or cfg.skip_predict_identifiers:
            raise PassError("taylorseer_cache: skip_predict_identifiers / use_lite_mode (modules returning zeros) "
                            "are not implemented; use cache_identifiers")
        patterns = tuple(cfg.cache_identifiers or DEFAULT_IDENTIFIERS)
        sites = _sites(gm, patterns)
        if not sites:
            raise PassError(f"taylorseer_cache: no module path matches {patterns}; pass cache_identifiers= "
                            f"naming the attention modules (e.g. r'^layers\\.\\d+\\.attn')")
        g = gm.graph
        plans = [(path, nodes, *site_io(nodes, self.name, path)) for path, nodes in sites.items()]
        mode = detect_fake_mode([p[3][0].meta["val"] for p in plans])
        device = plans[0][3][0].meta["val"].device
        timestep = next((p for p in g.nodes if p.op == "placeholder" and p.target == "timestep"), None)
        program = build_taylorseer_program(cfg, [[o.meta["val"] for o in p[3]] for p in plans], timestep is not None)
        state_in = add_state_inputs(gm, program, device, mode)
        by_name = dict(zip(program.names, state_in))
        getitems = functools.partial(_getitems, g)
        scalars = [by_name[n] for n in program.scalar_names]

        gm.add_submodule("taylorseer_decide", TaylorSeerDecide(program))
        with g.inserting_before(plans[0][1][0]):
            d_args = ((timestep if timestep is not None else scalars[0]), *scalars)
            dec = g.call_module("taylorseer_decide", d_args)
            dec.meta["val"] = _fake_call(gm.taylorseer_decide, d_args, mode)
            items = getitems(dec, dec.meta["val"], ["use_cache", "diff", "n_valid", "offset"]
                             + [f"next_{n}" for n in program.scalar_names])
        use_cache, diff, n_valid, offset = items[:4]
        new_state = dict(zip(program.scalar_names, items[4:]))
        order = cfg.max_order
        for i, (path, nodes, live_in, live_out) in enumerate(plans):
            factors = [by_name[n] for n in program.factor_names(i)]
            gm.add_submodule(f"taylorseer_compute_{i}", module_arm(gm, nodes, live_in, live_out, len(factors) + 2,
                                                                              "TaylorSeerCompute"))
            gm.add_submodule(f"taylorseer_predict_{i}", _predict_arm(len(live_in),
                                                                     [o.meta["val"].dtype for o in live_out], order))
            gm.add_submodule(f"taylorseer_update_{i}", SiteUpdate(len(live_out), order))
            first_after = nodes[-1].next
            with g.inserting_before(nodes[0]):
                operands = (*live_in, *factors, n_valid, offset)
                cond = g.call_function(torch.ops.higher_order.cond, (
                    use_cache, g.get_attr(f"taylorseer_predict_{i}"), g.get_attr(f"taylorseer_compute_{i}"), operands))
                vals = _fake_call(getattr(gm, f"taylorseer_compute_{i}"), operands, mode)
                cond.meta["val"] = tuple(vals)
                outs = getitems(cond, vals, [f"attn_{i}_out_{j}" for j in range(len(live_out))])
            for o, new in zip(live_out, outs):
                o.replace_all_uses_with(new, delete_user_cb=lambda u, _in=set(nodes): u not in _in)
            with g.inserting_before(first_after):
                u_args = (use_cache, n_valid, offset, *outs, *factors)
                upd = g.call_module(f"taylorseer_update_{i}", u_args)
                upd.meta["val"] = _fake_call(getattr(gm, f"taylorseer_update_{i}"), u_args, mode)
                new_state.update(zip(program.factor_names(i), getitems(
                    upd, upd.meta["val"], [f"next_{n}" for n in program.factor_names(i)])))
            for node in reversed(nodes):
                g.erase_node(node)
        state_out = [new_state[n] for n in program.names]
        finish_state_io(gm, ctx, self.name, lambda: CacheStore(cfg), program, device, state_out, use_cache, diff)
        counts = {"sites": len(plans), "cond": len(plans), "state_tensors": len(state_in),
                  "outputs_predicted": sum(len(p[3]) for p in plans)}
        return PassResult(True, counts, f"{len(plans)} attention modules ({plans[0][0]} ...) behind torch.cond; "
                                        f"tag {cfg.strify()}")
