"""FuseLinearGelu: a linear followed by tanh-GELU becomes one GEMM with GELU in its epilogue.

Why: Inductor cannot fuse a pointwise op into cuBLAS's GEMM, so ``gelu(linear(x))`` writes the GEMM's output, then
reads it back and writes it again in a separate kernel. On FLUX.1-dev that output is the MLP's hidden state,
4608 x 12288 bf16 (113 MB) per block: ~0.07 ms of memory traffic at the H100's bandwidth, 57 times a step.
cuBLASLt applies bias and tanh-GELU in the GEMM's epilogue (``torch._addmm_activation(bias, x, w.t(), use_gelu=True)``),
so the hidden state is written once. Measured with ``SplitConcatLinear`` on an H100
(bench/results/quant_step_epilogues_h100.json): the GEMMs with the epilogue take a little longer, Inductor's kernels
much less, the step less.

The op ``dit_passes::linear_gelu(x, weight, bias)`` is ``gelu(linear(x, weight, bias), approximate="tanh")``:
on CUDA with a floating dtype cuBLASLt's epilogue (GELU on the fp32 accumulator, rounded once: within bf16
rounding of the unfused pair), elsewhere those two ATen ops (the CPU result is the original's bit for bit). It
is opaque to Inductor, which keeps fusing the ops around it.

Contract: phase ``EPILOGUES`` (after ``QUANTIZE``: the quantizers take the linears first, so only the plain
ones left are fused). Matches ``aten.gelu(aten.linear(x, w, b), approximate="tanh")`` where the linear has a
bias (cuBLASLt's GELU epilogue is the bias one) and GELU is the linear's only reader; exact GELU
(``approximate="none"``, which no cuBLAS epilogue computes) and bias-free linears are left as they are, counted.
Graph structure (blocks, roles) is unchanged: the op keeps the linear's module path.

Before (a FLUX single-stream block)::

    linear_37 = aten.linear.default(mul_12, proj_mlp_weight, proj_mlp_bias)      # [1, 4608, 12288]
    gelu_4 = aten.gelu.default(linear_37, approximate='tanh')
    cat_14 = aten.cat.default([flatten_8, gelu_4], 2)

After::

    linear_gelu = dit_passes.linear_gelu.default(mul_12, proj_mlp_weight, proj_mlp_bias)
    cat_14 = aten.cat.default([flatten_8, linear_gelu], 2)

``counts``: ``fused`` and ``skipped_<reason>`` (``exact_gelu``, ``no_bias``, ``shared_output``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..infra.graph_utils import copy_meta
from ..infra.pass_base import Pass, PassContext, PassResult, skipped_summary
from ..infra.phases import Phase

aten = torch.ops.aten
_EPILOGUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("dit_passes::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate="tanh")``; on CUDA one cuBLASLt GEMM with the epilogue."""
    if x.is_cuda and x.dtype in _EPILOGUE_DTYPES and weight.dtype == x.dtype and bias.dtype == x.dtype:
        # where cuBLASLt cannot take the shapes, _addmm_activation runs the GEMM and then GELU itself
        out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


@linear_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class FuseLinearGelu(Pass):
    """Write ``gelu(linear(x, w, b), approximate="tanh")`` as one ``dit_passes::linear_gelu``."""

    name = "fuse_linear_gelu"
    phase = Phase.EPILOGUES
    invalidates = ("structure",)  # the fused linears are no longer aten.linear nodes

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        g = gm.graph
        fused, skipped = 0, {}
        for n in list(g.nodes):
            why = _why_not(n)
            if why is None:
                lin = n.args[0]
                with g.inserting_before(n):
                    new = g.call_function(torch.ops.dit_passes.linear_gelu.default, tuple(lin.args[:3]))
                new.meta.update(n.meta)  # the GELU's value: same shape, dtype and layout
                copy_meta(new, lin)      # the linear's module path: analyses still find the linear's module
                n.replace_all_uses_with(new)
                g.erase_node(n)
                g.erase_node(lin)
                fused += 1
            elif why:
                skipped[why] = skipped.get(why, 0) + 1
        g.lint()
        ctx.recompile_at_end(gm)
        left, left_text = skipped_summary(skipped, "left")
        report = (f"{fused} linear + tanh-GELU pairs as one GEMM with the GELU epilogue" if fused
                  else "no linear followed by tanh-GELU") + left_text
        if not fused:  # said, not only recorded: a pass asked for that found nothing is worth knowing
            warnings.warn(f"{self.name} rewrote nothing: {report}", stacklevel=2)
        return PassResult(fused > 0, {"fused": fused, **left}, report)


def _why_not(n: fx.Node) -> Optional[str]:
    """None for a GELU node this pass fuses, a counted reason for a GELU of a linear it leaves, "" otherwise."""
    if n.op != "call_function" or n.target is not aten.gelu.default:
        return ""
    lin = n.args[0]
    if not (isinstance(lin, fx.Node) and lin.op == "call_function" and lin.target is aten.linear.default):
        return ""
    approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
    if approximate != "tanh":
        return "exact_gelu"
    if len(lin.args) < 3 or lin.args[2] is None or lin.kwargs:
        return "no_bias"
    if len(lin.users) != 1:
        return "shared_output"
    return None


__all__ = ["FuseLinearGelu", "linear_gelu"]
