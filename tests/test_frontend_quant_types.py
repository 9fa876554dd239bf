"""cache-dit 1.5.3's torchao quant types beyond per-row / per-tensor fp8 and per-row int8 (int4_weight_only,
nvfp4 and nvfp4_weight_only among them), and its SVDQ DQ
``smooth_strategy="weight_inv"``, through ``enable_cache(..., quantize_config=QuantizeConfig(quant_type=...))``.

Per type: the quantized output against the unquantized one within a bound (measured errors on this model are
about a third of each bound, written beside it), every selected block linear rewritten to the type's kind, the
weights held once (the user's module holds meta tensors in place of the replaced weights, the graph only the
low-bit tables, fewer bytes), and the same graph under ``torch.compile(backend="aot_eager", fullgraph=True)`` with
the eager numbers.
Tiny FLUX of hidden size 128, so that ``float8_per_block``'s 128 x 128 tiles divide every block linear.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from dit_passes import compile_dit
from dit_passes.frontend import QuantizeConfig, enable_cache, load, strify
from dit_passes.quant.fp8_block import dequantize_fp8_blocks, fp8_block_linear_reference, prepare_fp8_block
from dit_passes.quant.fp8_int8 import int8_linear_reference, prepare_fp8, prepare_int8
from dit_passes.quant.weight_only_forms import w8a16_linear_form
from dit_passes.quant.svdquant import smoothing_vector

pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402

torch.set_num_threads(1)
TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16
# type -> (kind written into the graph, low-bit weight dtype, bound on the relative output error; measured on
# tiny_flux, the bounds set with 2 + 2 blocks, where the errors were about 1.4x these)
TYPES = {"int8_weight_only": ("w8a16", torch.int8, 0.002),                  # measured 3.2e-4
         "float8_weight_only": ("fp8_weight_only", torch.float8_e4m3fn, 0.01),  # 2.1e-3
         "int8_per_tensor": ("int8_per_tensor", torch.int8, 0.005),           # 1.0e-3
         "float8_per_block": ("fp8_per_block", torch.float8_e4m3fn, 0.015),   # 2.8e-3
         "int4_weight_only": ("w4a16", torch.uint8, 0.025),                   # 5.8e-3
         "nvfp4": ("svdq_nvfp4", torch.uint8, 0.045),                         # 1.1e-2
         "nvfp4_weight_only": ("nvfp4_weight_only", torch.uint8, 0.03)}       # 7.5e-3


def tiny_flux() -> FluxTransformer2DModel:
    """One double-stream block and two single ones (enable_cache takes a model with a list of repeated blocks):
    each type's case compiles the whole graph under aot_eager, whose cost grows with the depth."""
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=1, num_single_layers=2,
                                  attention_head_dim=64, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=POOLED_DIM, guidance_embeds=True,
                                  axes_dims_rope=(16, 24, 24)).eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, IN_CH, generator=g),
                encoder_hidden_states=torch.randn(1, 7, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(1, POOLED_DIM, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(7, 3), guidance=torch.tensor([3.5]),
                return_dict=False)


def run(module):
    with torch.no_grad():
        return module(**inputs())[0]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def block_linears(model):
    """The linears cache-dit's default config quantizes here: inside the blocks, the AdaLN ``norm*.linear`` not."""
    return {p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in p
            and not p.endswith(".linear")}


@pytest.mark.parity("QuantizeConfig", "QuantizeConfig.quant_type")
@pytest.mark.parametrize("quant_type", list(TYPES))
def test_quant_type_through_enable_cache(quant_type):
    kind, low_bit, bound = TYPES[quant_type]
    tr = tiny_flux()
    want = run(tr)
    weights = {p: tr.get_submodule(p).weight for p in block_linears(tr)}
    bytes_before = sum(w.numel() * w.element_size() for w in weights.values())
    wrapper = enable_cache(tr, quantize_config=QuantizeConfig(quant_type=quant_type))
    got = run(wrapper)
    assert strify(wrapper) == quant_type
    gm = wrapper.graph_module
    quantized = {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in gm.graph.nodes if n.meta.get("dit_quant")}
    assert quantized == {p: kind for p in weights}
    assert 0 < rel(got, want) < bound, rel(got, want)
    # held once: the module's weights released (meta), the graph holds the low-bit tables and not the originals
    assert all(tr.get_submodule(p).weight.is_meta for p in weights)
    state = dict(gm.named_parameters()) | dict(gm.named_buffers())
    assert not any(f"{p}.weight" in state for p in weights)
    tables = [state[f"{p}.qweight"] for p in weights]
    assert all(t.dtype == low_bit for t in tables)
    scales = sum(state[f"{p}.wscale"].numel() * 4 for p in weights)
    assert sum(t.numel() for t in tables) + scales < 0.3 * bytes_before  # fp32 model: a quarter, plus the scales

    # the same pass under torch.compile(aot_eager, fullgraph): one graph, the eager numbers
    fresh = tiny_flux()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = compile_dit(fresh, passes=[QuantizeConfig(quant_type=quant_type).to_pass(fresh)],
                           example_inputs=inputs(), torch_compile={"backend": cnt, "fullgraph": True})
    out = run(compiled)
    assert cnt.frame_count == 1 and len(cnt.graphs) == 1
    torch.testing.assert_close(out, got, rtol=1e-5, atol=1e-6)


def test_precision_plan_takes_the_new_types():
    tr = tiny_flux()
    plan = {"attn.to_q": "float8_per_block", "ff.net": "int8_weight_only", "attn.to_k": "nvfp4",
            "attn.to_v": "int4_weight_only"}
    wrapper = enable_cache(tr, quantize_config=QuantizeConfig(quant_type="int8_per_tensor", precision_plan=plan))
    run(wrapper)
    kinds = {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in wrapper.graph_module.graph.nodes
             if n.meta.get("dit_quant")}
    assert kinds["transformer_blocks.0.attn.to_q"] == "fp8_per_block"
    assert kinds["transformer_blocks.0.ff.net.0.proj"] == "w8a16"
    assert kinds["transformer_blocks.0.attn.add_k_proj"] == "int8_per_tensor"
    assert kinds["transformer_blocks.0.attn.to_k"] == "svdq_nvfp4"  # torchao's nvfp4: SVDQuant's NVFP4 at rank 0
    assert kinds["transformer_blocks.0.attn.to_v"] == "w4a16"


def test_int8_per_tensor_and_fp8_per_block_arithmetic():
    """The references against their definitions written another way: int8 per tensor as an exact int64 dot times
    the two scales; fp8 per block as a sum over K blocks of the e4m3 dots times the tile scales."""
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(64, 96, generator=g), torch.randn(64, generator=g), torch.randn(3, 96, generator=g)
    i = prepare_int8(w, b, "per_tensor")
    assert i.wscale.shape == () and i.qweight.abs().max() == 127
    sx = x.abs().max() / 127
    qx = torch.clamp(torch.round(x / sx), -127, 127).long()
    exact = (qx @ i.qweight.long().t()).double() * float(sx) * float(i.wscale) + b.double()
    torch.testing.assert_close(int8_linear_reference(x, i.qweight, i.wscale, b, granularity="per_tensor").double(),
                               exact, rtol=1e-5, atol=1e-5)
    f = prepare_fp8_block(w, b, block=32)
    assert f.wscale.shape == (2, 3) and f.qweight.dtype == torch.float8_e4m3fn
    assert rel(dequantize_fp8_blocks(f.qweight, f.wscale), w) < 0.05
    acc = torch.zeros(3, 64, dtype=torch.float64)
    for kb in range(3):
        cols = slice(32 * kb, 32 * kb + 32)
        xs = x[:, cols].abs().amax(dim=1, keepdim=True) / 448
        qxb = (x[:, cols] / xs).to(torch.float8_e4m3fn).double()
        dot = qxb @ f.qweight[:, cols].double().t()
        acc += dot * xs.double() * f.wscale[:, kb].double().repeat_interleave(32)[None]
    torch.testing.assert_close(fp8_block_linear_reference(x, f.qweight, f.wscale, b).double(), acc + b.double(),
                               rtol=1e-5, atol=1e-5)
    # float8_weight_only: e4m3 weights per row, the activations untouched: the linear of the dequantized weight
    r = prepare_fp8(w, b)
    torch.testing.assert_close(w8a16_linear_form(x, r.qweight, r.wscale, b),
                               F.linear(x, r.qweight.float() * r.wscale[:, None], b), rtol=0, atol=0)


def test_weight_inv_smoothing_matches_cache_dit_and_runs():
    quantizer = pytest.importorskip("cache_dit.quantization.svdquant.quantizer")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * torch.rand(128, generator=g).pow(3)
    ours = smoothing_vector(w, alpha=0.5, smooth="weight_inv")
    theirs = quantizer._compute_weight_only_smooth_scale(w.abs().amax(dim=0), alpha=0.5, inverse=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours.min() < 0.9 and ours.max() > 1.1  # not the identity
    cfg = QuantizeConfig(quant_type="svdq_int4_r8_dq", svdq_kwargs={"smooth_strategy": "weight_inv"})
    assert cfg.to_pass().smooth == "weight_inv" and cfg.strify() == "svdq_int4_r8_dq_weight_inv"
    tr = tiny_flux()
    want = run(tr)
    wrapper = enable_cache(tr, quantize_config=cfg)
    got = run(wrapper)
    assert 0 < rel(got, want) < 0.05, rel(got, want)  # measured 0.016
    assert [p.smooth for p in wrapper.runtime.state["frontend"].passes] == ["weight_inv"]
    assert strify(wrapper) == "svdq_int4_r8_dq_weight_inv"




@pytest.mark.parity("QuantizeConfig.serialize_to")
def test_serialize_then_load_gives_the_same_numbers(tmp_path):
    """``serialize_to`` writes the low-bit tables of each type; ``load`` on a fresh model reads them back: the same
    kinds, bit-identical outputs."""
    for quant_type, (kind, _, _) in TYPES.items():
        out = tmp_path / quant_type
        wrapper = enable_cache(tiny_flux(), quantize_config=QuantizeConfig(quant_type=quant_type,
                                                                          serialize_to=str(out)))
        want = run(wrapper)
        loaded = load(tiny_flux(), str(out))
        assert torch.equal(run(loaded), want), quant_type
        assert {n.meta["dit_quant"] for n in loaded.graph_module.graph.nodes if n.meta.get("dit_quant")} == {kind}


def test_side_by_side_with_torchao():
    """Where torchao (cache-dit's backend for these types) is installed: ``float8_weight_only`` equals it (the same
    e4m3 per-row tables); the int8 types round to a slightly different grid (torchao: amax / 127.5 over [-128, 127];
    here amax / 127 over [-127, 127], as ``int8_per_row``), so their error against the fp32 linear is compared."""
    ao = pytest.importorskip("torchao.quantization")
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(256, 128)
    x = torch.randn(4, 256, generator=g)
    exact = lin(x).detach()
    ours = {"float8_weight_only": lambda: w8a16_linear_form(x, *_tables(prepare_fp8(lin.weight, lin.bias))),
            "int8_weight_only": lambda: w8a16_linear_form(x, *_tables(prepare_int8(lin.weight, lin.bias))),
            "int8_per_tensor": lambda: int8_linear_reference(x, *_tables(prepare_int8(lin.weight, lin.bias,
                                                                                      "per_tensor")),
                                                             granularity="per_tensor")}
    configs = {"float8_weight_only": ao.Float8WeightOnlyConfig(), "int8_weight_only": ao.Int8WeightOnlyConfig(),
               "int8_per_tensor": ao.Int8DynamicActivationInt8WeightConfig(granularity=ao.PerTensor())}
    for name, config in configs.items():
        m = torch.nn.Sequential(torch.nn.Linear(256, 128))
        m[0].load_state_dict(lin.state_dict())
        ao.quantize_(m, config)
        with torch.no_grad():
            theirs, mine = m(x), ours[name]()
        if name == "float8_weight_only":
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        else:
            assert rel(mine, exact) < 1.2 * rel(theirs, exact), name


def _tables(q):
    return q.qweight, q.wscale, q.bias
