"""QuantizeConfig's selection rows with cache-dit 1.5.3's semantics, through ``quantize``: ``regional_quantize=False``
(every linear), ``repeated_blocks`` (the linears inside those block classes; the module's own ``_repeated_blocks``
wins, as in the reference; with neither, every linear), ``precision_plan`` (layer-name substrings -> quant type, the
rest in ``quant_type``).

The expected linears come from module names, not from the graph analysis the passes use.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes.frontend import QuantizeConfig, quantize
from dit_passes.infra.pass_base import PassError

pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402

torch.set_num_threads(1)
TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16
EXCLUDE = ("embedder", "embed", "modulation", "mod")  # cache-dit's default exclude_layers


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=POOLED_DIM, guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, IN_CH, generator=g),
                encoder_hidden_states=torch.randn(1, 7, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(1, POOLED_DIM, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(7, 3), guidance=torch.tensor([3.5]),
                return_dict=False)


def quantized(compiled):
    """{module path: kind} of the linears the passes replaced."""
    return {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in compiled.graph_module.graph.nodes
            if n.op == "call_function" and n.meta.get("dit_quant")}


def linears(model, under=("",), exclude=EXCLUDE):
    """Paths of the nn.Linear modules under one of ``under`` whose path has none of ``exclude`` ("modulation" / "mod":
    the role, i.e. the blocks' AdaLN linears ``norm1.linear``, ``norm1_context.linear``, ``norm.linear``)."""
    out = set()
    for p, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or not p.startswith(under):
            continue
        modulation = "blocks." in p and p.endswith(("norm1.linear", "norm1_context.linear", "norm.linear"))
        if any(e in p for e in exclude if e not in ("modulation", "mod")) or (
                modulation and ("modulation" in exclude or "mod" in exclude)):
            continue
        out.add(p)
    return out


def run(compiled_or_model):
    with torch.no_grad():
        return compiled_or_model(**inputs())[0]


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parity("QuantizeConfig.regional_quantize", "QuantizeConfig.exclude_layers")
def test_regional_quantize_false_takes_every_linear():
    tr = tiny_flux()
    want = run(tr)
    blocks_only = quantize(tr, QuantizeConfig(quant_type="int8_per_row", exclude_layers=[]), keep_original=True)
    run(blocks_only)
    every = quantize(tr, QuantizeConfig(quant_type="int8_per_row", regional_quantize=False, exclude_layers=[]),
                     keep_original=True)
    got = run(every)
    all_linears = {p for p, m in tr.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(quantized(every)) == all_linears and set(quantized(every).values()) == {"int8_per_row"}
    assert set(quantized(blocks_only)) == linears(tr, ("transformer_blocks.", "single_transformer_blocks."), ())
    assert len(all_linears) > len(quantized(blocks_only))  # embedders, norm_out, proj_out besides
    assert 0 < rel(got, want) < 0.05
    # cache-dit's default exclude_layers still applies outside the blocks
    default = quantize(tr, QuantizeConfig(quant_type="int8_per_row", regional_quantize=False), keep_original=True)
    run(default)
    assert set(quantized(default)) == linears(tr) and "proj_out" in quantized(default)


@pytest.mark.parity("QuantizeConfig.repeated_blocks")
def test_repeated_blocks_module_attribute_wins_then_config_then_everything():
    tr = tiny_flux()
    cfg = dict(quant_type="int8_per_row", repeated_blocks=["FluxSingleTransformerBlock"])
    # FluxTransformer2DModel._repeated_blocks names both block classes: the reference takes it over the config's
    c = quantize(tr, QuantizeConfig(**cfg), keep_original=True)
    run(c)
    assert set(quantized(c)) == linears(tr, ("transformer_blocks.", "single_transformer_blocks."))
    tr._repeated_blocks = None  # this instance declares none: the config's classes decide
    c = quantize(tr, QuantizeConfig(**cfg), keep_original=True)
    run(c)
    assert set(quantized(c)) == linears(tr, ("single_transformer_blocks.",)) != set()
    # neither: the reference turns regional quantization off, every linear but the excluded ones
    c = quantize(tr, QuantizeConfig(quant_type="int8_per_row"), keep_original=True)
    run(c)
    assert set(quantized(c)) == linears(tr)
    with pytest.raises(PassError, match="NoSuchBlock.*FluxTransformerBlock"):
        run(quantize(tr, QuantizeConfig(quant_type="int8_per_row", repeated_blocks=["NoSuchBlock"]),
                     keep_original=True))
    with pytest.raises(TypeError, match="repeated_blocks"):
        QuantizeConfig(repeated_blocks="FluxTransformerBlock").to_pass()


@pytest.mark.parity("QuantizeConfig.precision_plan")
def test_precision_plan_per_layer_types_then_the_default():
    tr = tiny_flux()
    want = run(tr)
    c = quantize(tr, QuantizeConfig(quant_type="int8_per_row", precision_plan={
        "attn.to_q": "float8_per_tensor", "proj_mlp": "FLOAT8_PER_TENSOR", "ff.net.2": "float8_per_row"}),
        keep_original=True)
    assert [p.name for p in c.runtime.state["frontend"].passes] == ["int8_linear", "fp8_linear", "fp8_linear"]
    got = run(c)
    kinds = quantized(c)
    every = linears(tr, ("transformer_blocks.", "single_transformer_blocks."))
    assert set(kinds) == every
    for path, kind in kinds.items():
        want_kind = ("fp8_per_tensor" if "attn.to_q" in path or "proj_mlp" in path else
                     "fp8_per_row" if "ff.net.2" in path else "int8_per_row")
        assert kind == want_kind, path
    assert {"fp8_per_tensor", "fp8_per_row", "int8_per_row"} == set(kinds.values())
    assert 0 < rel(got, want) < 0.1
    with pytest.raises(NotImplementedError, match="precision_plan quant types.*svdq_int4_r32"):
        QuantizeConfig(precision_plan={"to_q": "svdq_int4_r32"}).to_passes()


@pytest.mark.parity("QuantizeConfig.filter_fn")
def test_filter_fn_picks_the_linears_it_names():
    """cache-dit's ``filter_fn(module, name)``: exactly the linears it returns True for (exclude_layers not applied,
    as the reference: the filter replaces it), the output within int8's bound of the eager model's."""
    tr = tiny_flux()
    want = run(tr)

    def wide_ff(module, name):
        return ".ff" in name and module.out_features > 64

    c = quantize(tr, QuantizeConfig(quant_type="int8_per_row", filter_fn=wide_ff), keep_original=True)
    got = run(c)
    expected = {p for p, m in tr.named_modules() if isinstance(m, torch.nn.Linear) and wide_ff(m, p)}
    assert expected and set(quantized(c)) == expected
    assert 0 < rel(got, want) < 0.05


def test_svd_precision_and_refine_iters_in_the_core():
    from dit_passes.quant.int4 import dequantize_weight_w4, quantize_weight_w4
    from dit_passes.quant.svdquant import low_rank_split

    g = torch.Generator().manual_seed(5)
    # a clear gap after the 8th singular value, so that the best rank-8 approximation is well defined
    w = torch.randn(96, 8, generator=g) @ torch.randn(8, 128, generator=g) + 0.3 * torch.randn(96, 128, generator=g)
    fq = lambda r: dequantize_weight_w4(*quantize_weight_w4(r))  # noqa: E731
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    best = (u[:, :8] * s[:8]) @ vh[:8]
    for svd, tol in (("medium", 1e-3), ("high", 2e-5)):  # full SVDs (fp32, fp64): the best rank-8 approximation
        up, down, res = low_rank_split(w, 8, 0, torch.float32, svd=svd)
        assert torch.allclose((up @ down).double(), best, atol=tol) and torch.equal(res, w - up @ down)
    err = {}
    for iters in (0, 3):
        up, down, res = low_rank_split(w, 8, 0, torch.float32, svd="high", refine_iters=iters, fake_quant=fq)
        assert torch.equal(res, w - up @ down)  # the residual stays anchored on w
        err[iters] = float((w - up @ down - fq(res)).norm())
    assert err[3] < err[0]  # the branch absorbed part of the residual's quantization error


def test_svdq_kwargs_map_onto_the_pass_and_change_the_weights():
    tr = tiny_flux()
    want = run(tr)
    kw = {"calibrate_precision": "HIGH", "svd_refine_iters": 2, "streaming": False, "runtime_kernel": "v1"}
    with pytest.warns(UserWarning, match="'runtime_kernel': 'v1'.*have no effect here"):
        cfg = QuantizeConfig(quant_type="svdq_nvfp4_r8_dq", svdq_kwargs=kw)
    with pytest.raises(ValueError, match=r"runtime_kernel'\]='v2' is refused, as cache-dit refuses it for SVDQ NVFP4"):
        QuantizeConfig(quant_type="svdq_nvfp4_r8_dq", svdq_kwargs={"runtime_kernel": "v2"})
    p = cfg.to_pass(tr)
    assert (p.svd_precision, p.refine_iters, p.precision) == ("high", 2, "nvfp4")
    plain = run(quantize(tr, QuantizeConfig(quant_type="svdq_nvfp4_r8_dq"), keep_original=True))
    tuned = run(quantize(tr, cfg, keep_original=True))
    assert not torch.equal(tuned, plain) and rel(tuned, want) < 0.05 and rel(plain, want) < 0.05
    with pytest.raises(ValueError, match="unknown key 'rank_boost'"):
        QuantizeConfig(quant_type="svdq_int4_r8_dq", svdq_kwargs={"rank_boost": 1})
    with pytest.raises(ValueError, match="few_shot_steps'] must be a positive int"):
        QuantizeConfig(quant_type="svdq_int4_r8_dq", svdq_kwargs={"few_shot_steps": 0})
    with pytest.raises(ValueError, match="calibrate_precision"):
        QuantizeConfig(quant_type="svdq_int4_r8_dq", svdq_kwargs={"calibrate_precision": "extreme"})
