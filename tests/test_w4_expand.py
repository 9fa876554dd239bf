"""``dit_passes::w4_to_e4m3`` (SVDQuant's packed int4 weights to e4m3 with the group scales folded, one Triton kernel,
kernels/w4_expand_triton.py): the kernel against its specification (``graph_forms.w4_to_e4m3``) byte for byte, the
op through ``opcheck`` and ``torch.compile(fullgraph=True)``, the SVDQuant fp8 form with the op equal to the ATen
form, and ``w4_expand="kernel"`` writing the op into the SVDQuant graph. Without CUDA the kernel runs in
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
from dit_passes.kernels import w4_expand_triton as K  # noqa: E402
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.passes.quantize import SVDQuantW4A4  # noqa: E402
from dit_passes.quant import dispatch  # noqa: E402
from dit_passes.quant.graph_forms import LinearShape, svdq_fp8_linear_form, w4_to_e4m3  # noqa: E402
from dit_passes.quant.int4 import pack_int4  # noqa: E402
from dit_passes.quant.svdquant import prepare_svdquant  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = torch.ops.dit_passes.w4_to_e4m3.default
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _weights(n, k, dtype=torch.bfloat16, seed=0, device=DEV):
    """Packed int4 with every value in row 0, an all-zero group (values) and a zero group scale, scales spread over
    three decades (ratios far below 1: e4m3 subnormals and flushed zeros of either sign)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    q[min(1, n - 1), 64:128 if k >= 128 else 64] = 0
    ws = 10 ** (torch.rand(n, k // 64, generator=g) * 3 - 4)
    if k >= 128:
        ws[-1, 1] = 0
    return pack_int4(q).to(device), ws.to(dtype).to(device)


def _assert_same(got, want):
    (w8, sw), (w8_ref, sw_ref) = got, want
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w8_ref.shape and sw.shape == sw_ref.shape == (w8.shape[0],)
    assert sw.dtype == torch.float32 and torch.equal(sw.cpu(), sw_ref.cpu())
    assert torch.equal(w8.cpu().view(torch.uint8), w8_ref.cpu().view(torch.uint8))


@pytest.mark.parametrize("form", ["bytes", "words"])
@pytest.mark.parametrize("n,k", [(8, 128), (13, 192), (5, 320), (6, 3072), (3, 15360)])
def test_kernel_equals_reference_bit_for_bit(n, k, form):
    """Row blocks with and without a remainder; K chunks of 128 / 64 / 64 / 1024 / 1024 (K = 15360: 15 chunks); a
    thread converting a packed byte or an int32 word of eight values."""
    qw, ws = _weights(n, k)
    _assert_same(K.w4_to_e4m3(qw, ws, form=form), w4_to_e4m3(qw.cpu(), ws.cpu(), n, k))


@pytest.mark.parametrize("form", ["bytes", "words"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_scale_dtypes_and_strides(dtype, form):
    qw, ws = _weights(10, 256, dtype, seed=1)
    wide = torch.zeros(10, 256, dtype=torch.uint8, device=qw.device)
    wide[:, :128] = qw
    want = w4_to_e4m3(qw.cpu(), ws.cpu(), 10, 256)
    _assert_same(K.w4_to_e4m3(wide[:, :128], ws, form=form), want)  # a row stride of 256
    odd = torch.zeros(10 * 130 + 1, dtype=torch.uint8, device=qw.device)
    odd_view = odd[1:].view(10, 130)[:, :128]  # a row stride of 130 bytes, an odd offset: no int32 words
    odd_view.copy_(qw)
    _assert_same(K.w4_to_e4m3(odd_view, ws, form=form), want)


def test_block_k_and_errors():
    assert [K.block_k(k) for k in (64, 192, 3072, 15360, 12288)] == [64, 64, 1024, 1024, 1024]
    qw, ws = _weights(4, 128)
    with pytest.raises(ValueError, match="multiple of 64"):
        K.w4_to_e4m3(qw[:, :16], ws)
    with pytest.raises(ValueError, match=r"wscale must be a float \[4, 2\]"):
        K.w4_to_e4m3(qw, ws[:, :1])


def test_op_opcheck_and_compile():
    qw, ws = _weights(16, 192, device="cpu")
    torch.library.opcheck(torch.ops.dit_passes.w4_to_e4m3, (qw, ws))
    fn = torch.compile(lambda a, s: OP(a, s * 2), fullgraph=True, backend="aot_eager")
    _assert_same(fn(qw, ws), w4_to_e4m3(qw, ws * 2, 16, 192))
    with pytest.raises(ValueError, match="uint8 \\[N, K/2\\]"):
        OP(qw.to(torch.int16), ws)


@pytest.mark.parametrize("lead", [(3, 7), (5,)])
def test_svdq_form_with_the_op_equals_the_aten_form(lead):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*lead, 128, generator=g) * (1 + 8 * (torch.rand(128, generator=g) > 0.97))).to(torch.bfloat16)
    w = ((torch.rand(64, 128, generator=g) * 2 - 1) * 128 ** -0.5).to(torch.bfloat16)
    q = prepare_svdquant(w, None, act_absmax=x.float().abs().reshape(-1, 128).amax(0), rank=8, smooth="act",
                         dtype=torch.bfloat16)
    shape = LinearShape.of(x, q.N, q.K, q.bias, q.wscale, rank=q.rank)
    args = (q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias, shape, "reference")
    want = svdq_fp8_linear_form(x, *args)
    assert torch.equal(svdq_fp8_linear_form(x, *args, expand="kernel"), want)
    fn = torch.compile(lambda t: svdq_fp8_linear_form(t, *args, expand="kernel"), fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(x), want)
    with pytest.raises(ValueError, match="expansion must be one of"):
        svdq_fp8_linear_form(x, *args, expand="cuda")


def test_setting_writes_the_op_into_the_svdq_graph():
    with pytest.raises(ValueError, match="w4_expand must be one of"):
        dispatch.w4_expand(None, "nope")
    with pytest.raises(ValueError, match="w4_expand must be one of"):
        SVDQuantW4A4(rank=8, dynamic=True, form="fp8", w4_expand="nope")
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    with_op = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, form="fp8", w4_expand="kernel")],
                          example_inputs=kw, keep_original=True)
    aten_form = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, form="fp8")], example_inputs=kw,
                            keep_original=True)
    w4a8 = sum(n.meta.get("dit_quant") == "svdq_w4a4" for n in with_op.graph_module.graph.nodes)
    ops = [n for n in with_op.graph_module.graph.nodes if n.target is OP]
    assert w4a8 > 0 and len(ops) == w4a8 and all("val" in n.meta for n in ops)  # one expansion per W4A8 linear
    result = with_op._current().manager.records[-1].result
    assert result.counts["w4_expand_ops"] == w4a8 and f"{w4a8} int4 weight expansion(s)" in result.report
    # the only e4m3 casts left outside the op: the activations', one per W4A8 linear
    assert sum(n.kwargs.get("dtype") == torch.float8_e4m3fn for n in with_op.graph_module.graph.nodes) == w4a8
    assert not any(n.target is OP for n in aten_form.graph_module.graph.nodes)
    with torch.no_grad():
        assert torch.equal(with_op(**kw)[0], aten_form(**kw)[0])


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (the hardware e4m3 cast)")
@pytest.mark.parametrize("n,k", [(3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360), (9216, 3072)])
def test_cuda_kernel_equals_reference_on_flux_shapes(n, k):
    """FLUX.1-dev's weight shapes (q / k / v fused: 9216 rows): the op on CUDA runs the kernel; both forms."""
    qw, ws = _weights(n, k, device="cuda")
    assert dispatch.w4_expand_module().is_supported(qw, ws)
    want = w4_to_e4m3(qw.cpu(), ws.cpu(), n, k)
    _assert_same(OP(qw, ws), want)
    for form in ("bytes", "words"):
        _assert_same(K.w4_to_e4m3(qw, ws, form=form), want)
