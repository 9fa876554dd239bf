"""SVDQuant DQ with few-shot smoothing: the graph runs unquantized for the first ``steps`` forwards while it records
each selected linear's input span, then is lowered again with the quantized linears (``quant/few_shot.py`` for the
smoothing and the session).

While the session (``runtime.state["svdquant_w4a4_few_shot"]``, also that report) collects, the pass writes, in
front of each linear it will quantize::

    span = self.few_shot_span_3                                   # fp32 [K], the session's tensor
    dit_passes.few_shot_observe(span, norm_x)                     # span = max(span, |norm_x| per channel)
    q = torch.ops.aten.linear.default(norm_x, w, b)               # unchanged: the outputs are the unquantized model's

and keeps every weight (nothing is released). The op mutates only the span, so it stays where it is: later passes
move it with its block (inside a cache branch it records only on the steps that compute the block, the steps that
run the linear). After the last observed forward the session asks the CompiledDiT to lower its graphs again
(``Runtime.after_call``); that lowering quantizes each observed linear with ``s`` from its span and weight, and
leaves the linears that never ran in their precision (cache-dit's rule), said in the report. The cache passes' state
is kept across that re-lowering (the same generation goes on). The observe op mutates state, so the observing graph
is marked ``eager_only`` (fact): ``torch_compile`` / regional compile apply from the quantized lowering on (cache-dit
defers its compile alike).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from ..infra.facts import facts_of
from ..infra.graph_utils import copy_meta
from ..infra.pass_base import PassContext, PassError, PassResult
from ..quant.few_shot import DEFAULTS, OBSERVE_OP, FewShotSession, check_options, few_shot_smoothing
from ..quant.nvfp4 import prepare_svdquant_nvfp4
from ..quant.signature import tensor_at
from ..quant.svdquant import prepare_svdquant
from .quantize import SVDQuantW4A4


class SVDQuantFewShot(SVDQuantW4A4):
    """:class:`SVDQuantW4A4` DQ whose smoothing comes from the first ``steps`` forwards (cache-dit's
    ``smooth_strategy="few_shot"``): ``relax_factor``, ``relax_top_ratio``, ``relax_strategy`` as in
    :func:`~dit_passes.quant.few_shot.few_shot_smoothing`, ``alpha`` the exponent (0.5, cache-dit's). Other
    arguments as SVDQuantW4A4's (``dynamic`` is implied). ``compiled.report("svdquant_w4a4_few_shot")``: the
    :class:`~dit_passes.quant.few_shot.FewShotSession` (forwards counted, spans, whether it still collects)."""

    # mesh: context parallelism's sequence group, over which the spans are merged
    reads = ("structure", "fused_linears", "mesh")
    writes = ("eager_only",)  # the observing graph: its ops mutate the spans, which compiled torch.cond refuses

    def __init__(self, rank: int = 32, steps: int = DEFAULTS["steps"], relax_factor: float = DEFAULTS["relax_factor"],
                 relax_top_ratio: float = DEFAULTS["relax_top_ratio"],
                 relax_strategy: str = DEFAULTS["relax_strategy"], **kw: Any):
        if kw.pop("dynamic", True) is not True or kw.get("calibrate_fn") is not None:
            raise ValueError("SVDQuantFewShot is dynamic quantization: its statistics come from the first forwards "
                             "(no calibrate_fn, dynamic=True)")
        if kw.get("smooth", "few_shot") != "few_shot":
            raise ValueError(f"SVDQuantFewShot smooths from its observed spans; smooth={kw['smooth']!r} is another "
                             "pass: SVDQuantW4A4(dynamic=True, smooth=...)")
        kw.pop("smooth", None)
        super().__init__(rank=rank, dynamic=True, smooth="none", **kw)
        self.smooth = "few_shot"
        self.few_shot = check_options(steps, relax_factor, relax_top_ratio, relax_strategy)

    @property
    def session_name(self) -> str:
        return f"{self.name}_few_shot"

    def config(self) -> Dict[str, Any]:
        return {**super().config(), "few_shot": dict(self.few_shot)}

    def config_items(self) -> Dict[str, Any]:
        return {**super().config_items(), **{f"few_shot_{k}": v for k, v in self.few_shot.items()}}

    def session(self, ctx: PassContext) -> FewShotSession:
        s = ctx.runtime.state.get(self.session_name)
        if s is None:
            s = ctx.runtime.state[self.session_name] = FewShotSession(self.few_shot)
            ctx.runtime.register_report(self.session_name, s)
        return s

    def before_quantize(self, gm: fx.GraphModule, ctx: PassContext, sites: List[Any],
                        notes: List[str]) -> Optional[PassResult]:
        session = self.session(ctx)
        own = [s for s in sites if self.kind_of(s) == self.kind]  # weight-only forms use no activation statistics
        if session.collecting:
            mesh = facts_of(gm).mesh  # tensor parallelism needs no merge: its ranks see the same tokens
            if mesh is not None and mesh.world_size > 1:
                session.group = mesh.parent
            return self._observe(gm, session, own)
        observed = session.observed()
        never = sorted({s.module_path for s in own if s.module_path not in observed})
        if own and len(never) == len({s.module_path for s in own}):
            raise PassError(f"{self.name}: few-shot observed {session.completed_forwards} forward(s) but none of the "
                            f"{len(never)} linears to quantize ran (e.g. {never[0]}); nothing to smooth from")
        if never:  # as cache-dit: a linear never seen while collecting stays in its precision
            notes.append(f"left {len(never)} linear(s) that never ran in the {session.completed_forwards} observed "
                         f"forward(s) in their original precision (e.g. {', '.join(never[:3])})")
            sites[:] = [s for s in sites if s.module_path not in never]
        return None

    def _observe(self, gm: fx.GraphModule, session: FewShotSession, sites: List[Any]) -> PassResult:
        if not sites:
            return PassResult(False, {"observed": 0}, "few-shot: no linear to observe")
        n = 0
        for site in sites:
            w = tensor_at(gm, site.weight)
            span = session.span(site.module_path, site.in_features, w.device)
            attr = f"few_shot_span_{n}"
            while hasattr(gm, attr):
                n += 1
                attr = f"few_shot_span_{n}"
            gm.register_buffer(attr, span, persistent=False)
            session.bind(site.module_path, gm, attr)
            x = site.node.args[0]
            with gm.graph.inserting_before(site.node):
                get = gm.graph.get_attr(attr)
                obs = gm.graph.call_function(OBSERVE_OP, (get, x))
            fake = x.meta["val"].fake_mode
            with fake:
                get.meta["val"] = fake.from_tensor(span)
            obs.meta["val"] = None
            for node in (get, obs):  # the linear's module path: block discovery puts them in its block
                copy_meta(node, site.node)
            n += 1
        gm.recompile()
        facts_of(gm).eager_only = "few-shot quantization observes this graph's linears (the graph lowered after it is"\
            " compiled)"
        left = session.steps - session.completed_forwards
        return PassResult(True, {"observed": len(sites)},
                          f"few-shot: observing the inputs of {len(sites)} linear(s) for {left} more forward(s), "
                          "unquantized until then")

    def calibrate_in(self, ctx: PassContext, weights: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        observed = self.session(ctx).observed()
        return {p: observed[p] for p in weights if p in observed}

    def prepare(self, path, weight, bias, absmax, kind):
        if kind != self.kind:
            return super().prepare(path, weight, bias, absmax, kind)
        s, _ = few_shot_smoothing(absmax, weight, self.alpha, self.few_shot["relax_factor"],
                                  self.few_shot["relax_top_ratio"], self.few_shot["relax_strategy"])
        prepare = prepare_svdquant_nvfp4 if kind == "svdq_nvfp4" else prepare_svdquant
        q = prepare(weight, bias, rank=self.rank_of(path), seed=self.seed, dtype=weight.dtype, svd=self.svd_precision,
                    refine_iters=self.refine_iters, smooth_scale=s)
        return q.tensors()


__all__ = ["SVDQuantFewShot"]
