"""FuseSiblingLinears: linears reading one input fused into one linear and a split (CPU, fp32, tiny zoo models).

Checked against the original module: the fused model's output, the groups found (counted from the model's
config, not the pass), the original weights released, lowering again, composition with Fp8Linear (per-row scales:
the same numbers as fp8 without fusion) and with TensorParallel on 2 gloo ranks.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.models import zoo
from dit_passes.passes import FuseSiblingLinears, Fp8Linear, TensorParallel
from dit_passes.testing.multiproc import run_ranks

NAME = FuseSiblingLinears.name


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _calls(gm, target=torch.ops.aten.linear.default):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("family", ["flux", "wan", "pixart"])
def test_fused_model_equals_original(family):
    torch.manual_seed(0)
    zm = zoo.build(family)
    kw = zm.make_inputs(batch=1)
    ref = zm.model(**kw)[0]
    plain = compile_dit(zm.model, passes=[], keep_original=True)
    plain(**kw)
    before = len(_calls(plain.graph_module))
    splits = len(_calls(plain.graph_module, torch.ops.aten.split_with_sizes.default))
    c = compile_dit(zm.model, passes=[FuseSiblingLinears()])
    out = c(**kw)[0]
    assert _rel(out, ref) <= 1e-6, family
    counts = c.report(NAME)[0]["counts"]
    assert counts["fused_groups"] > 0, (family, counts)
    # every fused group became one linear: the graph lost exactly linears_saved linear nodes
    assert before - len(_calls(c.graph_module)) == counts["linears_saved"] > 0
    assert len(_calls(c.graph_module, torch.ops.aten.split_with_sizes.default)) - splits == counts["fused_groups"]


def test_flux_groups_released_weights_and_relowering():
    torch.manual_seed(0)
    zm = zoo.build("flux")
    cfg = zm.model.config
    kw, kw2 = zm.make_inputs(batch=1), zm.make_inputs(batch=2)
    ref, ref2 = zm.model(**kw)[0], zm.model(**kw2)[0]
    c = compile_dit(zm.model, passes=[FuseSiblingLinears()])
    out = c(**kw)[0]
    rep = c.report(NAME)[0]
    # double-stream blocks: image q/k/v and text add_q/k/v; single-stream blocks: proj_mlp + q/k/v
    assert rep["counts"]["fused_groups"] == 2 * cfg.num_layers + cfg.num_single_layers
    assert rep["counts"]["fused_linears"] == 6 * cfg.num_layers + 4 * cfg.num_single_layers
    assert ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
            "transformer_blocks.0.attn.to_v"] in rep["groups"]
    assert sorted(rep["groups"][-1]) == sorted(f"single_transformer_blocks.{cfg.num_single_layers - 1}.{p}" for p in
                                               ("proj_mlp", "attn.to_q", "attn.to_k", "attn.to_v"))
    # the originals are released: the model holds meta tensors, the graph only the fused weight
    attn = zm.model.transformer_blocks[0].attn
    assert all(getattr(attn, m).weight.is_meta and getattr(attn, m).bias.is_meta for m in ("to_q", "to_k", "to_v"))
    gm = c.graph_module
    targets = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "transformer_blocks.0.attn.to_k.weight" not in targets
    fused = gm.get_parameter("transformer_blocks.0.attn.to_q.weight")
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    assert tuple(fused.shape) == (3 * inner, inner)
    assert "transformer_blocks.0.attn.to_k.weight" in c.released
    assert _rel(out, ref) <= 1e-6
    # another signature lowers again from the ledger (the originals are gone): same numbers
    assert _rel(c(**kw2)[0], ref2) <= 1e-6
    assert c.report(NAME)[1]["counts"] == rep["counts"]


def test_with_fp8_equals_fp8_without_fusion():
    torch.manual_seed(0)
    zm = zoo.build("flux")
    kw = zm.make_inputs(batch=1)
    ref = zm.model(**kw)[0]
    kw2 = zm.make_inputs(batch=2)
    unfused = compile_dit(zm.model, passes=[Fp8Linear()], keep_original=True)
    fp8, fp8_2 = unfused(**kw)[0], unfused(**kw2)[0]
    c = compile_dit(zm.model, passes=[Fp8Linear(), FuseSiblingLinears()])  # the phases order them
    fused_fp8 = c(**kw)[0]
    # per-output-row weight scales and per-token activation scales: fusion changes no quantized value
    assert _rel(fused_fp8, fp8) <= 1e-5
    assert 1e-4 < _rel(fused_fp8, ref) < 0.1  # really quantized
    names = [r.name for r in c._current().manager.records]
    assert names.index(NAME) < names.index("fp8_linear")
    quant = [r for r in c._current().manager.records if r.name == "fp8_linear"][0].result.counts
    assert quant["replaced_qkv"] == c.report(NAME)[0]["counts"]["fused_groups"]
    # lowering again: the ledger hands back the stand-in of the fused weight, the quantizer its table
    assert _rel(c(**kw2)[0], fp8_2) <= 1e-5
    assert "reused" in [r for r in c._current().manager.records if r.name == "fp8_linear"][0].result.report


def test_lora_adapters_are_not_fused():
    pytest.importorskip("peft")
    from peft import LoraConfig

    torch.manual_seed(0)
    zm = zoo.build("flux")
    zm.model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False))
    kw = zm.make_inputs(batch=1)
    ref = zm.model(**kw)[0]
    c = compile_dit(zm.model, passes=[FuseSiblingLinears()], keep_original=True)
    assert _rel(c(**kw)[0], ref) <= 1e-6
    rep = c.report(NAME)[0]
    assert rep["counts"].get("skipped_lora_adapter", 0) > 0 and rep["counts"].get("skipped_lora_base", 0) > 0
    assert not any("to_q" in p or "lora" in p for g in rep["groups"] for p in g), rep["groups"]


def _tp_fused(rank, world):
    torch.manual_seed(0)
    zm = zoo.build("flux")
    kw, kw2 = zm.make_inputs(batch=1), zm.make_inputs(batch=2)
    ref, ref2 = zm.model(**kw)[0], zm.model(**kw2)[0]
    c = compile_dit(zm.model, passes=[FuseSiblingLinears(), TensorParallel(world)])
    out = c(**kw)[0]
    gm = c.graph_module
    out2 = c(**kw2)[0]  # lowering again: the shard, then the fused shard, from the ledger
    inner = zm.model.config.num_attention_heads * zm.model.config.attention_head_dim
    return {"err": _rel(out, ref), "err2": _rel(out2, ref2), "counts": c.report(NAME)[0]["counts"],
            "names": [r.name for r in c._current().manager.records],
            "fused_rows": int(gm.get_parameter("transformer_blocks.0.attn.to_q.weight").shape[0]), "inner": inner}


def test_tensor_parallel_shards_fuse_exactly():
    for rank, r in enumerate(run_ranks(_tp_fused, 2, timeout=300)):
        assert r["err"] <= 1e-5 and r["err2"] <= 1e-5, (rank, r)
        assert r["names"].index("tensor_parallel") < r["names"].index(NAME)
        assert r["counts"]["fused_groups"] > 0
        assert r["fused_rows"] == 3 * r["inner"] // 2  # this rank's q / k / v rows, concatenated


def test_meta_model_from_checkpoint(tmp_path):
    from safetensors.torch import save_file

    from dit_passes import SafetensorsWeights

    torch.manual_seed(0)
    zm = zoo.build("flux")
    kw, kw2 = zm.make_inputs(batch=1), zm.make_inputs(batch=2)
    with torch.no_grad():
        ref, ref2 = zm.model(**kw)[0], zm.model(**kw2)[0]
    path = tmp_path / "flux.safetensors"
    save_file({k: v.detach().contiguous().clone() for k, v in zm.model.state_dict().items()}, str(path))
    with torch.device("meta"):
        model = zoo.model_class("flux")(**zoo.config_for("flux")).eval()
    source = SafetensorsWeights(str(path))
    c = compile_dit(model, passes=[FuseSiblingLinears()], weights=source, example_inputs=kw)
    assert _rel(c(**kw)[0], ref) <= 1e-6
    # each member read once, whole, for its fused weight; nothing read again for another signature
    assert source.bytes_read["transformer_blocks.0.attn.to_k.weight"] == zm.model.transformer_blocks[0].attn.to_k.weight.numel() * 4
    read = dict(source.bytes_read)
    assert _rel(c(**kw2)[0], ref2) <= 1e-6
    assert dict(source.bytes_read) == read
    assert model.transformer_blocks[0].attn.to_k.weight.is_meta  # released: the fused weight holds its values


def _steps(model, kwargs, steps=6):
    outs, lat = [], kwargs["hidden_states"].clone()
    for i in range(steps):
        kw = dict(kwargs, hidden_states=lat, timestep=torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / steps)))
        with torch.no_grad():
            o = model(**kw)[0]
        outs.append(o)
        lat = lat - 0.05 * o.reshape(lat.shape)
    return torch.stack(outs)


def test_composes_with_dbcache_and_regional_compile():
    from dit_passes.passes import DBCache, RegionalCompile

    zm = zoo.build("flux", num_layers=2, num_single_layers=3)
    kw = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.45, max_warmup_steps=2)
    plain = compile_dit(zm.model, passes=[DBCache(**cfg), RegionalCompile(backend="aot_eager")], keep_original=True)
    ref = _steps(plain, kw)
    c = compile_dit(zm.model, passes=[RegionalCompile(backend="aot_eager"), DBCache(**cfg), FuseSiblingLinears()])
    out = _steps(c, kw)
    assert _rel(out, ref) <= 1e-5
    cached = c.cache_summary(as_dict=True)[-1]["cached_steps"]
    assert cached == plain.cache_summary(as_dict=True)[-1]["cached_steps"] and cached
    counts = {r.name: r.result.counts for r in c._current().manager.records}
    plain_counts = {r.name: r.result.counts for r in plain._current().manager.records}
    # the fused blocks still outline into one template per block kind, inside the cache branch too
    assert counts["regional_compile"]["templates"] == plain_counts["regional_compile"]["templates"] == 2
    assert counts["regional_compile"]["regions"] == plain_counts["regional_compile"]["regions"]
    assert counts[NAME]["fused_groups"] == 2 * 2 + 3
