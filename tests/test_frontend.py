"""The cache-dit-compatible front end (dit_passes.frontend) on tiny FluxPipelines, side by side with cache-dit 1.5.3.

The reference is cache-dit's own ``enable_cache`` on a deep copy of the same pipeline: same latents (1e-4
relative), same cached steps and residual diffs. Without the reference: ``disable_cache`` restores the very
object and bit-identical outputs; quantization puts quantized ops in the graph; bad input fails clearly.
"""
from __future__ import annotations

import copy
import logging
import types

import pytest
import torch

from dit_passes.compiled import CompiledDiT
from dit_passes.frontend import (CacheStats, DBCacheConfig, ParallelismConfig, QuantizeConfig,
                                 TaylorSeerCalibratorConfig, disable_cache, enable_cache, load, quantize,
                                 refresh_context, steps_mask, strify, summary)

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402

from dit_passes.testing.pipelines import flux_pipeline  # noqa: E402

torch.set_num_threads(1)  # CI: 2 xdist workers and the rank tests share 2 cores; a second thread only spins
TEXT_DIM, POOLED_DIM, IN_CH, STEPS = 32, 24, 16, 8
# threshold 0.3 caches the last steps of this tiny model (its diffs are ~0.2-0.4)
CFG = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.3, max_warmup_steps=2)


def tiny_flux(heads: int = 2, seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=3, num_single_layers=3,
                                  attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=POOLED_DIM, guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()


def tiny_pipe(transformer) -> FluxPipeline:
    return flux_pipeline(transformer)


def run(pipe, cfg: bool = False, steps: int = STEPS, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kw = dict(prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g), pooled_prompt_embeds=torch.randn(1, POOLED_DIM, generator=g))
    if cfg:  # true CFG: a second transformer call per step under cache_context("uncond")
        kw.update(negative_prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g),
                  negative_pooled_prompt_embeds=torch.randn(1, POOLED_DIM, generator=g), true_cfg_scale=2.0)
    with torch.inference_mode():
        return pipe(height=16, width=16, num_inference_steps=steps, guidance_scale=3.5, output_type="latent",
                    generator=torch.Generator().manual_seed(3), **kw).images


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def cache_dit():
    mod = pytest.importorskip("cache_dit")
    logging.getLogger("cache_dit").setLevel(logging.ERROR)
    return mod


# ------------------------------------------------------------------------------- side by side with cache-dit
@pytest.mark.parity("enable_cache", "summary", "strify")
@pytest.mark.reference
@pytest.mark.parametrize("calibrated", [False, True], ids=["dbcache", "taylorseer"])
def test_enable_cache_matches_cache_dit(cache_dit, calibrated):
    cal = dict(taylorseer_order=1) if calibrated else None
    tr = tiny_flux()
    ref_pipe = tiny_pipe(copy.deepcopy(tr))
    cache_dit.enable_cache(ref_pipe, cache_config=cache_dit.DBCacheConfig(**CFG),
                           calibrator_config=None if cal is None else cache_dit.TaylorSeerCalibratorConfig(**cal))
    ref = run(ref_pipe)
    ref_stats = cache_dit.summary(ref_pipe, logging=False)[0]

    pipe = tiny_pipe(tr)
    assert enable_cache(pipe, cache_config=DBCacheConfig(**CFG),
                        calibrator_config=None if cal is None else TaylorSeerCalibratorConfig(**cal)) is pipe
    assert isinstance(pipe.transformer, CompiledDiT) and pipe.transformer.original is tr
    ours = run(pipe)
    stats = summary(pipe, logging=False)
    assert len(stats) == 1 and isinstance(stats[0], CacheStats)
    st = stats[0]
    assert st.cached_steps, "nothing cached: the comparison would not exercise the cache"
    assert st.cached_steps == ref_stats.cached_steps
    assert st["accumulated_cached_steps"] == ref_stats.accumulated_cached_steps == len(st.cached_steps)
    assert st.accumulated_executed_steps == ref_stats.accumulated_executed_steps == STEPS
    assert st.cfg_cached_steps == ref_stats.cfg_cached_steps == []
    assert st.residual_diffs.keys() == ref_stats.residual_diffs.keys()
    for k, v in ref_stats.residual_diffs.items():
        assert st.residual_diffs[k] == pytest.approx(v, rel=1e-4)
    assert rel_err(ours, ref) <= 1e-4, f"latents differ: {rel_err(ours, ref):.3g}"
    # the tag: the reference's (enable_separate_cfg resolved to False for Flux: _CFG0; ours from the calls), then _S<cached steps>
    ref_tag = cache_dit.strify(ref_pipe).split("_S")[0]
    assert ref_tag == "DBCache_F1B1_W2I1M0MC0_R0.3_CFG0_" + ("T1O1" if calibrated else "T0O0")
    assert strify(pipe) == f"{ref_tag}_S{len(st.cached_steps)}"
    # a migrating user's cache-dit config objects are accepted as they are
    other = tiny_pipe(tiny_flux())
    enable_cache(other, cache_config=cache_dit.DBCacheConfig(**CFG))
    assert other.transformer.runtime.state["frontend"].cache_config == DBCacheConfig(**CFG)  # None: resolved from the calls


@pytest.mark.reference
def test_steps_mask_equals_cache_dit_for_every_preset(cache_dit):
    for total in (28, 50):
        for policy in ("slow", "medium", "fast", "ultra"):
            ours = steps_mask(total_steps=total, mask_policy=policy)
            assert ours == cache_dit.steps_mask(total_steps=total, mask_policy=policy), (total, policy)
            assert len(ours) == total and ours[-1] == 1
    # independent of the reference: its documented 28-step fast preset and 50-step compute counts
    assert "".join(map(str, steps_mask(total_steps=28, mask_policy="fast"))) == "1111110100010000100000100001"
    assert [sum(steps_mask(total_steps=50, mask_policy=p)) for p in ("slow", "medium", "fast", "ultra")] == [38, 29, 20, 14]
    assert steps_mask(compute_bins=[2, 1], cache_bins=[1, 2]) == [1, 1, 0, 1, 0, 0]


# ------------------------------------------------------------------------------- enable / disable / refresh
@pytest.mark.parity("refresh_context", "disable_cache")
def test_refresh_context_then_disable_restores_the_original_and_its_outputs():
    tr = tiny_flux()
    pipe = tiny_pipe(tr)
    baseline = run(pipe)
    enable_cache(pipe, cache_config=DBCacheConfig(**CFG))
    compiled = pipe.transformer
    first = run(pipe)
    assert summary(pipe, logging=False)[0].cached_steps, "nothing cached"
    assert not torch.equal(first, baseline), "cached steps must change the latents slightly"
    refresh_context(pipe)  # same config: only a new generation, the graph is kept
    graph = compiled.graph_module
    assert torch.equal(run(pipe), first) and compiled.graph_module is graph
    assert [g["generation"] for g in summary(pipe, logging=False)[0].generations] == [0, 1]
    # changed fields rebuild the cache (threshold 0: never cache); the history restarts
    refresh_context(pipe, residual_diff_threshold=0.0, num_inference_steps=STEPS)
    assert pipe.transformer is compiled
    assert compiled.runtime.state["frontend"].cache_config.num_inference_steps == STEPS
    uncached = run(pipe)
    assert compiled.graph_module is not graph  # lowered again with the new config
    st = summary(pipe, logging=False)[0]
    assert st.cached_steps == [] and len(st.generations) == 1
    assert strify(pipe) == "DBCache_F1B1_W2I1M0MC0_R0.0_N8_CFG0_T0O0"
    assert rel_err(uncached, baseline) < 1e-5
    with pytest.raises(TypeError, match="not DBCacheConfig fields"):
        refresh_context(pipe, num_steps=8)
    # disable: the very same object back, bit-identical outputs, no stats
    assert disable_cache(pipe) is pipe
    assert pipe.transformer is tr and type(tr) is FluxTransformer2DModel
    assert torch.equal(run(pipe), baseline)
    assert summary(pipe, logging=False) == [CacheStats()] and strify(pipe) == ""


def test_bare_transformer_and_two_transformers():
    tr = tiny_flux()
    compiled = enable_cache(tr, cache_config=DBCacheConfig(num_inference_steps=STEPS, **CFG))
    assert isinstance(compiled, CompiledDiT) and compiled.original is tr and type(tr) is FluxTransformer2DModel
    pipe = tiny_pipe(tr)
    pipe.transformer = compiled  # transformer-only mode: the user installs the returned module
    run(pipe)
    assert summary(compiled, logging=False)[0].cached_steps
    assert disable_cache(compiled) is tr
    # Wan 2.2 style: transformer and transformer_2 each get their own wrapper and cache state
    a, b = tiny_flux(seed=1), tiny_flux(seed=2)
    two = types.SimpleNamespace(transformer=a, transformer_2=b)
    enable_cache(two, cache_config=DBCacheConfig(**CFG), max_graphs=3)
    assert two.transformer.original is a and two.transformer_2.original is b
    assert two.transformer.max_graphs == two.transformer_2.max_graphs == 3 and compiled.max_graphs == 8
    assert two.transformer.runtime is not two.transformer_2.runtime
    dbc = [two.transformer.runtime.state["frontend"].passes[-1], two.transformer_2.runtime.state["frontend"].passes[-1]]
    assert dbc[0] is not dbc[1] and dbc[0].name == "dbcache"
    disable_cache(two)
    assert two.transformer is a and two.transformer_2 is b


# ------------------------------------------------------------------------------- parallelism and quantization
def test_parallelism_all_sizes_one_is_a_logged_noop(caplog):
    pipe = tiny_pipe(tiny_flux())
    with caplog.at_level(logging.INFO, logger="dit_passes"):
        enable_cache(pipe, cache_config=DBCacheConfig(**CFG), parallelism_config=ParallelismConfig(ulysses_size=1, tp_size=1))
    assert any("no parallelism applied" in r.getMessage() for r in caplog.records)
    state = pipe.transformer.runtime.state["frontend"]
    assert [p.name for p in state.passes] == ["dbcache"] and state.parallelism_config is None
    # before any call the CFG split is not known yet (the reference's table says _CFG0 for Flux; ours after a run)
    assert strify(pipe) == "DBCache_F1B1_W2I1M0MC0_R0.3_T0O0"
    # sizes > 1 map onto the passes; they need a process group of that size
    assert [type(p).__name__ for p in ParallelismConfig(ulysses_size=2, ring_size=2).to_passes()] == ["USP"]
    assert [type(p).__name__ for p in ParallelismConfig(ring_size=2).to_passes()] == ["Ring"]
    assert [(type(p).__name__, p.size) for p in ParallelismConfig(tp_size=4).to_passes()] == [("TensorParallel", 4)]
    assert ParallelismConfig(ulysses_size=2, tp_size=2).strify() == "Ulysses2_TP2"
    fresh = tiny_pipe(tiny_flux())
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        enable_cache(fresh, parallelism_config=ParallelismConfig(ulysses_size=2))
    with pytest.raises(RuntimeError, match="Ulysses2_TP2 needs 4 processes"):
        enable_cache(fresh, parallelism_config=ParallelismConfig(ulysses_size=2, tp_size=2))
    # with use_ray the workers parallelise them (tests/test_ray_launcher_owned.py); when they build the pipeline
    # (ray_transfer_fn) by name, as the reference (tests/test_ray_launcher.py): a module of this process names nothing
    with pytest.raises(ValueError, match=r"extra_parallel_modules=\['AutoencoderKL'\] with ray_transfer_fn.*name them"):
        enable_cache(fresh, parallelism_config=ParallelismConfig(ulysses_size=2, use_ray=True, ray_transfer_fn=tiny_pipe,
                                                                 extra_parallel_modules=[fresh.vae]))
    with pytest.raises(ValueError, match="components_to_quantize: a FluxTransformer2DModel of this process"):
        enable_cache(fresh, parallelism_config=ParallelismConfig(ulysses_size=2, use_ray=True, ray_transfer_fn=tiny_pipe),
                     quantize_config=QuantizeConfig(components_to_quantize=[fresh.transformer]))
    with pytest.raises(ValueError, match="extra_parallel_modules needs the pipeline"):
        enable_cache(fresh.transformer, parallelism_config=ParallelismConfig(ulysses_size=2, use_ray=True,
                                                                             extra_parallel_modules=[fresh.vae]))
    assert type(fresh.transformer) is FluxTransformer2DModel  # nothing applied by the failed calls


def _fp8_nodes(compiled):
    """The nodes that took the quantized linears' places (the fp8 graph forms are plain ATen ops; the last node
    of each carries meta["dit_quant"], the kind)."""
    return [n for n in compiled.graph.nodes if str(n.meta.get("dit_quant", "")).startswith("fp8")]


def test_quantize_config_float8_per_row_puts_fp8_linears_in_the_graph():
    tr = tiny_flux()
    pipe = tiny_pipe(tr)
    baseline = run(pipe)
    # keep_original: disable_cache below gives the transformer back to be quantized again
    enable_cache(pipe, quantize_config=QuantizeConfig(quant_type="float8_per_row"), keep_original=True)
    state = pipe.transformer.runtime.state["frontend"]
    assert state.cache_config is None and [p.name for p in state.passes] == ["fp8_linear"]  # the reference's rule
    got = run(pipe)
    nodes = _fp8_nodes(pipe.transformer)
    n_block_linears = sum(isinstance(m, torch.nn.Linear) and "norm" not in p for p, m in tr.named_modules()
                          if "transformer_blocks" in p)
    assert len(nodes) == n_block_linears > 0
    assert all(n.meta["dit_quant"] == "fp8_per_row" for n in nodes)
    assert not any("norm" in n.meta.get("dit_module_path", "") for n in nodes)  # AdaLN modulation excluded
    assert "fp8_e4m3_per_row" in pipe.transformer.explain(print_output=False)
    assert 0 < rel_err(got, baseline) < 0.1
    assert strify(pipe) == "float8_per_row"
    disable_cache(pipe)
    # cache + fp8 together, in the order the PassManager needs (built here, lowered at the first call)
    enable_cache(pipe, cache_config=DBCacheConfig(**CFG), quantize_config=QuantizeConfig(quant_type="float8_per_tensor"))
    assert [p.name for p in pipe.transformer.runtime.state["frontend"].passes] == ["fp8_linear", "dbcache"]
    assert strify(pipe) == "DBCache_F1B1_W2I1M0MC0_R0.3_T0O0_float8_per_tensor"


def test_quant_types_map_onto_the_passes():
    from dit_passes.passes import Fp8Linear, Int8Linear, SVDQuantW4A4
    p = QuantizeConfig(quant_type="INT8_PER_ROW").to_pass()
    assert type(p) is Int8Linear and p.exclude == ("embedder", "embed", "modulation", "mod", "router")
    p = QuantizeConfig(quant_type="float8_per_tensor", exclude_layers=["attn"]).to_pass()
    # the front end keeps a mixture of experts' router in precision whatever exclude_layers says
    assert type(p) is Fp8Linear and p.granularity == "per_tensor" and p.exclude == ("attn", "router")
    p = QuantizeConfig(quant_type="svdq_int4_r16_dq").to_pass()
    assert type(p) is SVDQuantW4A4 and (p.rank, p.dynamic, p.smooth) == (16, True, "none")
    # cache-dit's default exclude_layers keeps the modulation linears out; without it SVDQ gives them W4A16_LR
    assert "modulation" in p.exclude and p.modulation == "w4a16_lr"
    p = QuantizeConfig(quant_type="svdq_int4_r16_dq", exclude_layers=["embed"]).to_pass()
    assert p.exclude == ("embed", "router") and p.modulation == "w4a16_lr"
    p = QuantizeConfig(quant_type="svdq_nvfp4_r16_dq").to_pass()
    assert type(p) is SVDQuantW4A4 and (p.precision, p.kind, p.quant_type()) == ("nvfp4", "svdq_nvfp4",
                                                                                  "svdq_nvfp4_r16_dq")
    q = QuantizeConfig(quant_type="svdq_int4_r16_dq", svdq_kwargs={"smooth_strategy": "weight"})
    assert q.to_pass().smooth == "weight" and q.strify() == "svdq_int4_r16_dq_weight"
    # the reference's filter_fn(module, name) is adapted to the pass's filter_fn(path, role)
    tr = tiny_flux()
    p = QuantizeConfig(filter_fn=lambda m, name: m.out_features > 64).to_pass(tr)
    assert p.exclude == () and p.filter_fn("transformer_blocks.0.ff.net.0.proj", "mlp_up")
    assert not p.filter_fn("transformer_blocks.0.attn.to_q", "q")


@pytest.mark.parity("QuantizeConfig.calibrate_fn", "QuantizeConfig.serialize_to")
def test_quantize_ptq_calibrates_now_then_load_matches(tmp_path):
    """The seed's flow: quantize(pipe.transformer, svdq PTQ with calibrate_fn + serialize_to), then load()."""
    tr = tiny_flux(heads=4)  # inner dim 64: W4A4 needs K % 64 == 0
    pipe = tiny_pipe(tr)
    calls = []

    def calibrate_fn(**_):
        calls.append(1)
        run(pipe, steps=2)

    pipe.transformer = quantize(pipe.transformer, quant_config=QuantizeConfig(
        quant_type="svdq_int4_r8", calibrate_fn=calibrate_fn, serialize_to=str(tmp_path)))
    assert calls == [1] and (tmp_path / "svdq_int4_r8.safetensors").exists()  # written before quantize returned
    quantized = run(pipe, steps=2)
    assert "svdq_w4a4_linear" in pipe.transformer.code
    loaded = load(pipe.transformer, tmp_path / "svdq_int4_r8.safetensors")
    assert isinstance(loaded, CompiledDiT) and loaded.original is tr
    pipe.transformer = loaded
    assert torch.equal(run(pipe, steps=2), quantized)
    # a quantized wrapper can take the cache on top; disable_cache gives the quantized wrapper back
    enable_cache(pipe, cache_config=DBCacheConfig(**CFG))
    assert [p.name for p in pipe.transformer.runtime.state["frontend"].passes] == ["load_quantized", "dbcache"]
    disable_cache(pipe)
    assert pipe.transformer is loaded


# ------------------------------------------------------------------------------- bad input
def test_bad_inputs_fail_clearly():
    with pytest.raises(ValueError, match="supported:.*'svdq_int4_r{rank}_dq'"):
        QuantizeConfig(quant_type="int3_magic")
    with pytest.raises(ValueError, match="calibrate_fn"):
        QuantizeConfig(quant_type="svdq_int4_r32")
    with pytest.raises(ValueError, match="ulysses_size"):
        ParallelismConfig(ulysses_size=0)
    with pytest.raises(TypeError, match="diffusers pipeline or a transformer"):
        enable_cache("not a pipeline")
    with pytest.raises(TypeError, match="is not a Diffusion Transformer"):
        enable_cache(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="has no transformer"):
        enable_cache(types.SimpleNamespace(transformer=None, unet=torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="can only be None"):
        enable_cache(None)
    with pytest.raises(ValueError, match=r"max_graphs=3.*use_ray=True.*default limit \(8 graphs\)"):
        enable_cache(tiny_pipe(tiny_flux()), parallelism_config=ParallelismConfig(ulysses_size=2, use_ray=True),
                     max_graphs=3)
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        enable_cache(tiny_pipe(tiny_flux()), cache_config=DBCacheConfig(**CFG), max_graphs=-1)
    with pytest.raises(TypeError, match="DBCacheConfig"):
        enable_cache(tiny_pipe(tiny_flux()), cache_config={"Fn_compute_blocks": 1})
    pipe = tiny_pipe(tiny_flux())
    enable_cache(pipe, cache_config=DBCacheConfig(**CFG))
    first = pipe.transformer
    with pytest.raises(RuntimeError, match="already accelerated.*disable_cache"):
        enable_cache(pipe)
    assert pipe.transformer is first
    disable_cache(pipe)
    with pytest.raises(RuntimeError, match="has no residual cache"):
        refresh_context(pipe)


# ------------------------------------------------------------------------------- Ray
@pytest.mark.parity("ParallelismConfig.use_ray", "ParallelismConfig.ray_num_workers")
@pytest.mark.ray
def test_use_ray_runs_the_transformer_on_a_worker():
    """ParallelismConfig(use_ray=True): RayLauncher starts the worker, the cache runs there, pipe(...) unchanged."""
    pytest.importorskip("ray")
    tr = tiny_flux()
    pipe = tiny_pipe(tr)
    baseline = run(pipe)
    enable_cache(pipe, cache_config=DBCacheConfig(**CFG), parallelism_config=ParallelismConfig(use_ray=True, ray_num_workers=1))
    try:
        assert type(pipe.transformer).__name__ == "RayTransformerProxy" and not list(pipe.transformer.parameters())
        got = run(pipe)
        st = summary(pipe, logging=False)[0]  # read from the worker
    finally:
        assert disable_cache(pipe) is pipe  # shuts the worker (and the Ray it started) down
    assert pipe.transformer is tr
    assert st.cached_steps and st.accumulated_executed_steps == STEPS
    assert strify(st) == f"DBCache_F1B1_W2I1M0MC0_R0.3_CFG0_T0O0_S{len(st.cached_steps)}"
    assert 0 < rel_err(got, baseline) < 0.05
