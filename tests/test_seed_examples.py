"""Every code example of the seed documents (/work/shared/seeds/*.txt) run through
``import dit_passes as cache_dit`` on tiny models (loading replaced by the tiny builders, paths by tmp_path,
``"cuda"`` by ``"cpu"``, ``prompt=`` by prompt embeddings since the tiny pipelines have no tokenizer).

Seed example -> test (or why it is not run). PC = ParallelismConfig, QC = QuantizeConfig, DBC = DBCacheConfig.

000 Ray wrapper
  pip install "cache-dit[ray,parallelism]"                         shell, not run
  Pipeline Wrapper: enable_cache(pipe, PC(tp_size=2, use_ray=True)),
    pipe(...).images[0].save(...)                                   test_ray_pipeline_wrapper_tp2_fused_lora
  Transformer Wrapper: enable_cache(pipe.transformer,
    PC(ulysses_size=2, use_ray=True)) (not assigned), pipe.to("cuda") test_ray_transformer_wrapper_runtime_env
  Ray Transfer Fn: make_init_fn(), enable_cache(parallelism_config=
    PC(tp_size=2, use_ray=True, ray_transfer_fn=...)) -> engine      test_ray_transfer_fn_engine_cache_quant
  LoRA: pipe.fuse_lora(); enable_cache(pipe, PC(tp_size=2, use_ray))  test_ray_pipeline_wrapper_tp2_fused_lora
  Distributed Inference: PC(tp_size=2 | ulysses_size=2 | ring_size=2,
    use_ray=True)                                                   tp / ulysses: the Ray tests; ring:
                                                                    test_parallel_examples_ring (gloo ranks)
  Torch Compile: PC(tp_size=2, use_ray=True, ray_use_compile=True)  test_ray_use_compile_reaches_the_launcher
                                                                    (launch stubbed: Inductor on CPU workers)
  Cache and Quantization: enable_cache(pipe, cache_config=DBC(...),
    PC(tp_size=2, use_ray=True), quantize_config=QC(...))           test_ray_transfer_fn_engine_cache_quant
  Ray Runtime Env: PC(ulysses_size=2, use_ray=True,
    ray_runtime_env={"env_vars": {"PYTHONPATH": ...}})              test_ray_transformer_wrapper_runtime_env
  Pre-initialized Ray: ray.init(runtime_env=...); enable_cache(pipe,
    PC(ulysses_size=2, use_ray=True))                               fixture ray_cluster + the Ray tests (their
                                                                    transformer classes need that PYTHONPATH)
  Quick Start: python3 examples/ray/ray_wrapper_example.py ...      reference repo's script, not run
001 README (EN)
  pip install ... / CACHE_DIT_BUILD_CUDA=1 pip install ...          shell, not run
  enable_cache(pipe)                                                test_one_line_enable_cache
  enable_cache(pipe, cache_config=DBC(), PC(ulysses_size=2))        test_parallel_examples_ulysses_cache_and_fp8
  ... + quantize_config=QC(quant_type=...)                          same test (float8_per_row, as in seed 004)
  quantize(pipe.transformer, quant_config=QC("svdq_nvfp4_r32",
    calibrate_fn, serialize_to="path")); load(pipe.transformer, "path") test_svdq_ptq_quantize_and_load (nvfp4
                                                                    and int4)
  quantize(pipe.transformer, quant_config=QC("svdq_{int4|nvfp4}_r{32|..}_dq",
    svdq_kwargs={"smooth_strategy": "few_shot"}))                   test_svdq_dq_examples (int4 and nvfp4 r32 _dq,
                                                                    identity and few_shot smoothing)
  layerwise_offload(pipe, onload_device="cuda", ..., "8gib")        test_layerwise_offload_seed_options
  gh skill install ... / /cache-dit-model-integration "..."         agent commands, not run
002 TE-P, VAE-P, CN-P
  PC(tp_size=2 | ulysses_size=2, extra_parallel_modules=[pipe.text_encoder])
  PC(ulysses_size=2, extra_parallel_modules=[pipe.vae])             both covered by tests/test_frontend_parallel.py
                                                                    (ulysses and tp, [text_encoder_2, vae], gloo)
  PC(ulysses_size=2, extra_parallel_modules=[pipe.controlnet])      not run: Z-Image ControlNet pipeline; CN module
                                                                    TP in tests/test_parallel_modules.py
  PC(ulysses_size=4, tp_size=2, extra_parallel_modules=[te, vae, cn]) not run: 8 ranks on a 2-core machine
004 README (CN) and quick start
  uv pip install ... / CACHE_DIT_BUILD_SVDQUANT=1 uv pip install ... shell, not run
  enable_cache(pipe); quick start 1: DiffusionPipeline.from_pretrained(
    "black-forest-labs/FLUX.1-dev"), pipe(prompt=..., num_inference_steps=25) test_one_line_enable_cache
  enable_cache(pipe, DBC(), PC(ulysses_size=2)[, QC("float8_per_row")]) (README and quick start 2)
                                                                    test_parallel_examples_ulysses_cache_and_fp8
  quantize(pipe.transformer, QC("svdq_int4_r32", calibrate_fn, serialize_to=...)) (README and quick start 3,
    serialize_to="quantized_model.safetensors": refused, as by the reference)  test_svdq_ptq_quantize_and_load

The seeds show no steps_mask / TaylorSeer example: tests/test_frontend.py covers those.
"""
from __future__ import annotations

import contextlib
import os
import sys
import textwrap

import pytest
import torch

import dit_passes as cache_dit
from dit_passes.compiled import CompiledDiT
from dit_passes.models.zoo import build
from dit_passes.testing import run_ranks
from dit_passes.testing.pipelines import flux_pipeline

diffusers = pytest.importorskip("diffusers")
torch.set_num_threads(1)  # CI: 2 xdist workers and the rank tests share 2 cores; a second thread only spins
TEXT = 32  # the zoo flux's joint_attention_dim and pooled_projection_dim
NO_TEXT = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)


def smooth_flux(**overrides):
    """A zoo flux transformer with 9 blocks (> DBCacheConfig()'s Fn_compute_blocks=8) whose timestep embedding is
    scaled by 0.1: consecutive steps then differ by ~0.04-0.09 (relative L1 of the Fn residual), so the default
    threshold 0.08 caches some steps, as on a real model, where the random tiny one would give ~0.2-0.4."""
    m = build("flux", num_layers=4, num_single_layers=5, **overrides).model
    with torch.no_grad():
        for p in m.time_text_embed.parameters():
            p.mul_(0.1)
    return m


def call(pipe, steps=12, output_type="latent"):
    """``pipe(prompt=..., num_inference_steps=steps)`` of the seeds, with prompt embeddings."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        return pipe(prompt_embeds=torch.randn(1, 7, TEXT, generator=g),
                    pooled_prompt_embeds=torch.randn(1, TEXT, generator=g),
                    height=16, width=16, num_inference_steps=steps, guidance_scale=3.5, output_type=output_type,
                    generator=torch.Generator().manual_seed(3)).images


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------------------------------------ one process
def test_one_line_enable_cache(tmp_path):
    """Seed 001 (README) ``cache_dit.enable_cache(pipe)`` and seed 004 (README-CN and quickstart 1):
    ``pipe = DiffusionPipeline.from_pretrained(...)``, ``cache_dit.enable_cache(pipe)``,
    ``pipe(prompt=..., num_inference_steps=25)``: the default DBCacheConfig caches exactly the steps after the
    8 warm-up steps whose residual diff is under 0.08."""
    from diffusers import DiffusionPipeline
    flux_pipeline(smooth_flux()).save_pretrained(tmp_path / "FLUX.1-dev")
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "FLUX.1-dev"), **NO_TEXT).to("cpu")
    pipe.set_progress_bar_config(disable=True)
    baseline = call(pipe, steps=25)
    cache_dit.enable_cache(pipe)
    output = call(pipe, steps=25)
    st = cache_dit.summary(pipe, logging=False)[0]
    assert cache_dit.strify(pipe).startswith("DBCache_F8B0_W8I1M0MC0_R0.08_")
    diffs = {int(k): v for k, v in st.residual_diffs.items()}
    assert sorted(diffs) == list(range(8, 25))  # warm-up steps 0-7 always compute
    assert st.cached_steps and st.cached_steps == sorted(s for s, d in diffs.items() if d < 0.08)
    assert st.accumulated_executed_steps == 25
    # measured 6e-4 here (each cached step reuses a residual that is < 8% off); 2% leaves margin for the
    # drift of the cached steps on another BLAS / thread count
    assert 0 < rel(output, baseline) < 0.02


@pytest.mark.parametrize("quant_type", ["svdq_nvfp4_r32", "svdq_int4_r32"])
def test_svdq_ptq_quantize_and_load(tmp_path, quant_type):
    """Seed 001 (README) SVDQuant PTQ: ``quantize(pipe.transformer, quant_config=QuantizeConfig(quant_type=
    "svdq_nvfp4_r32", calibrate_fn=calibrate_fn, serialize_to="path"))`` then ``load(pipe.transformer, "path")``;
    seed 004 (README-CN, quickstart 3): ``QuantizeConfig(quant_type="svdq_int4_r32", calibrate_fn=...,
    serialize_to=...)``, ``pipe.transformer = cache_dit.quantize(pipe.transformer, quant_config)``, ``pipe(...)``.
    NVFP4 runs as data (its checkpoint layout, the reference linear on CPU); the quickstart's
    ``serialize_to="quantized_model.safetensors"`` is refused as by the reference (a directory, or
    ``<dir>/<quant_type>.safetensors``)."""
    pipe = flux_pipeline(build("flux", num_attention_heads=4).model)  # inner dim 64: W4A4 groups of 64
    baseline = call(pipe, steps=2)
    calibration_prompts = [0, 1]
    calls = []

    def calibrate_fn(**_: object) -> None:
        with torch.inference_mode():
            for prompt in calibration_prompts:
                calls.append(prompt)
                _ = call(pipe, steps=2)

    with pytest.raises(ValueError, match=rf"quantized_model\.safetensors.*{quant_type}\.safetensors"):
        cache_dit.QuantizeConfig(quant_type=quant_type, calibrate_fn=calibrate_fn,
                                 serialize_to=str(tmp_path / "quantized_model.safetensors"))
    quant_config = cache_dit.QuantizeConfig(quant_type=quant_type, calibrate_fn=calibrate_fn,
                                            serialize_to=str(tmp_path / "path"))
    original = pipe.transformer
    pipe.transformer = cache_dit.quantize(pipe.transformer, quant_config)
    assert calls == [0, 1] and (tmp_path / "path" / f"{quant_type}.safetensors").exists()
    output = call(pipe, steps=2)
    assert ("svdq_nvfp4_linear" if "nvfp4" in quant_type else "svdq_w4a4_linear") in pipe.transformer.code
    assert 0 < rel(output, baseline) < 0.05  # measured ~5e-3 (4-bit with a rank-32 low-rank branch)
    pipe.transformer = cache_dit.load(pipe.transformer, str(tmp_path / "path"))
    assert isinstance(pipe.transformer, CompiledDiT) and pipe.transformer.original is original
    assert torch.equal(call(pipe, steps=2), output)


def test_svdq_dq_examples():
    """Seed 001 (README) SVDQuant DQ: ``quantize(pipe.transformer, quant_config=QuantizeConfig(quant_type=
    "svdq_{int4|nvfp4}_r{32|...}_dq", svdq_kwargs={"smooth_strategy": "few_shot"}))``, ``pipe(...)``.
    int4 and nvfp4 r32 _dq run with their 4-bit linears in the graph, with the default smoothing and with
    ``few_shot`` (the first step runs unquantized while the linears' input spans are observed, the second quantized
    from them)."""
    tr = build("flux", num_attention_heads=4).model
    n_block_linears = sum(isinstance(m, torch.nn.Linear) and "norm" not in p for p, m in tr.named_modules()
                          if "transformer_blocks" in p)
    pipe = flux_pipeline(tr)
    baseline = call(pipe, steps=2)
    for quant_type, op in (("svdq_int4_r32_dq", "svdq_w4a4_linear"), ("svdq_nvfp4_r32_dq", "svdq_nvfp4_linear")):
        for kw in (None, {"smooth_strategy": "few_shot"}):
            pipe.transformer = cache_dit.quantize(tr, quant_config=cache_dit.QuantizeConfig(
                quant_type=quant_type, svdq_kwargs=kw), keep_original=True)  # quantized four times
            output = call(pipe, steps=2)
            assert pipe.transformer.code.count(op) >= n_block_linears > 0
            assert 0 < rel(output, baseline) < 0.05  # measured ~5e-3


def test_layerwise_offload_seed_options():
    """Seed 001 (README) ``cache_dit.layerwise_offload(pipe, onload_device="cuda", offload_device="cpu",
    async_transfer=True, transfer_buckets=4, persistent_buckets=64, persistent_bins=8, prefetch_limit=True,
    max_copy_streams=4, max_inflight_prefetch_bytes="8gib")`` then ``pipe(...)``: same output as no offload.
    dit_passes counts ``persistent_buckets`` in transformer blocks (the reference: in leaf layers), so 64 keeps
    every block of this model resident."""
    from dit_passes.passes.offload import LayerwiseOffload
    pipe = flux_pipeline(build("flux").model)
    baseline = call(pipe, steps=3)
    assert cache_dit.layerwise_offload(
        pipe, onload_device="cpu", offload_device="cpu", async_transfer=True, transfer_buckets=4,
        persistent_buckets=64, persistent_bins=8, prefetch_limit=True, max_copy_streams=4,
        max_inflight_prefetch_bytes="8gib") is pipe
    assert isinstance(pipe.transformer, CompiledDiT)
    assert [type(p) for p in pipe.transformer.passes] == [LayerwiseOffload]
    assert torch.equal(call(pipe, steps=3), baseline)
    rec = [r for r in pipe.transformer._current().manager.records if r.name == "layerwise_offload"][0].result.counts
    assert rec["blocks_offloaded"] == 0, rec  # all 4 blocks within the 64 persistent ones


# ------------------------------------------------------------------------------------------------ gloo ranks
PAR_STEPS = 12
PAR_CASES = {  # case -> the seed example's enable_cache arguments
    "ulysses_cache": "DBCacheConfig() + ParallelismConfig(ulysses_size=2)",
    "ulysses_cache_fp8": "DBCacheConfig() + ParallelismConfig(ulysses_size=2) + QuantizeConfig('float8_per_row')",
    "ring": "ParallelismConfig(ring_size=2)",
}


def _case_kwargs(case, world):
    pc = {"ring": dict(ring_size=world)}.get(case, dict(ulysses_size=world))
    kw = dict(parallelism_config=cache_dit.ParallelismConfig(**pc)) if world > 1 else {}
    if case != "ring":
        kw["cache_config"] = cache_dit.DBCacheConfig()  # w/ default
    if case == "ulysses_cache_fp8":
        kw["quantize_config"] = cache_dit.QuantizeConfig(quant_type="float8_per_row")
    return kw


def _par_case(case, world):
    """One seed example: output, cached steps and fp8 node count of ``enable_cache(pipe, **kwargs)``."""
    pipe = flux_pipeline(smooth_flux())
    kwargs = _case_kwargs(case, world)
    if kwargs:  # the single-process reference of "ring" is the plain pipeline
        cache_dit.enable_cache(pipe, **kwargs)
    out = call(pipe, steps=PAR_STEPS if case != "ring" else 3)
    if not kwargs:
        return {"out": out, "cached": [], "fp8": 0, "passes": []}
    cached = cache_dit.summary(pipe, logging=False)[0].cached_steps
    # the fp8 linears are plain ATen graph forms; the node that took each linear's place carries meta["dit_quant"]
    fp8 = sum(1 for n in pipe.transformer.graph.nodes if str(n.meta.get("dit_quant", "")).startswith("fp8"))
    names = [p.name for p in pipe.transformer.runtime.state["frontend"].passes]
    return {"out": out, "cached": cached, "fp8": fp8, "passes": names}


def _par_ranks(rank, world):
    return {case: _par_case(case, world) for case in PAR_CASES}


@pytest.fixture(scope="session")
def parallel_results():
    """Every gloo example in one spawn of 2 ranks (process start-up dominates), and the single-process runs."""
    single = {case: _par_case(case, 1) for case in PAR_CASES}
    return single, run_ranks(_par_ranks, 2, timeout=300)


def _check_parallel(parallel_results, case, tol=1e-5):
    single, ranks = parallel_results
    ref = single[case]
    for rank, res in enumerate(ranks):
        r = res[case]
        assert rel(r["out"], ref["out"]) <= tol, f"{case} rank {rank}: {rel(r['out'], ref['out']):.2e}"
        assert r["cached"] == ref["cached"], (case, rank, r["cached"], ref["cached"])
        assert r["fp8"] == ref["fp8"]
    return ref, ranks[0][case]


@pytest.mark.multiproc
def test_parallel_examples_ulysses_cache_and_fp8(parallel_results):
    """Seeds 001 (README) and 004 (README-CN, quickstart 2): ``enable_cache(pipe, cache_config=DBCacheConfig(),
    parallelism_config=ParallelismConfig(ulysses_size=2))`` and the same ``+ quantize_config=QuantizeConfig(
    quant_type="float8_per_row")``, on 2 gloo ranks: each rank's latents equal the single process's (1e-5
    relative; with fp8 1e-3, below) with the same cached steps (decisions are all-reduced), and fp8 linears in the
    graph."""
    ref, r = _check_parallel(parallel_results, "ulysses_cache")
    assert ref["cached"] and r["passes"] == ["ulysses", "dbcache"] and r["fp8"] == 0
    # Attention over a rank's half of the heads sums in another order than over all of them (last-ulp differences,
    # within 1e-5 above); a per-token e4m3 rounding downstream amplifies one such difference to a whole e4m3 step
    # (1/16 of the value) where it straddles a rounding boundary: 1.2e-4 measured with transformers 5.25's embeddings
    ref, r = _check_parallel(parallel_results, "ulysses_cache_fp8", tol=1e-3)
    assert ref["cached"] and r["passes"] == ["ulysses", "fp8_linear", "dbcache"] and r["fp8"] > 0


@pytest.mark.multiproc
def test_parallel_examples_ring(parallel_results):
    """Seed 000 (Ray wrapper, "Distributed Inference"): ``ParallelismConfig(ring_size=2, use_ray=True)``, run on 2
    gloo ranks (the Ray workers build the same Ring pass; the Ray transport is tested with tp / ulysses below):
    latents equal the single process's; no residual cache (only a parallelism config given: the reference's rule)."""
    ref, r = _check_parallel(parallel_results, "ring")
    assert r["passes"] == ["ring"] and r["cached"] == []


# ------------------------------------------------------------------------------------------------ Ray
USER_APP = textwrap.dedent('''
    from diffusers import FluxTransformer2DModel

    class {name}(FluxTransformer2DModel):
        """A user-defined transformer class: Ray workers can import it only through a runtime_env PYTHONPATH."""
''')


def _user_module(root, name, cls):
    d = root / name
    d.mkdir()
    (d / f"{name}.py").write_text(USER_APP.format(name=cls))
    return str(d)


def _user_pipeline(module, cls, seed=0, **overrides):
    """A tiny FluxPipeline whose transformer is ``module.cls`` (weights of the zoo flux)."""
    sys.path.insert(0, module)
    try:
        user = __import__(os.path.basename(module))
    finally:
        sys.path.remove(module)
    plain = build("flux", seed=seed, **overrides).model
    tr = getattr(user, cls).from_config(plain.config).eval()
    tr.load_state_dict(plain.state_dict())
    return flux_pipeline(tr)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Seed 000 "Pre-initialized Ray": ``ray.init(runtime_env={"env_vars": {"PYTHONPATH": "/path/to/your/app/src"}})``
    before ``enable_cache``; the app module holds a transformer class the workers can only import through it.
    Ray is shut down after the module and no process of it may remain."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray cluster from another test is still running in this process")
    from dit_passes.testing.ray_cluster import local_ray_cluster
    app = _user_module(tmp_path_factory.mktemp("app"), "seed_user_app", "AppFluxTransformer")
    # ray.init outside the repository root: Ray puts the driver's cwd on the workers' path (its kernels/ would
    # shadow the PyPI `kernels`)
    try:
        with local_ray_cluster(app, prefix="rays", init_in_temp_dir=True):
            yield app
    finally:
        sys.modules.pop("seed_user_app", None)


@contextlib.contextmanager
def _disabled_after(pipe_or_module):
    try:
        yield
    finally:
        cache_dit.disable_cache(pipe_or_module)  # shuts the workers down


def _lora_pipeline(app):
    peft = pytest.importorskip("peft")
    pipe = _user_pipeline(app, "AppFluxTransformer")
    torch.manual_seed(0)
    pipe.transformer.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                 target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"]))
    return pipe


@pytest.mark.ray
def test_ray_pipeline_wrapper_tp2_fused_lora(ray_cluster, tmp_path):
    """Seed 000 "Pipeline Wrapper" + "How to use LoRAs": ``pipe.fuse_lora()``, ``cache_dit.enable_cache(pipe,
    parallelism_config=ParallelismConfig(tp_size=2, use_ray=True))``, ``image = pipe(...).images[0]``,
    ``image.save(...)``, on the pre-initialised Ray (its runtime_env makes the transformer class importable):
    the image equals the single process's (1e-5 relative). (The reference runs the whole pipeline in the workers;
    dit_passes runs the transformer there, ``pipe.transformer`` being a proxy: same call, same result.)"""
    single = _lora_pipeline(ray_cluster)
    single.fuse_lora()
    assert any(getattr(m, "merged", False) for m in single.transformer.modules())  # the LoRA is in the weights
    ref = call(single, steps=2, output_type="pt")
    pipe = _lora_pipeline(ray_cluster)
    pipe.fuse_lora()
    original = pipe.transformer
    assert cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(tp_size=2, use_ray=True)) is pipe
    with _disabled_after(pipe):
        images = call(pipe, steps=2, output_type="pt")
        workers = pipe.transformer._engine.run_on_workers(
            lambda w: (type(w.compiled[0].original).__name__, [p.name for p in w.compiled[0].passes]))
    assert pipe.transformer is original
    assert workers == [("AppFluxTransformer", ["tensor_parallel"])] * 2
    assert rel(images, ref) <= 1e-5, rel(images, ref)
    image = pipe.image_processor.postprocess(images, output_type="pil")[0]
    image.save(tmp_path / "ray_wrapper.png")
    assert (tmp_path / "ray_wrapper.png").stat().st_size > 0


@pytest.mark.parity("ParallelismConfig.ray_runtime_env", "ParallelismConfig.use_ray", "ParallelismConfig.ulysses_size")
@pytest.mark.ray
def test_ray_transformer_wrapper_runtime_env(ray_cluster, tmp_path):
    """Seed 000 "Transformer Wrapper" + "Ray Runtime Env": ``cache_dit.enable_cache(pipe.transformer,
    parallelism_config=ParallelismConfig(ulysses_size=2, use_ray=True, ray_runtime_env={"env_vars": {"PYTHONPATH":
    f"/path/to/your/app/src:{os.environ.get('PYTHONPATH', '')}"}}))`` (result not assigned), ``pipe.to("cuda")``,
    ``pipe(...)``: the steps run on the workers (their transformer class comes from the runtime_env PYTHONPATH),
    ``pipe.to`` leaves the main copy where it is, the output equals the single process's."""
    src = _user_module(tmp_path, "seed_other_app", "OtherFluxTransformer")
    single = _user_pipeline(src, "OtherFluxTransformer")
    ref = call(single, steps=2)
    pipe = _user_pipeline(src, "OtherFluxTransformer")
    transformer = pipe.transformer
    with pytest.warns(UserWarning, match="Ray was initialised before RayLauncher"):
        cache_dit.enable_cache(
            pipe.transformer,
            parallelism_config=cache_dit.ParallelismConfig(
                ulysses_size=2,
                use_ray=True,
                ray_runtime_env={
                    "env_vars": {
                        "PYTHONPATH": f"{src}:{os.environ.get('PYTHONPATH', '')}",
                    }
                },
            ),
        )
    try:
        assert pipe.transformer is transformer
        pipe.to("cpu")  # the seed's pipe.to("cuda")
        assert transformer.to("meta") is transformer and transformer.x_embedder.weight.device.type == "cpu"
        out = call(pipe, steps=2)
        engine = transformer.__dict__["_dit_frontend"].engine
        calls = engine.run_on_workers(lambda w: (type(w.compiled[0].original).__name__, w.compiled[0].runtime.calls,
                                                 [p.name for p in w.compiled[0].passes]))
    finally:
        sys.modules.pop("seed_other_app", None)
        assert cache_dit.disable_cache(transformer) is transformer
    assert calls == [("OtherFluxTransformer", 2, ["ulysses"])] * 2  # both steps ran on both workers
    assert rel(out, ref) <= 1e-5, rel(out, ref)
    assert "forward" not in transformer.__dict__ and "to" not in transformer.__dict__  # routing undone


def make_init_fn(path):
    """Seed 000 "Ray Transfer Fn": defined at module level; the returned closure holds only the path."""
    def _init_fn():
        from diffusers import FluxPipeline
        pipe = FluxPipeline.from_pretrained(path, torch_dtype=torch.float32, **NO_TEXT).to("cpu")
        pipe.set_progress_bar_config(disable=True)
        return pipe
    return _init_fn


@pytest.mark.parity("ParallelismConfig.ray_transfer_fn", "ParallelismConfig.tp_size")
@pytest.mark.ray
@pytest.mark.filterwarnings("ignore:`torch_dtype` is deprecated:FutureWarning")  # the seed's from_pretrained call
def test_ray_transfer_fn_engine_cache_quant(ray_cluster, tmp_path):
    """Seed 000 "Ray Transfer Fn": ``config = ParallelismConfig(tp_size=2, use_ray=True,
    ray_transfer_fn=make_init_fn())``, ``pipe = cache_dit.enable_cache(parallelism_config=config)``,
    ``image = pipe(...).images[0]``; with seed 000 "Cache and Quantization" (``cache_config=DBCacheConfig(...)``,
    ``quantize_config=QuantizeConfig(...)``, "still applied inside the workers after the function returns"):
    a RayEngine is returned, each worker loads the saved pipeline itself, its graph has the TP, fp8 and cache
    passes, the cached steps are the single process's and the output is close to it."""
    from dit_passes.launch.ray_launcher import RayEngine
    path = str(tmp_path / "FLUX.2-klein-base-9B")
    flux_pipeline(smooth_flux()).save_pretrained(path)
    cache_config = cache_dit.DBCacheConfig(residual_diff_threshold=0.08)
    quantize_config = cache_dit.QuantizeConfig(quant_type="float8_per_row")
    single = make_init_fn(path)()
    cache_dit.enable_cache(single, cache_config=cache_config, quantize_config=quantize_config)
    ref = call(single)
    ref_cached = cache_dit.summary(single, logging=False)[0].cached_steps
    config = cache_dit.ParallelismConfig(tp_size=2, use_ray=True, ray_transfer_fn=make_init_fn(path))
    pipe = cache_dit.enable_cache(parallelism_config=config, cache_config=cache_config, quantize_config=quantize_config)
    assert isinstance(pipe, RayEngine)
    try:
        image = call(pipe, output_type="latent")
        workers = pipe.run_on_workers(lambda w: ([p.name for p in w.compiled[0].passes],
                                                 w.compiled[0].cache_summary(as_dict=True)[-1]["cached_steps"]))
    finally:
        pipe.shutdown()
    assert ref_cached, "the single process cached nothing: the comparison would not exercise the cache"
    for names, cached in workers:
        # fp8 per row, then per tensor on the row-parallel linears (per_tensor_fallback=True, as cache-dit)
        assert names == ["tensor_parallel", "fp8_linear", "fp8_linear", "dbcache"] and cached == ref_cached
    # TP shards each linear and the fp8 per-row scales are then computed on the shards: not bit-exact with the
    # single process; measured 1.4e-3, bound 2%
    assert rel(image, ref) < 0.02, rel(image, ref)


@pytest.mark.parity("ParallelismConfig.ray_use_compile")
def test_ray_use_compile_reaches_the_launcher(monkeypatch):
    """Seed 000 "Torch Compile": ``enable_cache(pipe, parallelism_config=ParallelismConfig(tp_size=2, use_ray=True,
    ray_use_compile=True))`` asks the launcher to compile in the workers (launch stubbed: Inductor on CPU workers
    takes minutes; the workers' compile path is tests/test_ray_launcher.py::test_factory_and_snapshot_paths)."""
    from dit_passes.launch.ray_launcher import RayLauncher
    seen = {}

    class Stop(Exception):
        pass

    def launch(self, obj, passes=(), **kwargs):
        seen.update(kwargs, world_size=self.world_size)
        raise Stop

    monkeypatch.setattr(RayLauncher, "launch", launch)
    pipe = flux_pipeline(build("flux").model)
    transformer = pipe.transformer
    with pytest.raises(Stop):
        cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(tp_size=2, use_ray=True,
                                                                                    ray_use_compile=True))
    assert seen["compile"] is True and seen["world_size"] == 2 and seen["level"] == "transformer"
    assert pipe.transformer is transformer  # nothing applied by the failed launch


@pytest.mark.parity("ParallelismConfig.ray_transfer_backend", "ParallelismConfig.ray_master_port",
                    "ParallelismConfig.ray_init_kwargs")
def test_ray_settings_reach_the_launcher(monkeypatch):
    """``ray_transfer_backend`` picks the launcher's transfer (each transfer against the single process:
    tests/test_ray_launcher.py::test_factory_and_snapshot_paths), ``ray_master_port`` / ``ray_init_kwargs`` /
    ``ray_num_workers`` reach the launcher (a cluster run: tests/test_ray_launcher_owned.py); launch stubbed."""
    from dit_passes.launch.ray_launcher import RayLauncher
    seen = {}

    class Stop(Exception):
        pass

    def launch(self, obj, passes=(), **kwargs):
        seen.update(kwargs, launcher=self)
        raise Stop

    monkeypatch.setattr(RayLauncher, "launch", launch)
    pipe = flux_pipeline(build("flux").model)
    for backend, transfer in (("auto", None), ("snapshot", "snapshot"), ("object_store", "object_store")):
        with pytest.raises(Stop):
            cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(
                ulysses_size=2, use_ray=True, ray_transfer_backend=backend, ray_master_port=29517,
                ray_init_kwargs={"namespace": "x"}, ray_num_workers=2))
        assert seen["transfer"] == transfer
        assert (seen["launcher"].master_port, seen["launcher"].ray_init_kwargs, seen["launcher"].world_size) == (
            29517, {"namespace": "x"}, 2)
    with pytest.raises(ValueError, match="ray_transfer_backend='pickle': use 'auto', 'object_store' or 'snapshot'"):
        cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(
            ulysses_size=2, use_ray=True, ray_transfer_backend="pickle"))
    with pytest.raises(ValueError, match="ray_num_workers=3 differs from the parallel sizes' product 2"):
        cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(
            ulysses_size=2, use_ray=True, ray_num_workers=3))


@pytest.mark.parity("ParallelismConfig.ray_use_flashpack", "ParallelismConfig.ray_transfer_custom_obj",
                    status="refused")
def test_ray_snapshot_switches_refused():
    pipe = flux_pipeline(build("flux").model)
    with pytest.raises(ValueError, match="ray_use_flashpack=True: .*leave it False"):
        cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(
            ulysses_size=2, use_ray=True, ray_use_flashpack=True))
    with pytest.raises(ValueError, match="ray_transfer_custom_obj=False: .*leave it True"):
        cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(
            ulysses_size=2, use_ray=True, ray_transfer_custom_obj=False))
