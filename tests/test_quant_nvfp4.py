"""NVFP4 as data (dit_passes/quant/nvfp4.py): the e2m1 grid, the layout, the reference linear, the exact fp8 split
GEMM of Hopper (CPU: its reference GEMM; GPU: ``_scaled_mm``, skipped without an sm_89+ GPU), the custom op under
aot_eager, and SVDQuantW4A4(precision="nvfp4") through compile_dit, its checkpoint and dit_passes.load.

References are independent of the code under test where it matters: nearest-grid rounding by brute force over the
15 e2m1 values, the linear in float64 from the dequantized tensors.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from safetensors.torch import load_file

import dit_passes
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import SVDQuantW4A4
from dit_passes.quant import dispatch
from dit_passes.quant import nvfp4 as NV
from dit_passes.quant.graph_forms import LinearShape, svdq_nvfp4_fp8_linear_form

torch.set_num_threads(1)
compile_dit = functools.partial(dit_passes.compile_dit, keep_original=True)
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_e2m1_grid_rounding_codes_and_packing():
    # ties go to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); saturate at 6
    a = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.3, 4.9])
    assert NV.e2m1_round(a).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, 4.0]
    # off the ties: the nearest grid value, by brute force
    r = torch.rand(4000, generator=_gen(1)) * 6.5
    nearest = GRID[(r[:, None] - GRID[None]).abs().argmin(1)]
    ties = ((r[:, None] - GRID[None]).abs().sort(1).values[:, :2].diff(1).abs() < 1e-6).squeeze(1)
    assert torch.equal(NV.e2m1_round(r)[~ties], nearest[~ties])
    values = torch.cat([GRID, -GRID[1:]])
    codes = NV.e2m1_encode(values)
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert torch.equal(NV.e2m1_decode(codes), values)
    assert NV.pack_fp4(torch.tensor([[1, 15, 8, 7]], dtype=torch.uint8)).tolist() == [[0xF1, 0x78]]
    c = torch.randint(0, 16, (3, 32), generator=_gen(2), dtype=torch.uint8)
    assert torch.equal(NV.unpack_fp4(NV.pack_fp4(c)), c)


def test_weight_layout_scales_and_nearest_rounding():
    w = torch.randn(24, 64, generator=_gen(3))
    w[3, 16:32] = 0.0  # an all-zero block
    qweight, wscale, wglobal = NV.quantize_weight_nvfp4(w)
    assert (qweight.dtype, tuple(qweight.shape)) == (torch.uint8, (24, 32))
    assert (wscale.dtype, tuple(wscale.shape)) == (torch.float8_e4m3fn, (24, 4))
    assert (wglobal.dtype, tuple(wglobal.shape)) == (torch.float32, (1,))
    assert wglobal.item() == pytest.approx(w.abs().max().item() / 2688, rel=1e-7)
    s = wscale.float()
    assert s.max().item() == 448.0 and s[3, 1].item() == 0.0
    # each block scale is e4m3(block amax / 6 / global)
    bamax = w.abs().view(24, 4, 16).amax(-1)
    assert torch.equal(s, (bamax / 6 / wglobal).clamp(max=448).to(torch.float8_e4m3fn).float())
    # each value is the grid point nearest to w / (scale * global)
    v = NV.e2m1_decode(NV.unpack_fp4(qweight)).view(24, 4, 16)
    target = w.view(24, 4, 16) / (s.clamp_min(1e-30) * wglobal).unsqueeze(-1)
    signed = torch.cat([GRID, -GRID[1:]])
    dist = (target.unsqueeze(-1) - signed).abs()
    assert torch.all((target - v).abs() <= dist.min(-1).values + 1e-6)
    deq = NV.dequantize_weight_nvfp4(qweight, wscale, wglobal)
    assert torch.equal(deq.view(24, 4, 16), v * s.unsqueeze(-1) * wglobal)
    assert deq[3, 16:32].abs().sum() == 0 and rel(deq, w) < 0.12


@pytest.fixture(scope="module")
def linear_case():
    g = _gen(4)
    n, k = 48, 128
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(2, 5, k, generator=g)
    x[..., :3] *= 30  # outlier channels: smoothing moves them into the weight
    q = NV.prepare_svdquant_nvfp4(w, torch.randn(n, generator=g), act_absmax=x.reshape(-1, k).abs().amax(0), rank=8)
    return w, x, q


def _args(q):
    return (q.qweight, q.wscale, q.wglobal, q.lora_down, q.lora_up, q.smooth_inv, q.bias)


def test_reference_linear_is_the_exact_dequantization(linear_case):
    w, x, q = linear_case
    out = NV.nvfp4_linear_reference(x, *_args(q))
    # independent float64: quantize x_s per token, dequantize both sides, one matmul
    x_s = x.reshape(-1, 128).float() * q.smooth_inv
    vx, sx, gx = NV.nvfp4_quantize(x_s, per_row=True)
    xd = (vx.view(10, 8, 16).double() * sx.double().view(10, 8, 1)).view(10, 128) * gx.double()
    wd = NV.dequantize_weight_nvfp4(q.qweight, q.wscale, q.wglobal).double()
    want = xd @ wd.t() + (x_s.double() @ q.lora_down.double().t()) @ q.lora_up.double().t() + q.bias.double()
    torch.testing.assert_close(out.reshape(10, 48).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(gx.squeeze(1), x_s.abs().amax(1) / 2688)
    assert rel(out, torch.nn.functional.linear(x, w, q.bias)) < 0.15  # 4-bit weights and activations
    assert torch.equal(q.effective_weight(), (wd.float() + q.lora_up @ q.lora_down) * q.smooth_inv)


def test_fp8_split_operands_are_exact(linear_case):
    _, x, q = linear_case
    x_s = x.reshape(-1, 128).float() * q.smooth_inv
    for values, scale8, weight_side in (NV.nvfp4_quantize(x_s, True)[:2] + (False,),
                                        (NV.e2m1_decode(NV.unpack_fp4(q.qweight)), q.wscale, True)):
        op = NV.nvfp4_fp8_operand(values, scale8, weight_side)
        assert op.dtype == torch.float8_e4m3fn and op.shape == (values.shape[0], 4 * 128)
        hi, second, third, lo = op.float().chunk(4, dim=1)
        if not weight_side:
            hi, lo = hi, third
            assert torch.equal(op[:, :128].float(), second)
        else:
            lo = second
            assert torch.equal(third, hi) and torch.equal(lo, op[:, 384:].float())
        exact = NV.block_dequant(values, scale8) * NV.SPLIT_SHIFT
        big = (scale8.float() >= 0.25).repeat_interleave(16, dim=1)  # the module docstring's exactness bound
        assert big.float().mean() > 0.9
        assert torch.equal((hi + lo)[big], exact[big])
        assert torch.all((hi + lo - exact).abs() <= 2.0 ** -9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_form_matches_the_reference_on_cpu(linear_case, dtype):
    _, x, q = linear_case
    x = x.to(dtype)
    lu, ld = q.lora_up.to(dtype), q.lora_down.to(dtype)
    ref = NV.nvfp4_linear_reference(x, q.qweight, q.wscale, q.wglobal, ld, lu, q.smooth_inv, q.bias.to(dtype))
    shape = LinearShape.of(x, 48, 128, q.bias.to(dtype), q.wscale, rank=8)
    got = svdq_nvfp4_fp8_linear_form(x, q.qweight, q.wscale, q.wglobal, ld, lu, q.smooth_inv, q.bias.to(dtype), shape,
                                     "reference")
    assert got.dtype == dtype and got.shape == ref.shape
    # fp32: only the accumulation order differs; bf16: the low-rank product rounded before it is added
    assert rel(got, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


def _sm89():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _sm89(), reason="needs an sm_89+ GPU (fp8 tensor cores, torch._scaled_mm)")
def test_fp8_form_on_scaled_mm_matches_the_reference(linear_case):
    _, x, q = linear_case
    dev = torch.device("cuda")
    x = x.to(dev, torch.bfloat16)
    t = [a.to(dev) for a in _args(q)]
    t[3], t[4], t[6] = t[3].bfloat16(), t[4].bfloat16(), t[6].bfloat16()
    assert dispatch.nvfp4_form(x, 48, 128) == "fp8"
    shape = LinearShape.of(x, 48, 128, t[6], t[1], rank=8)
    got = svdq_nvfp4_fp8_linear_form(x, *t, shape, "scaled_mm")
    on_cpu = svdq_nvfp4_fp8_linear_form(x, *t, shape, "reference")
    ref = NV.nvfp4_linear_reference(x.float(), *[a.float() if a.dtype == torch.bfloat16 else a for a in t])
    assert rel(got.float(), on_cpu.float()) < 1e-2 and rel(got.float(), ref) < 1e-2


def test_custom_op_fake_and_aot_eager(linear_case):
    _, x, q = linear_case
    op = torch.ops.dit_passes.svdq_nvfp4_linear.default
    torch.library.opcheck(op, (x, *_args(q)), test_utils=("test_faketensor",))  # test_schema compares fp8 inputs with mul, unimplemented for e4m3 on CPU
    want = NV.nvfp4_linear_reference(x, *_args(q))
    assert torch.equal(op(x, *_args(q)), want)
    fn = torch.compile(lambda a: op(a, *_args(q)), backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(x), want)
    with pytest.raises(ValueError, match="wscale must be float8_e4m3fn"):
        op(x, q.qweight, q.wscale.float(), *_args(q)[2:])


@pytest.fixture(scope="module")
def flux():
    zm = build("flux", **FLUX64)
    with torch.no_grad():
        ref = zm.model(**zm.make_inputs())[0]
    return zm, ref


def test_pass_checkpoint_layout_load_and_fp8_form(flux, tmp_path):
    zm, ref = flux
    kw = zm.make_inputs()
    # modulation W8A16 (not the default W4A16_LR): its NVFP4 checkpoint reloads bit for bit; with W4A16_LR the
    # reloaded output differs by ~2e-7 (accumulation order)
    compiled = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, precision="nvfp4", modulation="w8a16",
                                                          serialize_to=str(tmp_path))])
    with torch.no_grad():
        out = compiled(**kw)[0]
    res = compiled._current().manager.records[-1].result
    gm = compiled.graph_module
    ops = [n for n in gm.graph.nodes if n.target is torch.ops.dit_passes.svdq_nvfp4_linear.default]
    assert res.counts["kind_svdq_nvfp4"] == len(ops) > 0 and "svdq_w4a4_linear" not in gm.code
    assert 1e-4 < rel(out, ref) < 0.05, rel(out, ref)
    # the checkpoint: NVFP4 layout per linear, named by the quant type
    tensors = load_file(os.path.join(tmp_path, "svdq_nvfp4_r8_dq.safetensors"))
    path = ops[0].meta["dit_module_path"]
    n, k = zm.model.get_submodule(path).weight.shape
    assert tensors[f"{path}.qweight"].dtype == torch.uint8 and tensors[f"{path}.qweight"].shape == (n, k // 2)
    assert tensors[f"{path}.wscale"].dtype == torch.float8_e4m3fn and tensors[f"{path}.wscale"].shape == (n, k // 16)
    assert tensors[f"{path}.wglobal"].dtype == torch.float32 and tensors[f"{path}.wglobal"].shape == (1,)
    loaded = dit_passes.load(zm.model, str(tmp_path), keep_original=True)
    with torch.no_grad():
        assert torch.equal(loaded(**kw)[0], out)
    # the Hopper form, asked for on CPU (its reference GEMM): the same numbers up to accumulation order
    fp8 = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, precision="nvfp4", modulation="w8a16",
                                                     form="fp8")])
    with torch.no_grad():
        got = fp8(**kw)[0]
    assert "svdq_nvfp4_linear" not in fp8.graph_module.code and "float8_e4m3fn" in fp8.graph_module.code
    assert rel(got, out) < 1e-5
    with pytest.raises(ValueError, match="precision must be one of"):
        SVDQuantW4A4(dynamic=True, precision="fp4")
