"""The rewrite the attention-reuse passes share (``PyramidAttentionBroadcast``, ``FasterCache``): a ``torch.cond``
around each attention module, one decision per call, the stored outputs as graph state.

The sites are the attention modules (the module path of each attention op: ATen's, or the parallel or kernel
passes' replacement) that
the config's identifiers select, by kind (spatial / temporal / cross; ``re.search`` on the module path, as
diffusers). diffusers reads ``module.is_cross_attention``, an attribute the graph does not carry; here a module
is cross attention when its keys are not computed from any input its queries are computed from (PixArt's
``attn2``); diffusers' ``getattr(..., False)`` treats modules without the attribute (Wan's ``attn2``) as self
attention. Not a pass: a helper of the two passes, as ``cache_branch`` is.

Before (one attention module)::

    a = <attn: to_q/k/v, sdpa, to_out>(n1, rotary)

After::

    decide = self.<name>_decide(timestep, *scalars)          # once per call
    cond = torch.ops.higher_order.cond(reuse_<kind>, self.<name>_reuse_0, self.<name>_compute_0,
                                       (n1, rotary, *stored_0))
    a = cond[0]                                               # the module, or the stored / extrapolated output
    [FasterCache: stored_0' = self.<name>_update_0(first, a, *stored_0)]
    ...
    [FasterCache, CFG part: out0' , deltas' = self.<name>_guidance(skip_uncond, w_low, w_high, out0, *deltas)]
    return (*outputs, *scalars', *stored', use_cache, diff)
"""
from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..infra.pass_base import PassContext, PassError, PassResult
from .cache_branch import (PeerCachePass, _fake_call, _getitems, add_state_inputs, finish_state_io, module_arm,
                           module_path, module_sites, site_io)

aten = torch.ops.aten


def _is_attention(target) -> bool:
    """An attention op (q, k, v first): ATen's, the attention-kernel pass's, or a context-parallel wrapper."""
    from ..analysis.linear_roles import ROLE_ATTENTION_OPS
    from ..parallel import sequence_ops
    if target in ROLE_ATTENTION_OPS or (
            isinstance(target, torch._ops.OpOverload) and target.name() == "dit_passes::sdpa_backend"):
        return True
    return getattr(target, "__module__", "") == sequence_ops.__name__ and target.__name__.endswith("_attention")


def _is_cross(nodes: List[fx.Node], live_in: List[fx.Node], q: fx.Node, k: fx.Node) -> bool:
    """Keys computed from none of the module inputs the queries are computed from."""
    inside, outside = set(nodes), set(live_in)

    def sources(x: fx.Node) -> set:
        seen, found, stack = set(), set(), [x]
        while stack:
            y = stack.pop()
            if y in seen:
                continue
            seen.add(y)
            if y in outside:
                found.add(y)
            elif y in inside:
                stack.extend(y.all_input_nodes)
        return found

    return not (sources(q) & sources(k))


def _reuse_arm(num_live_in: int, num_outputs: int, rule: str, weight: float, cfg_half: bool) -> fx.GraphModule:
    """``(*live_in, *stored) -> outputs``: PAB: a copy of the stored outputs; FasterCache: ``y1 + (y1 - y2) * w``
    (stored = prev..., last...), both CFG halves alike with ``cfg_half``."""
    g = fx.Graph()
    for i in range(num_live_in):
        g.placeholder(f"in_{i}")
    per = 1 if rule == "pab" else 2
    stored = [g.placeholder(f"stored_{i}") for i in range(per * num_outputs)]
    outs = []
    for j in range(num_outputs):
        if rule == "pab":
            outs.append(g.call_function(aten.clone.default, (stored[j],)))
            continue
        y2, y1 = stored[j], stored[num_outputs + j]
        a = g.call_function(aten.add.Tensor, (y1, g.call_function(aten.mul.Tensor, (
            g.call_function(aten.sub.Tensor, (y1, y2)), weight))))
        outs.append(g.call_function(aten.cat.default, ([a, a], 0)) if cfg_half else a)
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g, class_name="AttentionReuse")


def classify(gm: fx.GraphModule, cfg: Any, kinds: Sequence[str], name: str, prefilter=None) -> Dict[str, List[str]]:
    """kind -> the attention module paths of that kind (diffusers' order: spatial, temporal, cross)."""
    paths: Dict[str, Tuple[fx.Node, fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_attention(n.target):
            paths.setdefault(module_path(n), (n.args[0], n.args[1]))
    paths.pop("", None)
    sites = module_sites(gm, list(paths), name, "the attention ops' modules must not contain each other")
    out: Dict[str, List[str]] = {k: [] for k in kinds}
    for path, nodes in sites.items():
        if prefilter is not None and not any(re.search(p, path) for p in prefilter):
            continue
        cross = _is_cross(nodes, site_io(nodes, name, path)[0], *paths[path])
        for kind in kinds:
            skip, _, ids = cfg.kind(kind)
            if skip is not None and (kind == "cross") == cross and any(re.search(p, path) for p in ids):
                out[kind].append(path)
                break
    return {k: v for k, v in out.items() if v}


class AttentionReusePass(PeerCachePass):
    """The shared ``run`` of the attention-reuse passes; subclasses set ``name``, ``config_class``, ``rule``,
    ``kinds`` (and FasterCache its prefilter)."""

    reads = ("num_user_outputs",)
    writes = ("num_user_outputs", "state_io", "inference_only")
    invalidates = ("structure",)
    rule = "pab"
    kinds: Tuple[str, ...] = ()
    prefilter = None

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from ..cache.attention_reuse import (AttentionReuseDecide, AttentionReuseStore, FasterSiteUpdate,
                                             FrequencyGuidance, SiteKind, build_attention_program)
        name, g = self.name, gm.graph
        cfg = self._pipeline_units(ctx)
        by_kind = classify(gm, cfg, self.kinds, name, self.prefilter)
        if not by_kind:
            raise PassError(f"{name}: no attention module matches the config's identifiers / kinds "
                            f"({[(k, cfg.kind(k)[2]) for k in self.kinds]}); set the identifiers to the attention "
                            f"modules' paths (and a block_skip_range for their kind)")
        timestep = next((p for p in g.nodes if p.op == "placeholder" and p.target == "timestep"), None)
        if timestep is None:
            raise PassError(f"{name}: the graph has no 'timestep' input; the rule compares the timestep with its "
                            f"ranges")
        sites = module_sites(gm, [p for v in by_kind.values() for p in v], name, "")
        kind_of = {p: i for i, v in enumerate(by_kind.values()) for p in v}
        plans = [(path, nodes, *site_io(nodes, name, path)) for path, nodes in sites.items()]
        out_node = g.output_node()
        out0 = out_node.args[0][0]
        cfg_half = self.rule == "faster" and not cfg.is_guidance_distilled
        d_shape: Tuple[int, ...] = ()
        if cfg_half:
            d_shape = self._check_cfg_batch(out0, plans)
        mode = detect_fake_mode([p[3][0].meta["val"] for p in plans])
        device = plans[0][3][0].meta["val"].device
        kinds = [SiteKind(k, cfg.kind(k)[0], *cfg.kind(k)[1], len(v)) for k, v in by_kind.items()]
        program = build_attention_program(cfg, self.rule, kinds, [[o.meta["val"] for o in p[3]] for p in plans], True,
                                          cfg_half, d_shape)
        state_in = add_state_inputs(gm, program, device, mode)
        by_name = dict(zip(program.names, state_in))
        getitems = functools.partial(_getitems, g)
        scalars = [by_name[n] for n in program.scalar_names]

        gm.add_submodule(f"{name}_decide", AttentionReuseDecide(program))
        with g.inserting_before(plans[0][1][0]):
            d_args = (timestep, *scalars)
            dec = g.call_module(f"{name}_decide", d_args)
            dec.meta["val"] = _fake_call(getattr(gm, f"{name}_decide"), d_args, mode)
            items = getitems(dec, dec.meta["val"], ["skip_uncond", "w_low", "w_high", "first"]
                             + [f"reuse_{k.name}" for k in kinds] + ["use_cache", "diff"]
                             + [f"next_{n}" for n in program.scalar_names])
        skip_uncond, w_low, w_high, first = items[:4]
        reuse = items[4:4 + len(kinds)]
        use_cache, diff = items[4 + len(kinds):6 + len(kinds)]
        new_state = dict(zip(program.scalar_names, items[6 + len(kinds):]))
        for i, (path, nodes, live_in, live_out) in enumerate(plans):
            stored = [by_name[n] for which in program.per_output for n in program.stored_names(i, which)]
            gm.add_submodule(f"{name}_compute_{i}", module_arm(gm, nodes, live_in, live_out, len(stored),
                                                               "AttentionCompute"))
            gm.add_submodule(f"{name}_reuse_{i}", _reuse_arm(len(live_in), len(live_out), self.rule,
                                                             getattr(cfg, "attention_weight", 0.0), cfg_half))
            first_after = nodes[-1].next
            with g.inserting_before(nodes[0]):
                operands = (*live_in, *stored)
                cond = g.call_function(torch.ops.higher_order.cond, (
                    reuse[kind_of[path]], g.get_attr(f"{name}_reuse_{i}"), g.get_attr(f"{name}_compute_{i}"), operands))
                vals = _fake_call(getattr(gm, f"{name}_compute_{i}"), operands, mode)
                cond.meta["val"] = tuple(vals)
                outs = getitems(cond, vals, [f"attn_{i}_out_{j}" for j in range(len(live_out))])
            for o, new in zip(live_out, outs):
                o.replace_all_uses_with(new, delete_user_cb=lambda u, _in=set(nodes): u not in _in)
            if self.rule == "pab":
                new_state.update(zip(program.stored_names(i, "last"), outs))
            else:
                gm.add_submodule(f"{name}_update_{i}", FasterSiteUpdate(len(live_out), cfg_half))
                with g.inserting_before(first_after):
                    u_args = (first, *outs, *stored)
                    upd = g.call_module(f"{name}_update_{i}", u_args)
                    upd.meta["val"] = _fake_call(getattr(gm, f"{name}_update_{i}"), u_args, mode)
                    names = program.stored_names(i, "prev") + program.stored_names(i, "last")
                    new_state.update(zip(names, getitems(upd, upd.meta["val"], [f"next_{n}" for n in names])))
            for node in reversed(nodes):
                g.erase_node(node)
        if cfg_half:
            gm.add_submodule(f"{name}_guidance", FrequencyGuidance(cfg.tensor_format))
            with g.inserting_before(out_node):
                gd_args = (skip_uncond, w_low, w_high, out0, by_name["d_low"], by_name["d_high"])
                gd = g.call_module(f"{name}_guidance", gd_args)
                gd.meta["val"] = _fake_call(getattr(gm, f"{name}_guidance"), gd_args, mode)
                new_out0, d_low, d_high = getitems(gd, gd.meta["val"], ["guided_output", "next_d_low", "next_d_high"])
            out_node.args = ((new_out0, *out_node.args[0][1:]),)
            new_state.update(d_low=d_low, d_high=d_high)
        state_out = [new_state[n] for n in program.names]
        finish_state_io(gm, ctx, name, lambda: AttentionReuseStore(cfg), program, device, state_out, use_cache, diff)
        counts = {"sites": len(plans), "cond": len(plans), "state_tensors": len(state_in),
                  **{f"sites_{k.name}": k.sites for k in kinds}, "cfg_guidance": int(cfg_half)}
        units = (f"; timestep_scale {cfg.timestep_scale:.6g} from current_timestep_callback"
                 if self.config.current_timestep_callback is not None else "")
        return PassResult(True, counts, f"{len(plans)} attention modules ({plans[0][0]} ...) behind torch.cond; "
                                        f"tag {cfg.strify()}{units}")

    def _pipeline_units(self, ctx: PassContext) -> Any:
        """The config the graph compares with: with ``current_timestep_callback``, ``timestep_scale`` = its value
        (the pipeline's timestep) over the first call's timestep input, read once here, so the decision stays a
        graph computation on the transformer's own timestep input (a pipeline passes its timestep times a
        constant: Flux's t / 1000). Without one, the warning of :meth:`_check_timestep_scale`."""
        callback = self.config.current_timestep_callback
        if callback is None:
            self._check_timestep_scale(ctx)
            return self.config
        t = ctx.example_inputs.get("timestep")
        value = callback()
        if value is None or not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_meta:
            raise PassError(f"{self.name}: current_timestep_callback returned {value!r} with the transformer's "
                            f"timestep input {type(t).__name__} at the first call; call the transformer inside the "
                            f"pipeline's call (pipe.current_timestep is set there), or give timestep_scale= (the "
                            f"pipeline's timestep over the transformer's timestep input) instead of the callback")
        first = float(t.detach().reshape(-1)[0])
        value = float(value.detach().reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)
        if first == 0.0 or value == 0.0:
            raise PassError(f"{self.name}: current_timestep_callback gave {value:.6g} for the transformer's timestep "
                            f"{first:.6g}: no scale between them; give timestep_scale= instead of the callback")
        return dataclasses.replace(self.config, current_timestep_callback=None, timestep_scale=value / first)

    def _check_timestep_scale(self, ctx: PassContext) -> None:
        """Warn (once per lowering: one host read of the example input) when the first call's timestep is <= 1 while
        the ranges are in the pipeline's 0..1000 units: a pipeline passing t / 1000 (Flux's) needs
        ``timestep_scale=1000``, else no timestep ever falls inside the ranges."""
        t = ctx.example_inputs.get("timestep")
        if self.config.timestep_scale != 1.0 or not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_meta:
            return
        first = float(t.detach().reshape(-1)[0])
        if 0.0 < first <= 1.0:
            warnings.warn(f"{self.name}: the transformer's timestep is {first:.3g} (<= 1) while the timestep ranges "
                          f"are in the pipeline's units (0 .. 1000); if the pipeline passes t / 1000 (FluxPipeline, "
                          f"QwenImagePipeline) pass timestep_scale=1000 or current_timestep_callback=lambda: "
                          f"pipe.current_timestep", stacklevel=2)

    def _check_cfg_batch(self, out0: fx.Node, plans) -> Tuple[int, ...]:
        """FasterCache's CFG part needs a batched CFG call: an even batch on the output and on every site's outputs,
        and the output laid out as ``tensor_format`` says (diffusers' fft over its last two dims)."""
        from ..cache.attention_reuse import delta_shape
        fmt, val = self.config.tensor_format, out0.meta.get("val")
        rank = 4 if fmt == "BCHW" else 5
        if not isinstance(val, torch.Tensor) or val.dim() != rank or val.shape[0] % 2:
            raise PassError(f"{self.name}: is_guidance_distilled=False approximates the unconditional half of a "
                            f"batched CFG call (batch 2B, unconditional first) in frequency space; the output "
                            f"{tuple(getattr(val, 'shape', ()))} is not an even-batch {rank}-D {fmt} tensor (set "
                            f"tensor_format, call with the CFG batch, or is_guidance_distilled=True)")
        for path, _, _, live_out in plans:
            bad = [tuple(o.meta["val"].shape) for o in live_out if o.meta["val"].shape[0] != val.shape[0]]
            if bad:
                raise PassError(f"{self.name}: attention module '{path}' returns {bad}, not batch-first with the "
                                f"call's batch {val.shape[0]}; its conditional half cannot be kept")
        return delta_shape(tuple(val.shape), fmt)


__all__ = ["AttentionReusePass", "classify"]
