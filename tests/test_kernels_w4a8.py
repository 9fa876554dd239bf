"""The fused W4A8 Triton kernels (kernels/w4a8_triton.py) against their specification (quant/w4a8.py), and that
specification against the plain dequantized arithmetic.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before triton is imported),
so the shapes are tiny; the module skips where triton does not import. Each linear's error against the bf16 linear
is printed for the designs on the same weights (W4A8 exact / folded group scales, true W4A4).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dit_passes.kernels import w4a8_triton as K  # noqa: E402
from dit_passes.quant import dispatch  # noqa: E402
from dit_passes.quant.graph_forms import w4_to_e4m3  # noqa: E402
from dit_passes.quant.int4 import dequantize_weight_w4  # noqa: E402
from dit_passes.quant.svdquant import prepare_svdquant, relative_error, svdq_w4a4_linear_reference  # noqa: E402
from dit_passes.quant.w4a8 import w4a8_linear_reference, w4a8_quantize_activation  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cuda" and not K.is_supported(torch.zeros(1, 64, device=DEV), torch.zeros(1, 32, dtype=torch.uint8,
                                                                                     device=DEV)):
    pytest.skip("the W4A8 kernels need an sm_89+ GPU (fp8 tensor cores)", allow_module_level=True)
BK128 = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 2}
PREFETCH = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2, "PREFETCH": 1}


def _case(dtype, m=40, k=192, n=48, rank=8, seed=0, bias=True):
    """Activations with outlier channels and a row of zeros (its scale is 1, not 0), SVDQuant PTQ weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (1 + 8 * (torch.rand(k, generator=g) > 0.95))
    x[3] = 0
    w = torch.randn(n, k, generator=g) * k ** -0.5
    b = torch.randn(n, generator=g) if bias else None
    x, w = x.to(dtype), w.to(dtype)
    q = prepare_svdquant(w, b, act_absmax=x.float().abs().amax(0), rank=rank, smooth="act", dtype=dtype)
    b = None if b is None else b.to(dtype)
    return x.to(DEV), w, b, q.to(DEV)


def _args(q, b):
    return q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, None if b is None else b.to(DEV)


def _unpermute(qx: torch.Tensor) -> torch.Tensor:
    """The kernel's qx (per group of 64: 32 even k, then 32 odd k) back in k order."""
    m, k = qx.shape
    g = qx.float().reshape(m, k // 64, 2, 32)
    return torch.stack((g[:, :, 0], g[:, :, 1]), -1).reshape(m, k)


def _close(out, ref):
    """fp32: equal up to the summation order (on the GPU up to Hopper's fp8 MMA, which accumulates in reduced
    precision, as cuBLAS' fast accumulation does); 16-bit: within one unit in the last place of the output (the
    interpreter's fp32 -> bf16 cast truncates)."""
    if out.dtype == torch.float32:
        tol = 2e-3 if DEV == "cuda" else 2e-5
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [192, 256])  # K steps of 64 / 256 in the activation pass
def test_act_quant_matches_reference(dtype, k):
    x, _, _, q = _case(dtype, m=37, k=k)
    qx, sx, la = K.w4a8_act_quant(x, q.smooth_inv, q.lora_down)
    want_q, want_s, xs = w4a8_quantize_activation(x, q.smooth_inv)
    assert qx.dtype == torch.float8_e4m3fn and qx.shape == (37, k) and sx.shape == (37,) and la.shape == (37, 8)
    assert torch.equal(sx, want_s[:, 0]) and sx[3] == 1  # the zero row's scale is 1
    assert torch.equal(_unpermute(qx), want_q.float())  # every e4m3 value, in the GEMM's nibble order
    assert not torch.equal(qx.float(), want_q.float())  # (the order is not k order: the check above means it)
    tol = 1e-4 if DEV == "cuda" else 1e-5  # the GPU sums in another order (tensor cores)
    torch.testing.assert_close(la, xs.to(dtype).float() @ q.lora_down.float().t(), rtol=tol, atol=tol)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, BK128, PREFETCH], ids=["bk64", "bk128", "prefetch"])
def test_linear_matches_reference(fold, dtype, config):
    x, w, b, q = _case(dtype, k=256)
    qx, sx, la = K.w4a8_act_quant(x, q.smooth_inv, q.lora_down)
    out = K.w4a8_gemm(qx, sx, q.qweight, q.wscale, la, q.lora_up, b.to(DEV), dtype, fold=fold, config=config)
    ref = w4a8_linear_reference(x, *_args(q, b), fold=fold)
    assert out.dtype == dtype and out.shape == (40, 48)
    _close(out, ref)
    exact = torch.nn.functional.linear(x.double(), w.double().to(DEV), b.double().to(DEV))
    assert relative_error(out, exact) < 0.08  # SVDQuant-level error, not a broken kernel's


@pytest.mark.parametrize("rank, bias", [(0, True), (8, False)])
def test_linear_without_branch_or_bias(rank, bias):
    x, _, b, q = _case(torch.float32, m=17, k=128, n=40, rank=rank, bias=bias)
    for fold in (False, True):
        out = K.w4a8_linear(x.reshape(1, 17, 128), *_args(q, b), fold=fold)
        assert out.shape == (1, 17, 40)
        _close(out[0], w4a8_linear_reference(x, *_args(q, b), fold=fold))


def test_reference_is_the_dequantized_arithmetic():
    """The specification itself: exact weights (fold=False) = the per-token-scaled e4m3 activations times the
    dequantized int4 weight, plus the branch and bias; fold=True the same with ``w4_to_e4m3``'s weights."""
    x, _, b, q = _case(torch.float32)
    qx, sx, xs = w4a8_quantize_activation(x, q.smooth_inv)
    branch = (xs @ q.lora_down.t()) @ q.lora_up.t() + b.to(DEV)
    want = (qx.float() * sx) @ dequantize_weight_w4(q.qweight, q.wscale).t() + branch
    torch.testing.assert_close(w4a8_linear_reference(x, *_args(q, b)), want, rtol=1e-5, atol=1e-5)
    w8, sw = w4_to_e4m3(q.qweight, q.wscale, q.N, q.K)
    want = (qx.float() * sx) @ (w8.float() * sw[:, None]).t() + branch
    torch.testing.assert_close(w4a8_linear_reference(x, *_args(q, b), fold=True), want, rtol=1e-5, atol=1e-5)


def test_error_vs_bf16_linear():
    """Per-design error on one linear against the bf16 linear (printed) and the exact one: W4A8 with exact weights
    errs least (e4m3 per token is finer than int4 per group; no weight re-rounding), then folded scales, then true
    W4A4. Measured (K 256, N 96, rank 8, outliers): W4A8 0.056, folded 0.057, W4A4 0.092 vs fp64."""
    x, w, b, q = _case(torch.bfloat16, m=64, k=256, n=96, seed=1)
    exact = torch.nn.functional.linear(x.double(), w.double().to(DEV), b.double().to(DEV))
    bf16 = torch.nn.functional.linear(x, w.to(DEV), b.to(DEV))
    outs = {"w4a8": K.w4a8_linear(x, *_args(q, b)), "w4a8_fold": K.w4a8_linear(x, *_args(q, b), fold=True),
            "w4a4": svdq_w4a4_linear_reference(x, q)}
    err = {d: (relative_error(o, bf16), relative_error(o, exact)) for d, o in outs.items()}
    print({d: f"vs bf16 {e[0]:.4f}, vs fp64 {e[1]:.4f}" for d, e in err.items()})
    assert err["w4a8"][1] <= err["w4a8_fold"][1] * 1.02 and err["w4a8_fold"][1] < 0.8 * err["w4a4"][1] < 0.15


def test_op_runs_the_kernels_where_supported():
    """``dispatch.w4a8_linear_cuda`` (the op's CUDA implementation) takes the kernels wherever ``is_supported``
    (everywhere under the interpreter) and equals the op's reference."""
    x, _, b, q = _case(torch.float32, k=128)
    for fold in (False, True):
        ref = torch.ops.dit_passes.svdq_w4a8_linear(x.cpu(), *[None if t is None else t.cpu() for t in _args(q, b)],
                                                   fold)
        _close(dispatch.w4a8_linear_cuda(x, *_args(q, b), fold).cpu(), ref)


def test_bad_shapes_are_named():
    x, _, b, q = _case(torch.float32, k=128)
    with pytest.raises(ValueError, match="multiple of 64"):
        K.w4a8_act_quant(x[:, :96], q.smooth_inv[:96], q.lora_down[:, :96])
    qx, sx, la = K.w4a8_act_quant(x, q.smooth_inv, q.lora_down)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        K.w4a8_gemm(qx, sx, q.qweight[:, :32], q.wscale, la, q.lora_up)
    with pytest.raises(ValueError, match="BLOCK_K=128 must be a multiple of 64 dividing K=192"):
        x2, _, _, q2 = _case(torch.float32, k=192)
        K.w4a8_gemm(*K.w4a8_act_quant(x2, q2.smooth_inv, q2.lora_down)[:2], q2.qweight, q2.wscale, config=BK128)


@pytest.mark.skipif(DEV != "cuda", reason="a FLUX-size K, compiled and autotuned: GPU only")
@pytest.mark.parametrize("fold", [False, True])
def test_flux_size_linear_on_gpu(fold):
    """One FLUX-size K (3072, the attention projections') through the autotuned kernels: the reference's values up
    to bf16 rounding and summation order, and the error against the exact linear of W4A8 (below W4A4's)."""
    x, w, b, q = _case(torch.bfloat16, m=512, k=3072, n=1024, rank=32)
    out = K.w4a8_linear(x, *_args(q, b), fold=fold)
    ref = w4a8_linear_reference(x, *_args(q, b), fold=fold)
    assert relative_error(out, ref) < 1e-2  # bf16 output rounding and the fp8 MMA's accumulation (W4A8: 5e-2)
    exact = torch.nn.functional.linear(x.double(), w.double().to(DEV), b.double().to(DEV))
    assert relative_error(out, exact) < relative_error(svdq_w4a4_linear_reference(x, q), exact)


def test_fold_row_scale_matches_reference():
    from dit_passes.quant.w4a8 import fold_row_scale

    g = torch.Generator().manual_seed(5)
    wscale = (torch.rand(70, 130, generator=g) * 0.03 + 1e-4).to(torch.bfloat16).to(DEV)  # rows / groups past a block
    assert torch.equal(K.fold_row_scale(wscale), fold_row_scale(wscale))
    assert torch.equal(K.fold_row_scale(wscale[:, ::2]), fold_row_scale(wscale[:, ::2]))  # strided
