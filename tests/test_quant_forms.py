"""The quantized linears' graph forms (``quant/graph_forms.py``): plain ATen ops the quantize passes write into the
graph, their numerics against the reference functions, the ``_scaled_mm`` GEMM's arguments (CPU ``_scaled_mm``
where this torch has one), the pass writing them (modulation linears included) and, on an sm_89+ GPU, the
``_scaled_mm`` graph under Inductor's regional compile.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import Fp8Linear
from dit_passes.quant import dispatch
from dit_passes.quant.fp8_int8 import fp8_linear_reference, prepare_fp8
from dit_passes.quant.graph_forms import LinearShape, fp8_linear_form
from dit_passes.quant.svdquant import relative_error

torch.set_num_threads(1)
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))
SCALED_MM = torch.ops.aten._scaled_mm.default
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _case(dtype, lead=(3, 7), k=96, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, k, generator=g) * torch.linspace(0.1, 4, k)).to(dtype)
    x[0, 0] = 0  # a token of zeros: its scale is 1, not 0
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g).to(dtype)
    return x, w, b


def _form(x, f, bias, granularity, gemm, fast_accum=False):
    shape = LinearShape.of(x, f.qweight.shape[0], f.qweight.shape[1], bias, f.wscale)
    return fp8_linear_form(x, f.qweight, f.wscale, bias, shape, granularity, gemm, fast_accum)


@pytest.mark.parametrize("granularity", ["per_row", "per_tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(3, 7), (5,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp8_reference_form_equals_reference(granularity, dtype, lead, with_bias):
    x, w, b = _case(dtype, lead)
    b = b if with_bias else None
    f = prepare_fp8(w, b, granularity)
    out = _form(x, f, b, granularity, "reference")
    assert out.shape == (*lead, 48) and out.dtype == dtype
    assert torch.equal(out, fp8_linear_reference(x, f.qweight, f.wscale, b, granularity))


def _cpu_scaled_mm_or_skip():
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU _scaled_mm ({str(e)[:80]})")


@pytest.mark.parametrize("granularity,dtype", [("per_row", torch.bfloat16), ("per_tensor", torch.float32),
                                               ("per_tensor", torch.bfloat16)])
def test_fp8_scaled_mm_form_matches_reference(granularity, dtype):
    """The GPU form's ``_scaled_mm`` call (operand layout, scale shapes, bias in the epilogue or after), run by
    CPU ``_scaled_mm``: equal to the reference form up to the output rounding."""
    _cpu_scaled_mm_or_skip()
    x, w, b = _case(dtype, (4, 8), k=64, n=32)
    f = prepare_fp8(w, b, granularity)
    ref = _form(x, f, b, granularity, "reference")
    out = _form(x, f, b, granularity, "scaled_mm")
    assert out.dtype == dtype and out.shape == ref.shape
    assert relative_error(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert relative_error(_form(x, f, None, granularity, "scaled_mm"),
                          _form(x, f, None, granularity, "reference")) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_fp8_dispatch_and_settings(monkeypatch):
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert dispatch.fp8_gemm_backend(x, 32, 64, "per_row") == "reference"  # CPU: the dequantized matmul
    monkeypatch.delenv(dispatch.FAST_ACCUM_ENV, raising=False)
    assert dispatch.fp8_fast_accum() is False
    monkeypatch.setenv(dispatch.FAST_ACCUM_ENV, "1")
    assert dispatch.fp8_fast_accum() is True
    monkeypatch.setenv(dispatch.FAST_ACCUM_ENV, "fast")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        dispatch.fp8_fast_accum()


def _linear_hooked(model, kw, fn):
    """Output of a copy of ``model`` whose block linears (modulation included) compute ``fn(module, x)``."""
    twin = copy.deepcopy(model)
    for path, mod in twin.named_modules():
        if isinstance(mod, torch.nn.Linear) and "blocks." in path:
            mod.register_forward_hook(lambda m, inp, out: fn(m, inp[0]))
    with torch.no_grad():
        return twin(**kw)[0]


def test_fp8_pass_writes_the_form_for_every_block_linear():
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    compiled = compile_dit(zm.model, passes=[Fp8Linear(exclude=())])
    with torch.no_grad():
        out = compiled(**kw)[0]
    res = compiled._current().manager.records[-1].result
    assert res.counts["replaced"] == 40 and res.counts["replaced_modulation"] == 6  # 34 + the 6 AdaLN linears
    gm = compiled.graph_module
    placed = [n for n in gm.graph.nodes if n.meta.get("dit_quant") == "fp8_per_row"]
    assert len(placed) == 40
    assert not any(n.target in (torch.ops.dit_passes.fp8_linear.default, torch.ops.aten.linear.default)
                   for n in gm.graph.nodes if "blocks." in n.meta.get("dit_module_path", ""))
    casts = [n for n in gm.graph.nodes if n.kwargs.get("dtype") == torch.float8_e4m3fn]
    assert len(casts) == 40 and all("blocks." in n.meta["dit_module_path"] for n in casts)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    want = _linear_hooked(zm.model, kw, lambda m, x: fp8_linear_reference(
        x, *prepare_fp8(m.weight, m.bias).tensors().values()))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (torch._scaled_mm)")
def test_cuda_fp8_pass_uses_scaled_mm_and_compiles():
    zm = build("flux", **FLUX64)
    model = zm.model.to("cuda", torch.bfloat16)
    kw = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in zm.make_inputs().items()}
    kw = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and k != "img_ids"
          and k != "txt_ids" else v for k, v in kw.items()}
    eager = compile_dit(model, passes=[Fp8Linear(exclude=())])
    with torch.no_grad():
        ref = eager(**kw)[0]
    gemms = [n for n in eager.graph_module.graph.nodes if n.target is SCALED_MM]
    assert len(gemms) == 40
    regional = compile_dit(model, passes=[Fp8Linear(exclude=()), passes.RegionalCompile()])  # Inductor
    with torch.no_grad():
        out = regional(**kw)[0]
    assert relative_error(out.float(), ref.float()) < 2e-2
    with torch.no_grad():
        base = model(**kw)[0]
    assert relative_error(ref.float(), base.float()) < 0.1
