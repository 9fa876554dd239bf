"""``dit_passes::fp8_quantize_rows`` (per-token e4m3 in one Triton kernel, kernels/fp8_rowquant_triton.py): the
kernel against its specification (``fp8_int8.quantize_fp8_act``) bit for bit, the op through ``opcheck`` and
``torch.compile(fullgraph=True)``, the fp8 graph form with the op equal to the ATen form, and
``act_quant="kernel"`` writing the op into the Fp8Linear graph. Without CUDA the kernel runs in
Triton's CPU interpreter (TRITON_INTERPRET=1, set below before triton is imported); with an sm_89+ GPU the last test
checks it on FLUX's shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dit_passes import compile_dit  # noqa: E402
from dit_passes.kernels import fp8_rowquant_triton as K  # noqa: E402
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.passes.quantize import Fp8Linear  # noqa: E402
from dit_passes.quant import dispatch  # noqa: E402
from dit_passes.quant.fp8_int8 import prepare_fp8, quantize_fp8, quantize_fp8_act  # noqa: E402
from dit_passes.quant.graph_forms import LinearShape, fp8_linear_form  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = torch.ops.dit_passes.fp8_quantize_rows.default
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _rows(m, k, dtype, seed=0, device=DEV):
    """Rows with outlier channels, a row of zeros (scale 1), a row of one huge value and tiny ones (e4m3 subnormals
    and flushes), and values that sit on e4m3 rounding ties after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (1 + 30 * (torch.rand(k, generator=g) > 0.97))
    x[min(1, m - 1)] = 0
    if m > 2:
        x[2] = torch.randn(k, generator=g) * 1e-3
        x[2, k // 2] = 1e3
    if m > 3:  # amax 448: scale 1, the values themselves rounded, exact ties included
        x[3] = torch.arange(k) % 64 * 0.0625 + 1.0
        x[3, 0] = 448.0
    return x.to(dtype).to(device)


def _assert_same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and s.shape == s_ref.shape == (q.shape[0], 1)
    assert torch.equal(s.cpu(), s_ref.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))


@pytest.mark.parametrize("m,k", [(5, 64), (4, 3072), (6, 100), (3, 1), (2, 20000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_equals_reference_bit_for_bit(m, k, dtype):
    """One-pass (K <= 16384, power of two or not) and two-pass (K = 20000) programs."""
    if k > K.SINGLE_MAX and dtype != torch.bfloat16:
        pytest.skip("the two-pass program once (bf16) is enough: the dtype only changes its loads (and the "
                    "interpreter takes minutes over 2 x 20000 values)")
    x = _rows(m, k, dtype)
    _assert_same(K.fp8_quantize_rows(x), quantize_fp8_act(x, "per_row"))


def test_kernel_strided_rows_and_empty():
    x = _rows(6, 96, torch.bfloat16)[:, :64]  # a row stride of 96
    _assert_same(K.fp8_quantize_rows(x), quantize_fp8_act(x, "per_row"))
    q, s = K.fp8_quantize_rows(torch.zeros(0, 64, dtype=torch.bfloat16, device=DEV))
    assert q.shape == (0, 64) and s.shape == (0, 1)


def test_reciprocal_form_differs_from_division_only_at_ties():
    """The activations are multiplied by 1 / scale (one division per token) where the weights divide: the two
    differ in the last fp32 bit at times, so in e4m3 by at most one step."""
    x = _rows(64, 512, torch.float32, device="cpu")
    (qa, sa), (qd, sd) = quantize_fp8_act(x, "per_row"), quantize_fp8(x, "per_row")
    assert torch.equal(sa.squeeze(1), sd)
    diff = (qa.float() - qd.float()).abs()
    step = qd.float().abs().clamp_min(2 ** -6) * 2 ** -3
    assert (diff <= step).all() and diff.count_nonzero() < x.numel() * 1e-3


def test_op_opcheck_and_compile():
    x = _rows(8, 64, torch.bfloat16, device="cpu")
    torch.library.opcheck(torch.ops.dit_passes.fp8_quantize_rows, (x,))
    fn = torch.compile(lambda t: OP(t * 2), fullgraph=True, backend="aot_eager")
    _assert_same(fn(x), quantize_fp8_act(x * 2, "per_row"))
    with pytest.raises(ValueError, match="2-D"):
        OP(x.reshape(2, 4, 64))


@pytest.mark.parametrize("lead", [(3, 7), (5,)])
def test_form_with_the_op_equals_the_aten_form(lead):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*lead, 96, generator=g) * torch.linspace(0.1, 4, 96)).to(torch.bfloat16)
    x.view(-1, 96)[0] = 0
    f = prepare_fp8(torch.randn(48, 96, generator=g) * 0.05, None)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    shape = LinearShape.of(x, 48, 96, b, f.wscale)
    want = fp8_linear_form(x, f.qweight, f.wscale, b, shape, "per_row", "reference")
    got = fp8_linear_form(x, f.qweight, f.wscale, b, shape, "per_row", "reference", act_quant="kernel")
    assert torch.equal(got, want)
    fn = torch.compile(lambda t: fp8_linear_form(t, f.qweight, f.wscale, b, shape, "per_row", "reference",
                                                 act_quant="kernel"), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x), want)


def test_setting_writes_the_op_into_the_fp8_graph():
    with pytest.raises(ValueError, match="act_quant must be one of"):
        dispatch.fp8_act_quant("per_row", None, "nope")
    with pytest.raises(ValueError, match="act_quant must be one of"):
        Fp8Linear(act_quant="nope")
    assert dispatch.fp8_act_quant("per_tensor", None, "kernel") == "graph"
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    with_op = compile_dit(zm.model, passes=[Fp8Linear(exclude=(), act_quant="kernel")], example_inputs=kw,
                          keep_original=True)
    aten_form = compile_dit(zm.model, passes=[Fp8Linear(exclude=())], example_inputs=kw, keep_original=True)
    ops = [n for n in with_op.graph_module.graph.nodes if n.target is OP]
    # one per distinct linear input (q / k / v share theirs), no e4m3 cast left outside the op
    assert len(ops) == 26 and all("val" in n.meta for n in ops)
    result = with_op._current().manager.records[-1].result
    assert result.counts["act_quant_ops"] == 26 and "26 activation quantization(s)" in result.report
    assert not any(n.kwargs.get("dtype") == torch.float8_e4m3fn for n in with_op.graph_module.graph.nodes)
    assert not any(n.target is OP for n in aten_form.graph_module.graph.nodes)
    with torch.no_grad():
        assert torch.equal(with_op(**kw)[0], aten_form(**kw)[0])


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (the hardware e4m3 cast)")
@pytest.mark.parametrize("m,k", [(4608, 3072), (4608, 15360), (512, 12288), (4096, 3072), (77, 20000)])
def test_cuda_kernel_equals_reference_on_flux_shapes(m, k):
    """FLUX.1-dev's activation shapes (image + text tokens at 1024x1024): the op on CUDA runs the kernel."""
    x = _rows(m, k, torch.bfloat16, device="cuda")
    assert dispatch.fp8_rowquant_module().is_supported(x)
    _assert_same(OP(x), quantize_fp8_act(x.float().cpu(), "per_row"))


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (the kernel and torch._scaled_mm)")
def test_cuda_rowquant_under_regional_compile():
    """bf16 tiny Flux on the GPU, Fp8Linear with the op: Inductor's regional compile keeps it (fullgraph, its fake
    implementation) and gives the ATen form's output up to bf16 rounding and fusion order."""
    from dit_passes import passes
    from dit_passes.quant.svdquant import relative_error
    zm = build("flux", **FLUX64)
    model = zm.model.to("cuda", torch.bfloat16)
    kw = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in zm.make_inputs().items()}
    kw = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and not k.endswith("_ids") else v
          for k, v in kw.items()}
    graph_form = compile_dit(model, passes=[Fp8Linear(exclude=())], example_inputs=kw, keep_original=True)
    eager = compile_dit(model, passes=[Fp8Linear(exclude=(), act_quant="kernel")], example_inputs=kw,
                        keep_original=True)
    regional = compile_dit(model, passes=[Fp8Linear(exclude=(), act_quant="kernel"), passes.RegionalCompile()],
                           example_inputs=kw, keep_original=True)
    with torch.no_grad():
        ref, out_eager, out = graph_form(**kw)[0], eager(**kw)[0], regional(**kw)[0]
    assert sum(n.target is OP for n in eager.graph_module.graph.nodes) == 26
    # on CUDA the ATen form's amax / 448 is a multiplication by 1 / 448 (a division by a Python scalar), the
    # kernel's a true division: the scales may differ in their last bit, the outputs at a few e4m3 ties
    assert relative_error(out_eager.float(), ref.float()) < 5e-3
    assert relative_error(out.float(), ref.float()) < 2e-2
