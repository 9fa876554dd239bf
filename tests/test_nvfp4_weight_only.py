"""cache-dit's ``nvfp4_weight_only`` (``quant/nvfp4_weight_only.py``, ``passes.NVFP4WeightOnly``): NVFP4 weights (e2m1
values, e4m3 scales per 16 along K, an fp32 global scale per tensor), the activations unquantized.

The reference is written here from the format's definition, not from ``quant/nvfp4.py``: nearest-grid rounding by
brute force over the e2m1 magnitudes (ties to the even code), the dequantized weight in float64. The run through the
front end (error bound, every block linear rewritten, weights held once, aot_eager fullgraph, serialize / load) is
``test_frontend_quant_types.py``'s ``TYPES`` entry; here: the linear's arithmetic, the stored bits per weight, the
selection options, and torchao's own tables where torchao is installed.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dit_passes.frontend import QuantizeConfig, enable_cache
from dit_passes.quant.nvfp4 import dequantize_weight_nvfp4
from dit_passes.quant.nvfp4_weight_only import nvfp4_weight_only_linear_form, prepare_nvfp4_weight_only

pytest.importorskip("diffusers")
from test_frontend_quant_types import block_linears, rel, run, tiny_flux  # noqa: E402

torch.set_num_threads(1)
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # e2m1 magnitudes by code


def independent_qdq(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize of w [N, K] in float64: global ``g = amax / (6 * 448)`` (fp32), block scale
    ``s = e4m3((block amax / 6) / g)``, value = nearest e2m1 to ``w / (s * g)`` (ties to the even code, saturating),
    result ``value * s * g``."""
    n, k = w.shape
    w32 = w.detach().float()
    g = w32.abs().max() / 2688.0
    blocks = w32.view(n, k // 16, 16)
    s = ((blocks.abs().amax(-1) / 6.0) / g).clamp(max=448.0).to(torch.float8_e4m3fn).double()   # [N, K/16]
    scale = (s * g.double()).unsqueeze(-1)
    target = (blocks.double() / torch.where(scale == 0, 1.0, scale)).abs()
    dist = (target.unsqueeze(-1) - GRID).abs()
    tie = dist == dist.amin(-1, keepdim=True)
    codes = torch.arange(8)
    even = torch.where(tie & (codes % 2 == 0), codes, 99).amin(-1)
    code = torch.where(even < 99, even, torch.where(tie, codes, 99).amin(-1))
    values = GRID[code] * blocks.sign().double()
    return (values * scale).view(n, k)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(1, k, generator=g).pow(4) * 3  # columns of very unequal range
    w[1, 16:32] = 0.0      # an all-zero block: its scale is 0
    # a block whose abs-max is 1e-5 of the tensor's: its scale 448e-5 is an e4m3 subnormal (under 2**-6)
    block = torch.randn(16, generator=g)
    w[2, 32:48] = block / block.abs().max() * w.abs().max() * 1e-5
    return w


def test_linear_is_f_linear_of_the_nvfp4_dequantized_weight():
    n, k = 40, 96
    w, b = _weight(n, k, 0), torch.randn(n, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(2))
    q = prepare_nvfp4_weight_only(w, b)
    assert (q.qweight.dtype, tuple(q.qweight.shape)) == (torch.uint8, (n, k // 2))
    assert (q.wscale.dtype, tuple(q.wscale.shape)) == (torch.float8_e4m3fn, (n, k // 16))
    assert (q.wglobal.dtype, tuple(q.wglobal.shape)) == (torch.float32, (1,))
    want_w = independent_qdq(w)
    assert want_w[1, 16:32].abs().sum() == 0 and 0 < q.wscale[2, 2].float() < 2 ** -6   # zero and subnormal scales
    # the stored weight is the definition's, to fp32 rounding of the global scale's product
    torch.testing.assert_close(q.effective_weight().double(), want_w, rtol=2 ** -23, atol=0)
    out = nvfp4_weight_only_linear_form(x, *q.tensors().values())
    assert out.dtype == torch.float32 and out.shape == (3, 5, n)
    torch.testing.assert_close(out, F.linear(x, want_w.float(), b), rtol=1e-5, atol=1e-6)
    assert 0.01 < rel(out, F.linear(x, w, b)) < 0.15   # 4-bit weights: an error, and a small one
    # bf16 activations: the weight dequantized to bf16, then the bf16 linear (torchao's weight-only NVFP4 does so)
    xb, bb = x.bfloat16(), b.bfloat16()
    q16 = prepare_nvfp4_weight_only(w.bfloat16(), bb)
    got = nvfp4_weight_only_linear_form(xb, *q16.tensors().values())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(xb, q16.effective_weight().bfloat16(), bb))
    with pytest.raises(ValueError, match="multiple"):
        prepare_nvfp4_weight_only(torch.randn(8, 24))


def test_front_end_bits_per_weight_tables_and_selection():
    """Through enable_cache: each block linear's tables are the definition's NVFP4 of its weight, 4.5 bits per
    weight plus the 32-bit global; ``regional_quantize=False`` with ``exclude_layers`` reaches the linears outside
    the blocks, leaving those with K % 16 != 0 (listed) and the excluded ones."""
    originals = {p: m.weight.detach().clone() for p, m in tiny_flux().named_modules()
                 if isinstance(m, torch.nn.Linear)}
    tr = tiny_flux()
    wrapper = enable_cache(tr, quantize_config=QuantizeConfig(quant_type="nvfp4_weight_only"))
    run(wrapper)
    gm = wrapper.graph_module
    state = dict(gm.named_buffers())
    paths = sorted(block_linears(tr))
    bits = elements = 0
    for p in paths:
        tab = {f: state[f"{p}.{f}"] for f in ("qweight", "wscale", "wglobal")}
        bits += 8 * sum(t.numel() * t.element_size() for t in tab.values())
        elements += originals[p].numel()
        deq = dequantize_weight_nvfp4(*tab.values())
        torch.testing.assert_close(deq.double(), independent_qdq(originals[p]), rtol=2 ** -23, atol=0)
    assert bits / elements == pytest.approx(4.5 + 32 * len(paths) / elements, rel=1e-12)
    assert 4.5 < bits / elements < 4.52, bits / elements

    tr = tiny_flux()
    cfg = QuantizeConfig(quant_type="nvfp4_weight_only", regional_quantize=False, exclude_layers=["ff_context"])
    wrapper = enable_cache(tr, quantize_config=cfg)
    run(wrapper)
    got = {n.meta["dit_module_path"] for n in wrapper.graph_module.graph.nodes
           if n.meta.get("dit_quant") == "nvfp4_weight_only"}
    linears = {p: m for p, m in tr.named_modules() if isinstance(m, torch.nn.Linear)}
    want = {p for p, m in linears.items() if "ff_context" not in p and m.in_features % 16 == 0}
    assert got == want and "proj_out" in got and "x_embedder" in got
    assert any(m.in_features % 16 for m in linears.values())  # some linear was left for its K
    assert "K % 16 != 0" in wrapper.explain()


def test_precision_plan_takes_nvfp4_weight_only():
    tr = tiny_flux()
    cfg = QuantizeConfig(quant_type="int8_per_tensor", precision_plan={"ff.net": "nvfp4_weight_only"})
    wrapper = enable_cache(tr, quantize_config=cfg)
    run(wrapper)
    kinds = {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in wrapper.graph_module.graph.nodes
             if n.meta.get("dit_quant")}
    assert kinds["transformer_blocks.0.ff.net.0.proj"] == kinds["transformer_blocks.0.ff.net.2"] == "nvfp4_weight_only"
    assert kinds["transformer_blocks.0.attn.to_q"] == "int8_per_tensor"


def test_tables_match_torchao_nvfp4_weight_only():
    """Where torchao is installed: cache-dit's ``NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)`` on the
    same linear dequantizes to our weight (the same global, block scales and e2m1 values) and gives our output, but
    in a block whose scale is an e4m3 subnormal here: torchao raises such scales to 2**-6 (module docstring of
    ``quant/nvfp4_weight_only.py``)."""
    iw = pytest.importorskip("torchao.prototype.mx_formats.inference_workflow")
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(256, 128)
    with torch.no_grad():
        lin.weight.copy_(_weight(128, 256, 3))
    m = torch.nn.Sequential(torch.nn.Linear(256, 128))
    m[0].load_state_dict(lin.state_dict())
    quantize_(m, iw.NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True))
    theirs = m[0].weight.dequantize(torch.float32)
    q = prepare_nvfp4_weight_only(lin.weight, lin.bias)
    ours = q.effective_weight()
    subnormal = (q.wscale.float() < 2 ** -6) & (q.wscale.float() > 0)
    assert subnormal.nonzero().tolist() == [[2, 2]]  # the block _weight scaled by 1e-5
    same = ~subnormal.repeat_interleave(16, dim=1)
    torch.testing.assert_close(ours[same], theirs[same], rtol=2 ** -23, atol=0)
    assert rel(theirs[~same], ours[~same]) < 0.5  # that block: a coarser grid there, the same magnitudes
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        mine, ao_out = nvfp4_weight_only_linear_form(x, *q.tensors().values()), m(x)
    rows = torch.arange(128) != 2  # output feature 2 reads the subnormal block
    # the weights agree to 1 ulp (above); the outputs are fp32 sums of 256 products in two summation orders
    # (which also depend on the threads the BLAS uses), so an output near zero differs by a few 1e-6
    torch.testing.assert_close(mine[:, rows], ao_out[:, rows], rtol=1e-5, atol=1e-5)
