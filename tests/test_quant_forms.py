"""The quantized linears' graph forms (``quant/graph_forms.py``): plain ATen ops the quantize passes write into the
graph, their numerics against the reference functions, the ``_scaled_mm`` GEMM's arguments (CPU ``_scaled_mm``
where this torch has one), the passes writing them (fp8: modulation linears included; SVDQuant W4A8 on fp8 tensor
cores with ``form="fp8"``, its error against true W4A4; the weight-only int8 (default) and int4
forms of the modulation linears: exact against the fp32 dequantized linear, their error bounds) and, on an sm_89+
GPU, the ``_scaled_mm`` graph under Inductor's regional compile.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import Fp8Linear, SVDQuantW4A4
from dit_passes.quant import dispatch, lut_dispatch
from dit_passes.quant.fp8_int8 import fp8_linear_reference, prepare_fp8, quantize_fp8_act
from dit_passes.quant.graph_forms import LinearShape, fp8_linear_form, svdq_fp8_linear_form, w4_to_e4m3
from dit_passes.quant.int4 import dequantize_weight_w4, pack_int4, quantize_weight_w4
from dit_passes.quant.nvfp4_weight_only import nvfp4_weight_only_linear_form, prepare_nvfp4_weight_only
from dit_passes.quant.svdquant import prepare_svdquant, relative_error, svdq_w4a4_linear_reference
from dit_passes.quant.w4a16 import prepare_w4a16, prepare_w4a16_lr
from dit_passes.quant.w8a16 import dequantize_w8a16, prepare_w8a16
from dit_passes.quant.weight_only_forms import w4a16_linear_form, w4a16_lr_linear_form, w8a16_linear_form

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


def test_fp8_dispatch_and_settings():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert dispatch.fp8_gemm_backend(x, 32, 64, "per_row") == "reference"  # CPU: the dequantized matmul
    assert dispatch.fp8_fast_accum() is True  # the inference default
    assert dispatch.fp8_fast_accum(False) is False
    assert dispatch.fp8_fast_accum(True) is True
    with pytest.raises(ValueError, match="fast_accum must be None, True or False"):
        dispatch.fp8_fast_accum("fast")


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
    compiled = compile_dit(zm.model, passes=[Fp8Linear(exclude=())], keep_original=True)
    with torch.no_grad():
        out = compiled(**kw)[0]
    res = compiled._current().manager.records[-1].result
    assert res.counts["replaced"] == 40 and res.counts["replaced_modulation"] == 6  # 34 + the 6 AdaLN linears
    gm = compiled.graph_module
    placed = [n for n in gm.graph.nodes if n.meta.get("dit_quant") == "fp8_per_row"]
    assert len(placed) == 40
    assert not any(n.target in (torch.ops.dit_passes.fp8_linear.default, torch.ops.aten.linear.default)
                   for n in gm.graph.nodes if "blocks." in n.meta.get("dit_module_path", ""))
    # one activation quantization per distinct input: q / k / v (and a single block's MLP-up) share theirs
    inputs = {n.args[0] for n in compile_dit(zm.model, passes=[], example_inputs=kw).graph_module.graph.nodes
              if n.target is torch.ops.aten.linear.default and "blocks." in n.meta.get("dit_module_path", "")}
    casts = [n for n in gm.graph.nodes if n.kwargs.get("dtype") == torch.float8_e4m3fn]
    assert len(casts) == len(inputs) == 26 and all("blocks." in n.meta["dit_module_path"] for n in casts)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    want = _linear_hooked(zm.model, kw, lambda m, x: fp8_linear_reference(
        x, *prepare_fp8(m.weight, m.bias).tensors().values()))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (torch._scaled_mm)")
@pytest.mark.parametrize("method", ["fp8", "svdq_w4a8_fp8", "svdq_default"])
def test_cuda_forms_use_scaled_mm_and_compile(method):
    """bf16 tiny Flux on the GPU: every quantized linear's GEMM is ``aten._scaled_mm``; Inductor's regional compile
    gives the eager graph's output (up to bf16 rounding and fusion order). ``svdq_default``: no setting, what
    ``auto`` gives (on Hopper the lookup-table form where its library runs, whose GEMM is ``dit_passes::w4a8_lut_gemm``,
    else the lrcat_split form with the A-operand, expansion and GEMV ops)."""
    zm = build("flux", **FLUX64)
    model = zm.model.to("cuda", torch.bfloat16)
    kw = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in zm.make_inputs().items()}
    kw = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and not k.endswith("_ids") else v
          for k, v in kw.items()}
    if method == "fp8":
        make, replaced = (lambda: Fp8Linear(exclude=())), 40
    else:
        form = "fp8" if method == "svdq_w4a8_fp8" else "auto"
        if form == "auto" and torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("auto writes fp8 SVDQuant forms on Hopper only (elsewhere the W4A4 op)")
        make, replaced = (lambda: SVDQuantW4A4(rank=8, dynamic=True, form=form)), 34
    eager = compile_dit(model, passes=[make()], example_inputs=kw, keep_original=True)
    with torch.no_grad():
        ref = eager(**kw)[0]
    gemm = SCALED_MM
    if method == "svdq_default" and lut_dispatch.lut_ready(torch.device("cuda")):
        gemm = torch.ops.dit_passes.w4a8_lut_gemm.default
    assert sum(n.target is gemm for n in eager.graph_module.graph.nodes) == replaced
    regional = compile_dit(model, passes=[make(), passes.RegionalCompile()], example_inputs=kw, keep_original=True)  # Inductor
    with torch.no_grad():
        out = regional(**kw)[0]
        base = model(**kw)[0]
    print(method, "regional vs eager", relative_error(out.float(), ref.float()), "vs bf16",
          relative_error(ref.float(), base.float()))
    assert relative_error(out.float(), ref.float()) < 2e-2
    assert relative_error(ref.float(), base.float()) < 0.1


# ------------------------------------------------------------------------------------ SVDQuant W4A8 (fp8 cores)
def _svdq_case(dtype=torch.float32, k=256, n=192, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 16, k, generator=g) * (1 + 8 * (torch.rand(k, generator=g) > 0.97))).to(dtype)
    w = (torch.rand(n, k, generator=g) * 2 - 1) * k ** -0.5
    w[:, :4] *= 6  # outlier input channels: what smoothing and the low-rank branch are for
    w, b = w.to(dtype), (torch.randn(n, generator=g) * 0.1).to(dtype)
    q = prepare_svdquant(w, b, act_absmax=x.float().abs().amax((0, 1)), rank=32, smooth="act", dtype=dtype)
    return x, w, b, q


def _svdq_form(x, q, gemm="reference"):
    shape = LinearShape.of(x, q.N, q.K, q.bias, q.wscale, rank=q.rank)
    return svdq_fp8_linear_form(x, q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias, shape, gemm)


def test_w4_to_e4m3_nibbles_scales_and_rounding():
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (32, 128), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every int4 value, even and odd positions
    packed = pack_int4(q)
    flat = torch.full((32, 2), 0.25, dtype=torch.bfloat16)  # equal group scales: w8 / 56 recovers q exactly
    w8, sw = w4_to_e4m3(packed, flat, 32, 128)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (32, 128) and sw.shape == (32,)
    torch.testing.assert_close(sw, torch.full((32,), 0.25 * 8 / 448))
    assert torch.equal(torch.round(w8.float() / 56).to(torch.int8), q)
    wscale = torch.rand(32, 2, generator=g).to(torch.bfloat16) + 0.01
    w8, sw = w4_to_e4m3(packed, wscale, 32, 128)
    exact = dequantize_weight_w4(packed, wscale)
    got = w8.float() * sw[:, None]
    # e4m3 keeps 4 significant bits: each value within half an ulp (2**-4 relative) of q * wscale
    assert ((got - exact).abs() <= exact.abs() * 2 ** -4 + 1e-6).all()
    assert (w8.float().abs().amax(1) <= 448).all() and 0 < relative_error(got, exact) < 0.04


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_svdq_fp8_form_numerics_and_error_vs_w4a4(dtype):
    """The reference form is the documented arithmetic (re-derived here from the fp8 reference quantizer), and its
    error against the exact linear is below true W4A4's (e4m3 per-token activations are finer than int4 per group;
    the e4m3 weight re-rounding costs less). Measured rel. errors (fp32): W4A4 0.080, W4A8-fp8 0.049, fp8 0.034."""
    x, w, b, q = _svdq_case(dtype)
    out = _svdq_form(x, q)
    assert out.shape == (4, 16, 192) and out.dtype == dtype
    xs = x.reshape(-1, 256).float() * q.smooth_inv
    qx, sx = quantize_fp8_act(xs, "per_row")
    w8, sw = w4_to_e4m3(q.qweight, q.wscale, 192, 256)
    y = (qx.float() @ w8.float().t()) * sx * sw + b.float()
    y = y.to(dtype) + (xs.to(dtype) @ q.lora_down.t()) @ q.lora_up.t()
    torch.testing.assert_close(out.reshape(-1, 192), y.to(dtype), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    err = {"w4a4": relative_error(svdq_w4a4_linear_reference(x, q), exact), "w4a8_fp8": relative_error(out, exact),
           "fp8": relative_error(fp8_linear_reference(x, *prepare_fp8(w, b).tensors().values()), exact)}
    print(dtype, {k: round(v, 4) for k, v in err.items()})
    assert err["fp8"] < err["w4a8_fp8"] < 0.75 * err["w4a4"] < 0.1


def test_svdq_fp8_scaled_mm_form_matches_reference():
    _cpu_scaled_mm_or_skip()
    x, _, _, q = _svdq_case(torch.bfloat16, k=128, n=64)
    assert relative_error(_svdq_form(x, q, "scaled_mm"), _svdq_form(x, q, "reference")) < 1e-2


def test_svdq_pass_writes_the_fp8_form_when_asked():
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    # the modulation linears W8A16 (not the default W4A16_LR, whose form is the same on every backend) to keep them
    # apart from the W4A8 linears by kind
    compiled = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation="w8a16", form="fp8")],
                           keep_original=True)
    with torch.no_grad():
        out = compiled(**kw)[0]
    gm = compiled.graph_module
    block = [p for p, m in zm.model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in p]
    adaln = [p for p in block if p.endswith(".linear")]  # norm1.linear, norm1_context.linear, norm.linear
    assert compiled._current().manager.records[-1].result.counts["replaced"] == len(block)
    assert not any(n.target is torch.ops.dit_passes.svdq_w4a4_linear.default for n in gm.graph.nodes)
    w4a4 = len(block) - len(adaln)
    assert sum(n.meta.get("dit_quant") == "svdq_w4a4" for n in gm.graph.nodes) == w4a4
    w8a16 = [n.meta["dit_module_path"] for n in gm.graph.nodes if n.meta.get("dit_quant") == "w8a16"]
    assert sorted(w8a16) == sorted(adaln)
    # a cast to e4m3 per W4A8 linear (its weight, expanded for this call) and per distinct smoothed input (own
    # smoothing vector per linear: none shared); the weight-only modulation linears quantize no activation
    assert sum(n.kwargs.get("dtype") == torch.float8_e4m3fn for n in gm.graph.nodes) == 2 * w4a4

    def form(m, x):
        return _svdq_form(x, prepare_svdquant(m.weight, m.bias, rank=8, smooth="weight", dtype=m.weight.dtype))
    twin = copy.deepcopy(zm.model)
    for path, mod in twin.named_modules():
        if isinstance(mod, torch.nn.Linear) and "blocks." in path:
            mod.register_forward_hook(lambda m, inp, o, p=path: _w8a16_reference(
                inp[0], prepare_w8a16(m.weight, m.bias)) if p in adaln else form(m, inp[0]))
    with torch.no_grad():
        want = twin(**kw)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # the default (auto): the op (true W4A4)
    assert dispatch.svdq_form(kw["hidden_states"], torch.zeros(2, 2, dtype=torch.uint8), "auto") == "op"


# ------------------------------------------------------------------------------ W4A16 (weight-only int4, modulation)
def test_w4a16_error_bound_and_no_activation_error():
    """Every weight element within half its group's scale (``|w - q * wscale| <= wscale / 2``), so each output
    within ``sum_k |x_k| * wscale / 2`` of the exact linear; and weight-only int4 errs less than W4A4 on the same
    int4 weights (plain W4A4, rank 0, no smoothing: the same ``quantize_weight_w4``) when the input has outlier
    channels, the activation error being what it leaves out."""
    x, w, b = _case(torch.float32, (3, 7), k=256, n=64, seed=1)
    q = prepare_w4a16(w, b)
    scale = q.wscale.float().repeat_interleave(64, dim=1)                        # [N, K]: each element's scale
    err_w = (dequantize_weight_w4(q.qweight, q.wscale) - w).abs()
    assert (err_w <= scale / 2 * (1 + 1e-6)).all() and err_w.max() > 0.25 * scale.max() / 2  # tight, not vacuous
    out = w4a16_linear_form(x, q.qweight, q.wscale, q.bias)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    bound = x.double().abs().reshape(-1, 256) @ (scale.double() / 2).t()            # [M, N]
    assert ((out.double() - exact).abs().reshape(-1, 64) <= bound + 1e-5).all()
    plain = prepare_svdquant(w, b, rank=0, smooth="none")
    assert torch.equal(plain.qweight, q.qweight) and torch.equal(plain.wscale, q.wscale)  # the same weights
    err = {"w4a16": relative_error(out, exact), "w4a4": relative_error(svdq_w4a4_linear_reference(x, plain), exact)}
    print({k: round(v, 4) for k, v in err.items()})
    assert 0 < err["w4a16"] < 0.8 * err["w4a4"]  # measured 0.101 vs 0.150


# ------------------------------------------------------------------ W8A16 (weight-only int8, modulation default)
def _w8a16_reference(x, q):
    """The linear of the fp32 dequantized weight (``w8a16.dequantize_w8a16``), in x's dtype."""
    return torch.nn.functional.linear(x, dequantize_w8a16(q.qweight, q.wscale).to(x.dtype),
                                      None if q.bias is None else q.bias.to(x.dtype))


def _w4a16_dequantized(q):
    return dequantize_weight_w4(q.qweight, q.wscale)


def _w8a16_dequantized(q):
    return dequantize_w8a16(q.qweight, q.wscale)


def _dequantized_linear(dequantized):
    """x -> the linear of the fp32 dequantized weight (the forms' fp32 reference)."""
    return lambda x, q: torch.nn.functional.linear(x, dequantized(q), q.bias)


def _w4a16_lr_reference(x, q):
    """The linear of the fp32 dequantized residual plus the low-rank branch, in that order of operations."""
    F = torch.nn.functional
    return F.linear(x, dequantize_weight_w4(q.qweight, q.wscale), q.bias) + F.linear(F.linear(x, q.lora_down),
                                                                                     q.lora_up)


# kind -> (prepare, graph form, fp32 reference linear, fp32 weight it stands for, K, the stored tensors' (dtype,
# shape) for N = 40)
WEIGHT_ONLY = {
    "w8a16": (prepare_w8a16, w8a16_linear_form, _dequantized_linear(_w8a16_dequantized), _w8a16_dequantized, 72,
              {"qweight": (torch.int8, (40, 72)), "wscale": (torch.float32, (40,))}),  # any K
    "w4a16": (prepare_w4a16, w4a16_linear_form, _dequantized_linear(_w4a16_dequantized), _w4a16_dequantized, 192,
              {"qweight": (torch.uint8, (40, 96)), "wscale": (torch.bfloat16, (40, 3))}),
    "w4a16_lr": (prepare_w4a16_lr, w4a16_lr_linear_form, _w4a16_lr_reference, lambda q: q.effective_weight(), 192,
                 {"qweight": (torch.uint8, (40, 96)), "wscale": (torch.bfloat16, (40, 3)),  # rank 32 by default
                  "lora_down": (torch.float32, (32, 192)), "lora_up": (torch.float32, (40, 32))}),
    "nvfp4_weight_only": (prepare_nvfp4_weight_only, nvfp4_weight_only_linear_form,
                          _dequantized_linear(lambda q: q.effective_weight()), lambda q: q.effective_weight(), 96,
                          {"qweight": (torch.uint8, (40, 48)), "wscale": (torch.float8_e4m3fn, (40, 6)),
                           "wglobal": (torch.float32, (1,))}),
}


def _form_args(kind, q):
    """The form's tensor arguments after x, in ``QUANT_KINDS[kind].tensor_args`` order (an absent bias: None)."""
    from dit_passes.patterns import quant_linear as QL

    tensors = q.tensors()
    return [tensors.get(a) for a in QL.QUANT_KINDS[kind].tensor_args]


@pytest.mark.parametrize("kind", list(WEIGHT_ONLY))
@pytest.mark.parametrize("lead", [(2,), (3, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_weight_only_form_is_the_dequantized_linear(kind, lead, with_bias):
    """fp32: bit for bit the linear of the fp32 dequantized weight (int8 * fp32 row scale: the same one product;
    int4 * bf16 group scale: exact in fp32); bf16: that linear up to the bf16 rounding of the weight and the output.
    The traced replacement is plain ATen ops."""
    from dit_passes.patterns import quant_linear as QL

    prepare, form, reference, dequantized, k, stored = WEIGHT_ONLY[kind]
    x, w, b = _case(torch.float32, lead, k=k, n=40)
    q = prepare(w, b if with_bias else None)
    assert {f: (t.dtype, tuple(t.shape)) for f, t in q.tensors().items() if f != "bias"} == stored
    out = form(x, *_form_args(kind, q))
    assert out.shape == (*lead, 40) and out.dtype == torch.float32
    assert torch.equal(out, reference(x, q))
    replacement = QL.QUANT_KINDS[kind].replacement
    assert QL.QUANT_KINDS[kind].op is None  # always the graph form
    assert torch.equal(QL.traced(replacement)(x, *_form_args(kind, q)), out)
    assert all(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"
               for n in QL.traced(replacement).graph.nodes if n.op == "call_function")
    xb, qb = x.to(torch.bfloat16), prepare(w.to(torch.bfloat16), b.to(torch.bfloat16) if with_bias else None)
    out16 = form(xb, *_form_args(kind, qb))
    assert out16.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(xb.float(), dequantized(qb), qb.bias.float() if with_bias else None)
    assert relative_error(out16, exact) < 1e-2


def test_w8a16_error_bound_and_against_int4():
    """Every weight element within half its row's scale (``|w - q * wscale| <= wscale / 2``), so each output within
    ``sum_k |x_k| * wscale[n] / 2`` of the exact linear; a zero row stays zero (scale 1); and weight-only int8 errs
    far less than weight-only int4 on the same weight (127 steps per row vs 7 per group of 64)."""
    x, w, b = _case(torch.float32, (3, 7), k=256, n=64, seed=1)
    w[5] = 0
    q = prepare_w8a16(w, b)
    assert float(q.wscale[5]) == 1.0 and not q.qweight[5].any()
    assert (q.qweight.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()  # each row's largest maps to +-127
    scale = q.wscale.unsqueeze(1).expand_as(w)                                    # [N, K]: each element's scale
    err_w = (dequantize_w8a16(q.qweight, q.wscale) - w).abs()
    assert (err_w <= scale / 2 * (1 + 1e-6)).all() and err_w.max() > 0.25 * scale[:5].max() / 2  # tight
    out = w8a16_linear_form(x, q.qweight, q.wscale, q.bias)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    bound = x.double().abs().reshape(-1, 256) @ (scale.double() / 2).t()            # [M, N]
    assert ((out.double() - exact).abs().reshape(-1, 64) <= bound + 1e-5).all()
    q4 = prepare_w4a16(w, b)
    err = {"w8a16": relative_error(out, exact), "w4a16": relative_error(w4a16_linear_form(x, q4.qweight, q4.wscale,
                                                                                         q4.bias), exact)}
    print({k: round(v, 5) for k, v in err.items()})
    assert 0 < err["w8a16"] < 0.1 * err["w4a16"]


def test_w4a16_lr_errs_less_than_w4a16_on_outliers():
    """A weight with outlier input channels and rows (what widens int4's group scales): the low-rank branch takes
    them, so the int4 residual's scales shrink and weight-only int4 + rank 16 errs far less than W4A16 on the same
    weight; rank 0 without the scale search is W4A16 exactly (empty factors, the same int4 tables); the residual is
    what int4 quantizes, each group's searched scale erring no more than amax / 7 on it."""
    x, w, b = _case(torch.float32, (3, 7), k=256, n=64, seed=2)
    w[:, 5] *= 30
    w[:, 77] *= 20
    w[9] *= 10
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    q4, q = prepare_w4a16(w, b), prepare_w4a16_lr(w, b, rank=16)
    err = {"w4a16": relative_error(w4a16_linear_form(x, q4.qweight, q4.wscale, q4.bias), exact),
           "w4a16_lr": relative_error(w4a16_lr_linear_form(x, q.qweight, q.wscale, q.lora_down, q.lora_up, q.bias),
                                      exact)}
    print({k: round(v, 5) for k, v in err.items()})
    assert 0 < err["w4a16_lr"] < 0.5 * err["w4a16"]
    assert q.wscale.float().amax() < 0.5 * q4.wscale.float().amax()  # the outliers left the int4 part
    residual = w - q.lora_up.float() @ q.lora_down.float()
    amax_scaled = quantize_weight_w4(residual)  # amax / 7 per group: every element within half its scale
    assert ((dequantize_weight_w4(*amax_scaled) - residual).abs()
            <= amax_scaled[1].float().repeat_interleave(64, dim=1) / 2 * (1 + 1e-6)).all()

    def group_sq_err(packed, scales):
        return (dequantize_weight_w4(packed, scales) - residual).square().reshape(64, -1, 64).sum(-1)
    searched, plain = group_sq_err(q.qweight, q.wscale), group_sq_err(*amax_scaled)
    assert (searched <= plain).all() and searched.sum() < plain.sum()  # the search helps, and never hurts a group
    q0 = prepare_w4a16_lr(w, b, rank=0, mse_clip=0)
    assert q0.lora_down.shape == (0, 256) and q0.lora_up.shape == (64, 0)
    assert torch.equal(q0.qweight, q4.qweight) and torch.equal(q0.wscale, q4.wscale)
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        prepare_w4a16_lr(w, b, rank=-1)


@pytest.mark.parametrize("kind", ["w8a16", "w4a16_lr", "nvfp4_weight_only"])
def test_weight_only_form_traces_under_export_and_aot_eager(kind):
    """The form inside a module: torch.export captures it as ATen ops (int8 / int4 -> fp32 cast, scale, linear; the
    low-rank branch's two linears) and torch.compile(aot_eager, fullgraph) runs it with the eager numbers, fp32 and
    bf16."""
    from torch._dynamo.testing import CompileCounterWithBackend

    class Mod(torch.nn.Module):
        def __init__(self, q):
            super().__init__()
            for name, v in q.tensors().items():
                self.register_buffer(name, v)
            self.names = [a if q.tensors().get(a) is not None else None
                          for a in QL.QUANT_KINDS[kind].tensor_args]

        def forward(self, x):
            return form(x, *[None if a is None else getattr(self, a) for a in self.names])

    from dit_passes.patterns import quant_linear as QL

    prepare, form, _, _, k, _ = WEIGHT_ONLY[kind]
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = _case(dtype, (2, 5), k=k, n=40)
        m = Mod(prepare(w.to(dtype), b))
        want = m(x)
        ep = torch.export.export(m, (x,))
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert torch.ops.aten.linear.default in targets and torch.ops.aten._to_copy.default in targets
        assert targets.count(torch.ops.aten.linear.default) == (3 if kind == "w4a16_lr" else 1)
        assert torch.equal(ep.module()(x), want)
        cnt = CompileCounterWithBackend("aot_eager")
        assert torch.equal(torch.compile(m, backend=cnt, fullgraph=True)(x), want) and cnt.frame_count == 1


@pytest.mark.parametrize("cap,setting,k,form", [
    ((9, 0), "auto", 256, "lrcat_split"),  # Hopper: fp8 but no 4-bit tensor cores -> the fastest W4A8 design
    ((9, 0), "auto", 200, "op"),      # ... unless _scaled_mm cannot take the shape
    ((8, 9), "auto", 256, "op"),      # other GPUs: true W4A4
    ((10, 0), "auto", 256, "op"),
    ((8, 9), "fp8", 256, "fp8"),      # asked for
    ((9, 0), "triton", 256, "op"),
])
def test_svdq_form_hopper_default(cap, setting, k, form, monkeypatch):
    from torch._subclasses import FakeTensorMode

    monkeypatch.setattr(dispatch, "capability", lambda device: cap)
    with FakeTensorMode():  # a CUDA tensor's metadata, no GPU needed
        x = torch.empty(1, 4, k, device="cuda", dtype=torch.bfloat16)  # [B, S, K]: tokens
        qweight = torch.empty(64, k // 2, device="cuda", dtype=torch.uint8)
    assert dispatch.svdq_form(x, qweight, setting) == form
    cpu_q = torch.zeros(64, k // 2, dtype=torch.uint8)
    assert dispatch.svdq_form(torch.zeros(1, 4, k), cpu_q, setting) == ("fp8" if setting == "fp8" else "op")  # the CPU


@pytest.mark.parametrize("cap,kernels", [((9, 0), True), ((8, 9), True), ((8, 0), False)])
def test_auto_settings_take_the_kernels_on_fp8_gpus(cap, kernels, monkeypatch):
    """The A-operand and expansion kernels are the default where the e4m3 cast runs (sm_89+), the graph forms on
    older GPUs and the CPU; a setting naming one wins everywhere."""
    from torch._subclasses import FakeTensorMode

    monkeypatch.setattr(dispatch, "capability", lambda device: cap)
    with FakeTensorMode():
        x = torch.empty(1, 4, 256, device="cuda", dtype=torch.bfloat16)
    cpu = torch.zeros(1, 4, 256)
    want = "kernel" if kernels else "graph"
    assert [dispatch.fp8_act_quant("per_row", x), dispatch.w4_expand(x)] == [want, want]
    # the lrcat A operand: aten.mm + the row kernel where the kernels run (measured faster: bench/results/quant_step_lrcat_act_h100.json)
    assert dispatch.lrcat_act_quant(x) == ("mm" if kernels else "graph") and dispatch.lrcat_act_quant(cpu) == "graph"
    assert dispatch.fp8_act_quant("per_tensor", x) == "graph"  # a per-tensor scale stays in the graph form
    assert [dispatch.fp8_act_quant("per_row", cpu), dispatch.w4_expand(cpu), dispatch.w4_expand()] == ["graph"] * 3
    assert [dispatch.fp8_act_quant("per_row", x, "graph"), dispatch.w4_expand(cpu, "kernel")] == ["graph", "kernel"]
