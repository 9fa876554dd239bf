"""The lrcat design's A operand in two kernels (``dit_passes::lrcat_quantize_rows``, kernels/lrcat_act_triton.py):
the kernels against their specification (``graph_forms.lrcat_activation``) byte for byte under TRITON_INTERPRET=1,
the specification against an independent computation, the op through ``opcheck`` and ``torch.compile(fullgraph=
True)``, the lrcat form with the op (and with ``lrcat_act="mm"``'s) beside the form's ATen activation
path, ``act_quant="kernel"`` writing the op into the SVDQuant graph, and on an sm_89+ GPU the kernels on
FLUX's shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dit_passes import compile_dit  # noqa: E402
from dit_passes.kernels import lrcat_act_triton as K  # noqa: E402
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.passes.quantize import SVDQuantW4A4  # noqa: E402
from dit_passes.quant import dispatch  # noqa: E402
from dit_passes.quant.fp8_int8 import quantize_fp8_act  # noqa: E402
from dit_passes.quant.graph_forms import LinearShape, lrcat_activation, lrcat_c, svdq_lrcat_linear_form  # noqa: E402
from dit_passes.quant.svdquant import prepare_svdquant, relative_error  # noqa: E402

OP = torch.ops.dit_passes.lrcat_quantize_rows.default
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _inputs(m, k, r, dtype, seed=0):
    """Outlier channels, a zero token (its scale becomes 1), smoothing factors around 1, lora_down rows of norm ~1."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * (1 + 8 * (torch.rand(k, generator=g) > 0.97))).to(dtype)
    x[min(2, m - 1)] = 0
    si = torch.rand(k, generator=g) + 0.5
    ld = (torch.randn(r, k, generator=g) * k ** -0.5).to(dtype)
    return x, si, ld, lrcat_c(ld, k)


def _assert_same(got, want):
    (a, sx), (a_ref, sx_ref) = got, want
    assert a.dtype == torch.float8_e4m3fn and a.shape == a_ref.shape and sx.shape == sx_ref.shape == (a.shape[0], 1)
    assert torch.equal(sx.cpu(), sx_ref.cpu())
    assert torch.equal(a.cpu().view(torch.uint8), a_ref.cpu().view(torch.uint8))


@pytest.mark.parametrize("m,k,r,split,dtype", [(37, 320, 8, False, torch.float32), (37, 320, 8, True, torch.bfloat16),
                                               (16, 512, 32, True, torch.float32), (20, 256, 32, False, torch.bfloat16),
                                               (5, 64, 4, True, torch.bfloat16)])
def test_kernel_equals_specification_bit_for_bit(m, k, r, split, dtype):
    """Token blocks with and without a remainder, K chunks with a partial one (320, 64), ranks padded to 16 / 32
    columns (split: 3R)."""
    x, si, ld, c = _inputs(m, k, r, dtype)
    got = K.lrcat_quantize_rows(x.to(DEV), si.to(DEV), ld.to(DEV), c.to(DEV), split)
    want = lrcat_activation(x, si, ld, c, x.shape[0], ld.shape[0], x.dtype, split)
    if DEV == "cpu":
        _assert_same(got, want)
    else:  # tensor cores sum h in another order: an e4m3 rounding of a branch value may move one step
        _assert_branch_close(got, want, k, r, split)
    if k > K.BLOCK_K:  # several K splits: partial sums of h added in split order, amax exact in any order
        got = K.lrcat_quantize_rows(x.to(DEV), si.to(DEV), ld.to(DEV), c.to(DEV), split, block_k_split=K.BLOCK_K)
        _assert_branch_close(got, want, k, r, split)


def _assert_branch_close(got, want, k, r, split):
    """qx and sx equal; the branch (split: hi + lo) within one e4m3 rounding of the reference's, which an fp32
    summation-order difference in h can move (non-split: on under 1% of the values)."""
    (a, sx), (a_ref, sx_ref) = [(t[0].cpu(), t[1].cpu()) for t in (got, want)]
    assert torch.equal(sx, sx_ref) and torch.equal(a[:, :k].view(torch.uint8), a_ref[:, :k].view(torch.uint8))
    v, v_ref = a[:, k:].float(), a_ref[:, k:].float()
    if split:
        v, v_ref = v[:, :r] + v[:, r:2 * r], v_ref[:, :r] + v_ref[:, r:2 * r]
    err = (v - v_ref).abs()
    step = (2 ** -7 if split else 2 ** -3) * v_ref.abs() + 2 ** -9
    assert (err <= step).all() and (err > 0).float().mean() < 0.01


def test_specification_is_the_documented_arithmetic():
    """Independent of the form's ATen calls: qx / sx the per-token e4m3 quantization of the smoothed x, the branch
    h = x.dtype(xs) @ lora_down.T in fp32 scaled by sx * c, split as [hi | lo | hi | 0]."""
    x, si, ld, c = _inputs(24, 192, 8, torch.bfloat16, seed=1)
    a, sx = lrcat_activation(x, si, ld, c, 24, 8, torch.bfloat16, True)
    xs = x.float() * si
    qx, sx_want = quantize_fp8_act(xs, "per_row")
    h = xs.to(torch.bfloat16).double() @ ld.double().t()
    hs = (h / (sx_want.double() * c.double())).float()
    hi = hs.to(torch.float8_e4m3fn)
    lo = (hs - hi.float()).to(torch.float8_e4m3fn)
    assert a.shape == (24, 192 + 32) and torch.equal(sx, sx_want)
    assert torch.equal(a[:, :192].view(torch.uint8), qx.view(torch.uint8))
    branch = a[:, 192:].float()
    for j, part in enumerate((hi, lo, hi)):
        torch.testing.assert_close(branch[:, 8 * j:8 * j + 8], part.float(), rtol=0.07, atol=2 ** -9)
    assert not branch[:, 24:].any() and (branch[:, :8] + branch[:, 8:16] - hs).abs().max() < 2 ** -5 * hs.abs().max()


def test_op_opcheck_compile_and_errors():
    x, si, ld, c = _inputs(16, 128, 8, torch.bfloat16, seed=2)
    for split in (False, True):
        torch.library.opcheck(torch.ops.dit_passes.lrcat_quantize_rows, (x, si, ld, c, split))
        fn = torch.compile(lambda t: OP(t * 2, si, ld, c, split), fullgraph=True, backend="aot_eager")
        _assert_same(fn(x), lrcat_activation(x * 2, si, ld, c, 16, 8, x.dtype, split))
    with pytest.raises(ValueError, match=r"lora_down must be a float \[R, 128\]"):
        OP(x, si, ld[:, :64], c, False)
    with pytest.raises(ValueError, match="c must be fp32"):
        OP(x, si, ld, c.double(), False)
    with pytest.raises(ValueError, match=r"reshape the activation to \[tokens, K\]"):
        OP(x[None], si, ld, c, False)
    with pytest.raises(ValueError, match="K split must be a multiple of 256"):
        K.lrcat_quantize_rows(x.to(DEV), si.to(DEV), ld.to(DEV), c.to(DEV), False, block_k_split=100)


@pytest.mark.parametrize("split", [False, True])
def test_form_with_the_op_beside_the_aten_form(split):
    """The lrcat form with the op against its ATen path (h rounded to bf16 before the scaling, where a double
    rounding with e4m3 moves ~3% of the branch values by a step): no less accurate, and the two differ by well under
    the form's own error."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 7, 128, generator=g) * (1 + 8 * (torch.rand(128, generator=g) > 0.97))).to(torch.bfloat16)
    w = ((torch.rand(64, 128, generator=g) * 2 - 1) * 128 ** -0.5).to(torch.bfloat16)
    q = prepare_svdquant(w, None, act_absmax=x.float().abs().reshape(-1, 128).amax(0), rank=8, smooth="act",
                         dtype=torch.bfloat16)
    shape = LinearShape.of(x, q.N, q.K, q.bias, q.wscale, rank=q.rank)
    args = (q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias, shape, "reference")
    kernel = svdq_lrcat_linear_form(x, *args, split=split, act_quant="kernel")
    aten_form = svdq_lrcat_linear_form(x, *args, split=split)
    # "mm" (lrcat_act="mm", dit_passes::lrcat_quantize_smoothed): qx from x.dtype(xs), h from aten.mm
    mm = svdq_lrcat_linear_form(x, *args, split=split, act_quant="mm")
    exact = torch.nn.functional.linear(x.double(), w.double())
    err = {"kernel": relative_error(kernel, exact), "aten": relative_error(aten_form, exact),
           "mm": relative_error(mm, exact), "between": relative_error(kernel, aten_form)}
    print(split, err)
    assert err["kernel"] < 1.05 * err["aten"] and 0 < err["between"] < 0.35 * err["aten"]
    assert err["mm"] < 1.05 * min(err["aten"], err["kernel"]) and relative_error(mm, kernel) < 0.35 * err["kernel"]
    fn = torch.compile(lambda t: svdq_lrcat_linear_form(t, *args, split=split, act_quant="kernel"), fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(x), kernel)
    fn = torch.compile(lambda t: svdq_lrcat_linear_form(t, *args, split=split, act_quant="mm"), fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(x), mm)
    with pytest.raises(ValueError, match="A operand.s form must be one of"):
        svdq_lrcat_linear_form(x, *args, act_quant="triton")


def test_setting_writes_the_op_into_the_lrcat_graph():
    """``act_quant="kernel"`` and ``lrcat_act="stats"`` with ``form="lrcat_split"``: one op per W4A8 linear, the
    output equal to the ATen activation path's (an fp32 model: h is fp32 in both)."""
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    passes = [SVDQuantW4A4(rank=8, dynamic=True, modulation="w8a16", form="lrcat_split", act_quant="kernel",
                           lrcat_act="stats")]
    with_op = compile_dit(zm.model, passes=passes, example_inputs=kw, keep_original=True)
    aten_form = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation="w8a16",
                                                           form="lrcat_split", lrcat_act="stats")],
                            example_inputs=kw, keep_original=True)
    nodes = list(with_op.graph_module.graph.nodes)
    w4 = sum(n.meta.get("dit_quant") == "svdq_w4a4" for n in nodes)
    assert w4 > 0 and sum(n.target is OP for n in nodes) == w4
    assert not any(n.target is OP for n in aten_form.graph_module.graph.nodes)
    with torch.no_grad():
        out, ref = with_op(**kw)[0], aten_form(**kw)[0]
    assert torch.equal(out, ref)


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (the hardware e4m3 cast)")
@pytest.mark.parametrize("k", [3072, 12288, 15360])
def test_cuda_kernel_on_flux_shapes(k):
    """FLUX.1-dev's linear inputs (4608 tokens): qx and sx equal the reference's bytes, the branch within one e4m3
    step on under 1% of its values."""
    for split in (False, True):
        x, si, ld, c = _inputs(4608, k, 32, torch.bfloat16, seed=4)
        assert dispatch.lrcat_act_module().is_supported(x.cuda(), ld.cuda())
        got = OP(x.cuda(), si.cuda(), ld.cuda(), c.cuda(), split)
        want = lrcat_activation(x, si, ld, c, x.shape[0], ld.shape[0], x.dtype, split)
        _assert_branch_close(got, want, k, 32, split)
