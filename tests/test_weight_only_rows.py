"""Weight-only linears on a few rows as a multiply-and-sum (``weight_only_forms.dequantized_linear(rows=True)``,
chosen by ``dispatch.weight_only_form``): the same numbers as the linear form (fp32: up to summation order; bf16:
within the weight's and output's roundings), no ``aten.linear`` left for the quantized weight, the setting's rule,
and the SVDQuant pass writing it for FLUX's modulation linears (one conditioning row per sample) with the model's
output unchanged, eager and under ``torch.compile(aot_eager)``."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses import FakeTensorMode

from dit_passes import compile_dit
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import SVDQuantW4A4
from dit_passes.patterns import quant_linear as QL
from dit_passes.quant import dispatch
from dit_passes.quant.nvfp4_weight_only import prepare_nvfp4_weight_only
from dit_passes.quant.svdquant import relative_error
from dit_passes.quant.w4a16 import prepare_w4a16, prepare_w4a16_lr
from dit_passes.quant.w8a16 import prepare_w8a16

torch.set_num_threads(1)
PREPARE = {"w8a16": prepare_w8a16, "w4a16": prepare_w4a16, "w4a16_lr": prepare_w4a16_lr,
           "nvfp4_weight_only": prepare_nvfp4_weight_only}
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _args(kind, q):
    tensors = q.tensors()
    return [tensors.get(a) for a in QL.QUANT_KINDS[kind].tensor_args]


@pytest.mark.parametrize("kind", list(PREPARE))
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (2, 1)])
def test_rows_form_equals_the_linear_form(kind, with_bias, lead):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*lead, 192, generator=g), torch.randn(40, 192, generator=g) * 0.05
    b = torch.randn(40, generator=g) if with_bias else None
    rows = QL.traced(QL.weight_only_rows_replacement(kind, with_bias))
    linear = QL.traced(QL.QUANT_KINDS[kind].replacement)
    targets = [n.target for n in rows.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.sum.dim_IntList in targets
    assert targets.count(torch.ops.aten.linear.default) == (2 if kind == "w4a16_lr" else 0)  # the branch's two
    q = PREPARE[kind](w, b)
    got, want = rows(x, *_args(kind, q)), linear(x, *_args(kind, q))
    assert got.shape == want.shape == (*lead, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    xb = x.to(torch.bfloat16)
    qb = PREPARE[kind](w.to(torch.bfloat16), None if b is None else b.to(torch.bfloat16))
    got16, want16 = rows(xb, *_args(kind, qb)), linear(xb, *_args(kind, qb))
    assert got16.dtype == torch.bfloat16 and relative_error(got16, want16) < 1e-2


def test_weight_only_form_setting():
    with FakeTensorMode():  # a CUDA tensor's metadata, no GPU needed
        one, cfg, tokens = (torch.empty(*s, 64, device="cuda") for s in ((1,), (2, 1), (1, 5)))
    cpu = torch.empty(1, 64)
    # the default: the int4 GEMV op on a GPU's few rows; the linear form on the CPU and for the other kinds
    assert [dispatch.weight_only_form(t) for t in (one, cfg, tokens, cpu)] == ["kernel", "kernel", "linear", "linear"]
    assert {dispatch.weight_only_form(t, int4=False) for t in (one, cfg, tokens, cpu)} == {"linear"}
    assert [dispatch.weight_only_form(t, True, "rows") for t in (one, cfg, tokens, cpu)] == [
        "rows", "rows", "linear", "rows"]
    assert [dispatch.weight_only_form(t, True, "kernel") for t in (one, tokens)] == ["kernel", "linear"]
    assert dispatch.weight_only_form(one, True, "linear") == "linear"
    with pytest.raises(ValueError, match="weight_only_form must be one of"):
        dispatch.weight_only_form(one, True, "sum")
    with pytest.raises(ValueError, match="weight_only_form must be one of"):
        SVDQuantW4A4(rank=8, dynamic=True, weight_only_form="sum")


def test_svdquant_pass_writes_the_rows_form_for_the_modulation_linears():
    """FLUX's AdaLN linears (W4A16 + low-rank branch, one row per sample): the rows form where the setting asks,
    the linear form otherwise, the same output (fp32), also compiled."""
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()

    def lowered(setting, **compile_kw):
        return compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation="w4a16_lr",
                                                          weight_only_form=setting)],
                           example_inputs=kw, keep_original=True, **compile_kw)

    rows, linear = lowered("rows"), lowered("linear")
    compiled = lowered("rows", torch_compile={"backend": "aot_eager", "fullgraph": True})

    def sums(c):
        return sum(n.target is torch.ops.aten.sum.dim_IntList and n.meta.get("dit_pattern") is not None
                   for n in c.graph_module.graph.nodes)

    adaln = sum(n.meta.get("dit_quant") == "w4a16_lr" for n in rows.graph_module.graph.nodes)
    assert adaln > 0 and sums(rows) == adaln and sums(linear) == 0
    with torch.no_grad():
        got, want = rows(**kw)[0], linear(**kw)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(**kw)[0], got, rtol=1e-6, atol=1e-6)
