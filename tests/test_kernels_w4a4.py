"""W4A4 Triton kernels (kernels/w4a4_triton.py) against a pure-PyTorch oracle of the W4A4 spec.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before triton is
imported), so the shapes are tiny. With CUDA the same tests run compiled, plus one larger-shape test.
The oracle here is written independently of dit_passes.quant; the tests also compare with that module's
references when it imports.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dit_passes.kernels import w4a4_triton as K  # noqa: E402

try:
    from dit_passes.quant import int4 as quant_int4
    from dit_passes.quant.svdquant import SVDQuantWeight, svdq_w4a4_linear_reference
except ImportError:  # the reference module is optional for these tests
    quant_int4 = None

DEV = "cuda" if torch.cuda.is_available() else "cpu"
G = 64


# ------------------------------------------------------------------------------- oracle (the spec)


def o_pack(q: torch.Tensor) -> torch.Tensor:
    q = q.to(torch.int32)
    return ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)


def o_unpack(p: torch.Tensor) -> torch.Tensor:
    p = p.to(torch.int32)
    nib = torch.stack((p & 0xF, (p >> 4) & 0xF), dim=-1).reshape(p.shape[0], -1)
    return torch.where(nib >= 8, nib - 16, nib)


def o_act_quant(x, smooth_inv, lora_down):
    xs = x.float().cpu() * smooth_inv.float().cpu()
    m, k = xs.shape
    g = xs.reshape(m, k // G, G)
    ascale = g.abs().amax(-1) / torch.tensor(7.0)  # tensor divisor: IEEE division on every device
    ascale = torch.where(ascale == 0, torch.ones_like(ascale), ascale)
    q = torch.clamp(torch.round(g / ascale[..., None]), -8, 7).reshape(m, k)
    lora = xs.to(x.dtype).double() @ lora_down.cpu().double().t()
    return o_pack(q), ascale, lora


def o_int_dots(qx_packed, qw_packed):
    """[NG, M, N] int64 exact group dot products."""
    qa, qb = o_unpack(qx_packed.cpu()).long(), o_unpack(qw_packed.cpu()).long()
    ng = qa.shape[1] // G
    return torch.stack([qa[:, i * G:(i + 1) * G] @ qb[:, i * G:(i + 1) * G].t() for i in range(ng)])


def o_gemm(qx_packed, ascale, qw_packed, wscale, lora_act=None, lora_up=None, bias=None):
    """fp32, group by group in the spec's order: acc += (ascale*wscale) * dot; + lora; + bias."""
    dots = o_int_dots(qx_packed, qw_packed).float()
    a, w = ascale.float().cpu(), wscale.float().cpu()
    acc = torch.zeros(dots.shape[1:])
    for i in range(dots.shape[0]):
        acc = acc + (a[:, i:i + 1] * w[:, i][None, :]) * dots[i]
    if lora_act is not None and lora_act.shape[1]:
        acc = acc + lora_act.float().cpu() @ lora_up.float().cpu().t()
    if bias is not None:
        acc = acc + bias.float().cpu()
    return acc


def make_weight(n, k, gen):
    q = torch.randint(-8, 8, (n, k), generator=gen)
    wscale = (torch.rand(n, k // G, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return o_pack(q).to(DEV), wscale.to(DEV)


def make_input(m, k, dtype, gen):
    """Random activations with the edge cases: a zero group, a group of exact .5 ties, an outlier."""
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :G] = 0.0
    if m > 1:
        x[1, :G] = torch.arange(G, dtype=torch.float32).remainder(14) - 6.5  # amax 7 -> ties at k + 0.5
        x[1, 0] = 7.0
    if m > 2:
        x[2, G - 1] = 1e4
    return x.to(dtype).to(DEV)


def rel_err(out, ref):
    ref = ref.double().cpu()
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("m,k,r", [(1, 64, 4), (33, 192, 8), (64, 192, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_act_quant_bit_exact(m, k, r, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k + r)
    x = make_input(m, k, dtype, gen)
    si = (torch.rand(k, generator=gen) + 0.5).to(DEV)
    si[:G] = 1.0  # keep the tie row's quotients exact halves
    ld = (torch.randn(r, k, generator=gen) * 0.1).to(dtype).to(DEV)
    qx_ref, as_ref, la_ref = o_act_quant(x, si, ld)
    for split in (1, 2):
        qx, ascale, la = K.fused_act_quant(x, si, ld, split_k=split)
        assert qx.dtype == torch.uint8 and qx.shape == (m, k // 2)
        assert ascale.dtype == torch.float32 and ascale.shape == (m, k // G)
        assert la.dtype == torch.float32 and la.shape == (m, r)
        assert torch.equal(qx.cpu(), qx_ref), f"packed activations differ (split_k={split})"
        assert torch.equal(ascale.cpu(), as_ref), f"activation scales differ (split_k={split})"
        assert rel_err(la, la_ref) < 1e-5
        if quant_int4 is not None:
            q2, a2, l2 = quant_int4.fused_act_quant_reference(x, si, ld)
            assert torch.equal(qx.cpu(), q2.cpu()) and torch.equal(ascale.cpu(), a2.cpu())
            assert rel_err(la, l2) < 1e-5


def test_act_quant_round_half_even_and_zero_group():
    # smooth_inv = 1 and amax = 7 give ascale = 1, so x itself is the quotient: ties must go to even.
    row = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -7.0, 6.5, -6.5, 4.5] + [0.0] * 52)
    x = torch.stack([row, torch.zeros(64)]).to(DEV)
    qx, ascale, _ = K.fused_act_quant(x, torch.ones(64, device=DEV), torch.zeros(0, 64, device=DEV))
    q = o_unpack(qx.cpu())
    assert q[0, :12].tolist() == [7, 0, 2, 2, 0, -2, -2, 4, -7, 6, -6, 4]
    assert ascale.cpu().tolist() == [[1.0], [1.0]]  # the all-zero group gets scale 1
    assert q[1].abs().sum() == 0


@pytest.mark.parametrize("mma", ["int8", "fp8"])
def test_gemm_integer_part_exact(mma):
    gen = torch.Generator().manual_seed(7)
    m, n, k = 33, 48, 192
    qa = torch.randint(-8, 8, (m, k), generator=gen)
    qa[0] = -8  # extreme sums: 64 * 64 per group
    qx = o_pack(qa).to(DEV)
    qw, _ = make_weight(n, k, gen)
    qw[0] = o_pack(torch.full((1, k), -8)).to(DEV)
    ones_a = torch.ones(m, k // G, device=DEV)
    ones_w = torch.ones(n, k // G, dtype=torch.bfloat16, device=DEV)
    exact = o_int_dots(qx, qw).sum(0)
    out = K.w4a4_gemm(qx, ones_a, qw, ones_w, None, None, None, torch.float32, mma=mma)
    assert torch.equal(out.cpu().to(torch.int64), exact) and torch.equal(out.cpu(), exact.float())
    assert exact[0, 0] == 64 * k
    if mma == "int8":
        assert torch.equal(K.w4a4_gemm_dot_ceiling(qx, ones_a, qw, ones_w).cpu(), exact.float())


@pytest.mark.parametrize("m,n,k,r", [(1, 32, 64, 4), (33, 48, 192, 8), (64, 48, 64, 8)])
@pytest.mark.parametrize("mma", ["int8", "fp8"])
def test_gemm_full_fp32(m, n, k, r, mma):
    gen = torch.Generator().manual_seed(m + n + k + r)
    qx = o_pack(torch.randint(-8, 8, (m, k), generator=gen)).to(DEV)
    ascale = (torch.rand(m, k // G, generator=gen) + 0.1).to(DEV)
    qw, wscale = make_weight(n, k, gen)
    la = torch.randn(m, r, generator=gen).to(DEV)
    lu = (torch.randn(n, r, generator=gen) * 0.1).to(DEV)
    bias = torch.randn(n, generator=gen).to(DEV)
    out = K.w4a4_gemm(qx, ascale, qw, wscale, la, lu, bias, torch.float32, mma=mma)
    ref = o_gemm(qx, ascale, qw, wscale, la, lu, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    if quant_int4 is not None:
        ref2 = quant_int4.w4a4_gemm_reference(qx, ascale, qw, wscale, la, lu, bias, torch.float32)
        assert rel_err(out, ref2) < 1e-5
    # bf16 output: the same value rounded once (tf32 low-rank product): within one bf16 ulp-ish.
    out16 = K.w4a4_gemm(qx, ascale, qw, wscale, la, lu.to(torch.bfloat16), bias, torch.bfloat16, mma=mma)
    ref16 = o_gemm(qx, ascale, qw, wscale, la, lu.to(torch.bfloat16), bias)
    torch.testing.assert_close(out16.cpu().float(), ref16, rtol=2 ** -7, atol=2 ** -7 * float(ref16.abs().max()))


def test_gemm_transposed_ascale_view_and_no_lora():
    gen = torch.Generator().manual_seed(3)
    m, n, k = 33, 32, 128
    qx = o_pack(torch.randint(-8, 8, (m, k), generator=gen)).to(DEV)
    ascale = (torch.rand(m, k // G, generator=gen) + 0.1).to(DEV)
    qw, wscale = make_weight(n, k, gen)
    out_rowmajor = K.w4a4_gemm(qx, ascale, qw, wscale)
    out_colmajor = K.w4a4_gemm(qx, ascale.t().contiguous().t(), qw, wscale)
    assert torch.equal(out_rowmajor, out_colmajor)
    assert rel_err(out_rowmajor, o_gemm(qx, ascale, qw, wscale)) < 1e-5


@pytest.mark.parametrize("dtype,r", [(torch.float32, 8), (torch.bfloat16, 4), (torch.float32, 0)])
def test_linear_end_to_end(dtype, r):
    gen = torch.Generator().manual_seed(11 + r)
    m, n, k = 33, 48, 192
    x = make_input(m, k, dtype, gen).reshape(3, 11, k)
    si = (torch.rand(k, generator=gen) + 0.5).to(DEV)
    qw, wscale = make_weight(n, k, gen)
    ld = (torch.randn(r, k, generator=gen) * 0.05).to(dtype).to(DEV)
    lu = (torch.randn(n, r, generator=gen) * 0.05).to(dtype).to(DEV)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEV)
    out = K.w4a4_linear(x, qw, wscale, ld, lu, si, bias)
    assert out.shape == (3, 11, n) and out.dtype == dtype
    qx_r, as_r, la_r = o_act_quant(x.reshape(m, k), si, ld)
    ref = o_gemm(qx_r, as_r, qw, wscale, la_r, lu, bias).reshape(3, 11, n)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert rel_err(out, ref) < tol
    if quant_int4 is not None:
        w = SVDQuantWeight(qweight=qw, wscale=wscale, lora_down=ld, lora_up=lu, smooth_inv=si, bias=bias,
                           N=n, K=k, rank=r)
        assert rel_err(out, svdq_w4a4_linear_reference(x, w)) < tol


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 96, device=DEV)
    with pytest.raises(ValueError, match="multiple of 64"):
        K.fused_act_quant(x, torch.ones(96, device=DEV), torch.zeros(0, 96, device=DEV))
    with pytest.raises(ValueError, match="smooth_inv"):
        K.fused_act_quant(torch.randn(4, 64, device=DEV), torch.ones(32, device=DEV), torch.zeros(0, 64, device=DEV))
    with pytest.raises(TypeError, match="x must be"):
        K.fused_act_quant(torch.ones(4, 64, dtype=torch.int32, device=DEV), torch.ones(64, device=DEV),
                          torch.zeros(0, 64, device=DEV))
    qx = torch.zeros(4, 32, dtype=torch.uint8, device=DEV)
    qw = torch.zeros(8, 64, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="qw_packed packs"):
        K.w4a4_gemm(qx, torch.ones(4, 1, device=DEV), qw, torch.ones(8, 2, device=DEV))
    with pytest.raises(ValueError, match="both lora_act and lora_up"):
        K.w4a4_gemm(qx, torch.ones(4, 1, device=DEV), qw[:, :32], torch.ones(8, 1, device=DEV),
                    lora_act=torch.zeros(4, 2, device=DEV))
    with pytest.raises(ValueError, match="mma must be"):
        K.w4a4_gemm(qx, torch.ones(4, 1, device=DEV), qw[:, :32], torch.ones(8, 1, device=DEV), mma="int4")
    assert K.is_supported(torch.randn(2, 64, device=DEV), qw)
    assert not K.is_supported(torch.randn(2, 96, device=DEV), qw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernels, autotuned tiles)")
@pytest.mark.parametrize("mma", ["int8", "fp8"])
def test_cuda_larger_shape(mma):
    if mma == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    gen = torch.Generator().manual_seed(5)
    m, n, k, r = 300, 384, 1024, 32
    x = make_input(m, k, torch.bfloat16, gen)
    si = (torch.rand(k, generator=gen) + 0.5).to(DEV)
    qw, wscale = make_weight(n, k, gen)
    ld = (torch.randn(r, k, generator=gen) * 0.05).to(torch.bfloat16).to(DEV)
    lu = (torch.randn(n, r, generator=gen) * 0.05).to(torch.bfloat16).to(DEV)
    qx, ascale, la = K.fused_act_quant(x, si, ld)
    qx_r, as_r, la_r = o_act_quant(x, si, ld)
    assert torch.equal(qx.cpu(), qx_r) and torch.equal(ascale.cpu(), as_r)
    out = K.w4a4_gemm(qx, ascale, qw, wscale, la, lu, None, torch.float32, mma=mma)
    assert rel_err(out, o_gemm(qx_r, as_r, qw, wscale, la_r, lu)) < 1e-5
