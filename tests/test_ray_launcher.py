"""RayLauncher: a tiny FluxPipeline run on 2 CPU Ray workers (gloo) equals the single-process run.

One Ray cluster for the module (num_cpus=2, started by the fixture, so the launcher's "Ray already
running" path is the one used; the bench starts Ray through the launcher). The reference is always the
same pipeline run eagerly in this process. After the module, no process of the cluster may remain.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import time

import pytest
import torch

ray = pytest.importorskip("ray")
from diffusers import FluxPipeline  # noqa: E402

from dit_passes.launch import transfer  # noqa: E402
from dit_passes.launch.ray_launcher import (RayEngine, RayLauncher, RayLauncherError, RayWorkerDiedError,  # noqa: E402
                                            RayWorkerError)
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.testing.pipelines import flux_pipeline  # noqa: E402
from dit_passes.testing.ray_cluster import local_ray_cluster  # noqa: E402

pytestmark = pytest.mark.ray

HAVE_CP = importlib.util.find_spec("dit_passes.passes.context_parallel") is not None
needs_cp = pytest.mark.skipif(not HAVE_CP, reason="dit_passes.passes.context_parallel (Ulysses / Ring) is missing")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TEXT_DIM = 32  # the zoo flux config's joint_attention_dim and pooled_projection_dim


def tiny_pipeline() -> FluxPipeline:
    """Zoo flux transformer (in_channels=16 = 4 latent channels x 2x2 packing) + a tiny VAE; no text encoders."""
    return flux_pipeline(build("flux").model)


def call_kwargs(steps: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g),
                pooled_prompt_embeds=torch.randn(1, TEXT_DIM, generator=g), height=16, width=16,
                num_inference_steps=steps, guidance_scale=3.5, output_type="latent",
                generator=torch.Generator().manual_seed(3))


def cp_passes(kind: str):
    from dit_passes.passes.context_parallel import Ring, Ulysses
    return [] if kind == "none" else [{"ulysses": Ulysses, "ring": Ring}[kind](2)]


@pytest.fixture(scope="module")
def cluster():
    # tests/ on the workers' path: closures defined here reference this module's helpers by name
    with local_ray_cluster(TESTS_DIR, prefix="rayt") as temp_dir:
        yield temp_dir


@pytest.fixture(scope="module")
def reference_latents():
    with torch.inference_mode():
        return tiny_pipeline()(**call_kwargs()).images


# --------------------------------------------------------------------------- transfer, no Ray needed
def test_object_store_roundtrip_rebuilds_by_config_and_aliases_arrays():
    model = build("flux").model.to(torch.bfloat16)
    packed = transfer.pack_for_object_store(model)
    assert list(packed.strategies.values()) == ["config"]
    assert packed.nbytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rebuilt = transfer.unpack_from_object_store(packed.skeleton, packed.arrays)
    assert type(rebuilt) is type(model) and not rebuilt.training
    for (name, a), (name_b, b) in zip(model.state_dict().items(), rebuilt.state_dict().items()):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    # zero-copy: the rebuilt weights are views of the arrays (what Ray maps from its shared store)
    ptrs = {a.ctypes.data for a in packed.arrays.values()}
    assert all(p.data_ptr() in ptrs for p in rebuilt.parameters())
    copied = transfer.unpack_from_object_store(packed.skeleton, packed.arrays, copy_weights=True)
    assert not any(p.data_ptr() in ptrs for p in copied.parameters())


def test_object_store_pickles_modified_models_and_keeps_tied_weights():
    model = build("flux").model
    model.proj_out = torch.nn.Sequential(model.proj_out)  # no longer what its config builds
    holder = {"a": model, "b": model, "w": model.x_embedder.weight, "w2": model.x_embedder.weight}
    packed = transfer.pack_for_object_store(holder)
    assert "differs" in next(iter(packed.strategies.values()))
    back = transfer.unpack_from_object_store(packed.skeleton, packed.arrays)
    assert back["a"] is back["b"] and back["w"] is back["w2"] is back["a"].x_embedder.weight
    inputs = build("flux").make_inputs()
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], back["a"](**inputs)[0])


def test_transfer_errors_name_the_alternative():
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(transfer.TransferError, match="meta device.*factory"):
        transfer.pack_for_object_store(meta)
    with pytest.raises(transfer.TransferError, match="no arguments"):
        transfer.check_factory(lambda path: path)
    with pytest.raises(transfer.TransferError, match="snapshot.*save_pretrained"):
        transfer.save_snapshot(torch.nn.Linear(2, 2))
    with pytest.raises(RayLauncherError, match="level='transformer'"):
        RayLauncher(world_size=2).launch(build("flux").model)
    with pytest.raises(RayLauncherError, match="zero-argument callable"):
        RayLauncher(world_size=2).launch(tiny_pipeline(), transfer="factory")
    with pytest.raises(RayLauncherError, match="placement"):
        RayLauncher(world_size=2, placement="diagonal")


# --------------------------------------------------------------------------------- on the workers
def test_transformer_wrapper_matches_single_process(cluster, reference_latents):
    pipe = tiny_pipeline()
    passes_fn = (lambda rank, world: cp_passes("ulysses")) if HAVE_CP else (lambda rank, world: [])
    engine = RayLauncher(world_size=2, timeout_s=60).launch(pipe, passes=passes_fn, level="transformer")
    try:
        proxy = engine.as_transformer()
        assert proxy.config.in_channels == 16 and proxy.dtype == torch.float32
        assert not list(proxy.parameters())
        pipe.transformer = proxy
        pipe.to("cpu")  # what pipe.to("cuda") does to the proxy: record the device, move nothing
        assert proxy.device == torch.device("cpu")
        with torch.inference_mode():
            got = pipe(**call_kwargs()).images
        calls = engine.run_on_workers(lambda w: w.compiled[0].runtime.calls)
    finally:
        engine.shutdown()
    assert calls == [2, 2]  # 2 steps, each forwarded to both ranks
    assert torch.allclose(got, reference_latents, atol=1e-5, rtol=0), (got - reference_latents).abs().max()
    with pytest.raises(RayLauncherError, match="shut down"):
        proxy(hidden_states=torch.zeros(1))


def test_factory_and_snapshot_paths(cluster, reference_latents):
    def factory():  # a closure: cloudpickled by value; tiny_pipeline resolves through PYTHONPATH=tests/
        import test_ray_launcher
        return test_ray_launcher.tiny_pipeline()

    # compile: each lowered graph is torch.compiled after its first call (backend "eager": no Inductor on CPU CI)
    with RayLauncher(world_size=2, timeout_s=60).launch(factory, passes=[], compile={"backend": "eager"}) as engine:
        assert engine.transfer_report["path"] == "factory"
        assert torch.allclose(engine(**call_kwargs()).images, reference_latents, atol=1e-5, rtol=0)
        compiled = engine.run_on_workers(lambda w: [gm._compiled_call_impl is not None
                                                    for gm in w.obj.transformer.graphs.values()])
        assert compiled == [[True], [True]]
        assert torch.allclose(engine(**call_kwargs()).images, reference_latents, atol=1e-5, rtol=0)
    with RayLauncher(world_size=2, timeout_s=60).launch(tiny_pipeline(), transfer="snapshot") as engine:
        snapshot_dir = engine.transfer_report["snapshot_dir"]
        assert torch.allclose(engine(**call_kwargs()).images, reference_latents, atol=1e-5, rtol=0)
    assert not os.path.exists(snapshot_dir)


# A runtime_env PYTHONPATH reaching the workers (a user's module importable only through it): the seed example
# tests/test_seed_examples.py::test_ray_transformer_wrapper_runtime_env (through enable_cache, which builds the launcher
# with it; a launcher-level twin here cost another two workers' start-up, ~10 s of CI).


# ------------------------------------------------------------------------------ through the front end
def wan22_pipeline():
    """Wan 2.2's layout: a WanPipeline whose ``transformer`` runs the high-noise steps and ``transformer_2`` the
    low-noise ones (``boundary_ratio``); two tiny zoo Wan transformers, no text encoder, no VAE (latents out)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=build("wan", seed=1).model, transformer_2=build("wan", seed=2).model,
                       boundary_ratio=0.85)  # 4 steps: 2 on each transformer
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan22_call(pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # CFG: each step calls the transformer under cache_context("cond" / "uncond", ...)
        return pipe(prompt_embeds=torch.randn(1, 8, 32, generator=g), negative_prompt_embeds=torch.randn(1, 8, 32, generator=g),
                    height=32, width=32, num_frames=1, num_inference_steps=4, guidance_scale=4.0, output_type="latent",
                    generator=torch.Generator().manual_seed(3)).frames


def test_frontend_two_transformers_and_refresh_context(cluster):
    """``enable_cache(wan22_pipe, cache_config=..., parallelism_config=ParallelismConfig(ulysses_size=2,
    use_ray=True))``: both transformers are lowered in the same two workers (one engine, a proxy each); then
    ``refresh_context(pipe, cache_config=<another config>)`` lowers them again in those workers (same pids). Each
    run equals the single process's under the same configs (1e-5 relative, same cached steps per transformer)."""
    import dit_passes as cache_dit
    # the tiny Wans' residual diffs are 0.09-0.15: threshold 0.3 caches every step after the warm-up
    first = cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.3,
                                    max_warmup_steps=1)
    second = dataclasses.replace(first, max_warmup_steps=2)

    def cached(pipe):
        return [(s.cached_steps, s.cfg_cached_steps) for s in cache_dit.summary(pipe, logging=False)]

    single = wan22_pipeline()
    cache_dit.enable_cache(single, cache_config=first)
    ref = [wan22_call(single), cached(single)]
    cache_dit.refresh_context(single, cache_config=second)
    ref += [wan22_call(single), cached(single)]

    pipe = wan22_pipeline()
    originals = (pipe.transformer, pipe.transformer_2)
    cache_dit.enable_cache(pipe, cache_config=first, parallelism_config=cache_dit.ParallelismConfig(ulysses_size=2,
                                                                                                    use_ray=True))
    try:
        engine = pipe.transformer._engine
        assert pipe.transformer_2._engine is engine and type(pipe.transformer_2).__name__ == "RayTransformerProxy"
        pids = engine.run_on_workers(lambda w: os.getpid())
        got = [wan22_call(pipe), cached(pipe)]
        cache_dit.refresh_context(pipe, cache_config=second)
        got += [wan22_call(pipe), cached(pipe)]
        after = engine.run_on_workers(lambda w: (os.getpid(), [([p.name for p in c.passes], c.passes[-1].config.max_warmup_steps)
                                                               for c in w.compiled]))
    finally:
        cache_dit.disable_cache(pipe)
    assert (pipe.transformer, pipe.transformer_2) == originals
    assert after == [(pid, [(["ulysses", "dbcache"], 2)] * 2) for pid in pids]  # no restart, both refreshed
    assert ref[1] != ref[3] and all(steps for steps, _ in ref[1])  # the configs differ in what they cache
    assert got[1] == ref[1] and got[3] == ref[3], (got[1::2], ref[1::2])
    for a, b in ((got[0], ref[0]), (got[2], ref[2])):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


@needs_cp
def test_frontend_few_shot_svdq_in_the_workers(cluster):
    """``QuantizeConfig("svdq_int4_r8_dq", svdq_kwargs={"smooth_strategy": "few_shot"})`` with ``use_ray=True``:
    each worker observes its first forward (its half of the sequence under Ulysses, the spans merged over the
    ranks), then lowers again quantized, as the single process does with the whole sequence: the same numbers up
    to int4 rounding flips (the merged spans equal the single process's), one re-lowering per worker."""
    import dit_passes as cache_dit

    def quant():
        return cache_dit.QuantizeConfig(quant_type="svdq_int4_r8_dq", svdq_kwargs={"smooth_strategy": "few_shot"})

    single = tiny_pipeline()
    cache_dit.enable_cache(single, quantize_config=quant())
    with torch.inference_mode():
        ref = single(**call_kwargs(steps=3)).images
    pipe = tiny_pipeline()
    cache_dit.enable_cache(pipe, quantize_config=quant(),
                           parallelism_config=cache_dit.ParallelismConfig(ulysses_size=2, use_ray=True))
    try:
        with torch.inference_mode():
            got = pipe(**call_kwargs(steps=3)).images
        seen = pipe.transformer._engine.run_on_workers(
            lambda w: (w.compiled[0].runtime.calls, len(w.compiled[0].graphs),
                       [n.target.__name__ for n in w.compiled[0].graph_module.graph.nodes if n.op == "call_function"
                        and "svdq" in str(n.target)][:1]))
    finally:
        cache_dit.disable_cache(pipe)
    assert all(calls == 3 and quantized for calls, _, quantized in seen), seen  # quantized after the observed call
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-3  # measured 1.1e-7


def te_pipeline() -> FluxPipeline:
    """tiny_pipeline with a tiny T5 as ``text_encoder_2`` (the main encoder: ``"text_encoder"``); seeded, so the
    pipeline each worker builds (ray_transfer_fn) equals this process's."""
    import transformers as T
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        t5 = T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                         dropout_rate=0.0)).eval()
        return flux_pipeline(build("flux").model, text_encoder_2=t5)


def calibrate_around(model) -> None:
    """cache-dit's ``calibrate_fn(model=...)`` form: the calibration call through a pipeline around ``model`` (the
    transformer being calibrated, wherever it lives: the workers that built it with ray_transfer_fn, or here)."""
    with torch.inference_mode():
        flux_pipeline(model)(**call_kwargs())


def test_frontend_ray_transfer_fn_extra_modules_components_and_ptq(cluster, tmp_path):
    """``enable_cache(None, parallelism_config=ParallelismConfig(ulysses_size=2, use_ray=True, ray_transfer_fn=...,
    extra_parallel_modules=["text_encoder", "vae"]), quantize_config=QuantizeConfig("svdq_int4_r8", calibrate_fn=
    calibrate_around, components_to_quantize={"transformer": {}, "text_encoder": {"quant_type": "int8_per_row"}}))``:
    cache-dit's form (its workers run enable_cache on the pipeline each built): in each worker the names resolve in
    its own pipeline (``"text_encoder"``: the main one, the T5), the T5 runs tensor-parallel then int8, the VAE is
    row-split, ``calibrate_fn`` runs there with ``model=`` that worker's transformer and rank 0 writes the
    checkpoint. The latents equal the single process's under the same quantize config (same calibration, Ulysses
    exact); the T5's output stays within int8's bound of the single process's int8 T5."""
    import dit_passes as cache_dit

    def factory():  # a closure: cloudpickled by value; te_pipeline resolves through PYTHONPATH=tests/
        import test_ray_launcher
        return test_ray_launcher.te_pipeline()

    def quant(out):
        return cache_dit.QuantizeConfig(quant_type="svdq_int4_r8", serialize_to=str(out), calibrate_fn=calibrate_around,
                                        components_to_quantize={"transformer": {}, "text_encoder": {
                                            "quant_type": "int8_per_row", "serialize_to": None}})
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    single = te_pipeline()
    cache_dit.enable_cache(single, quantize_config=quant(tmp_path / "single"))
    with torch.inference_mode():
        ref, te_ref = single(**call_kwargs()).images, single.text_encoder_2(input_ids=ids).last_hidden_state
    assert (tmp_path / "single" / "svdq_int4_r8.safetensors").exists()

    def report(w):  # on each worker: what the setup did in the pipeline it built
        te, tr = w.obj.text_encoder_2, w.obj.transformer
        with torch.inference_mode():
            out = te(input_ids=ids).last_hidden_state
        return {"te": [r.name for r in te._current().manager.records], "vae": type(w.obj.vae).__name__,
                "passes": [p.name for p in tr.passes], "te_out": out}
    engine = cache_dit.enable_cache(quantize_config=quant(tmp_path / "ray"), parallelism_config=cache_dit.
                                    ParallelismConfig(ulysses_size=2, use_ray=True, ray_transfer_fn=factory,
                                                      extra_parallel_modules=["text_encoder", "vae"]))
    try:
        assert isinstance(engine, RayEngine)
        assert (tmp_path / "ray" / "svdq_int4_r8.safetensors").exists()  # rank 0 wrote it before enable returned
        got = engine(**call_kwargs()).images
        reports = engine.run_on_workers(report)
    finally:
        engine.shutdown()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    for r in reports:
        assert r["passes"] == ["ulysses", "svdquant_w4a4"], r
        assert [n for n in r["te"] if n != "cleanup"] == ["tensor_parallel", "int8_linear"], r
        assert r["vae"] == "ParallelVAE", r
        # TP splits the T5's output projections along K: their int8 rows are scaled per shard, not bit-equal
        assert ((r["te_out"] - te_ref).abs().max() / te_ref.abs().max()).item() < 0.05


# ------------------------------------------- the pipeline wrapper: one engine, last (it holds the cluster's CPUs)
@pytest.fixture(scope="module")
def launched_pipeline():
    """The pipeline object ``pipeline_engine`` was launched from (the fault test launches it again)."""
    return tiny_pipeline()


@pytest.fixture(scope="module")
def pipeline_engine(cluster, launched_pipeline):
    """One pipeline-level engine (object store, launched with passes=[]) for the pipeline-wrapper tests below.
    A launch costs ~15 s of CPU, most of it the two fresh worker processes importing torch and diffusers; each
    test sets the passes it checks (``set_passes``: lowered again at the next call, in the same workers) and the
    last one kills a worker (the engine is broken then; shutting it down again is a no-op)."""
    engine = RayLauncher(world_size=2, timeout_s=60).launch(launched_pipeline, passes=[])
    yield engine
    engine.shutdown()


def _use(engine, kind: str) -> None:
    engine.set_passes(lambda current: cp_passes(kind))  # a closure: cloudpickled by value, cp_passes by name


def test_pipeline_wrapper_matches_single_process(pipeline_engine, reference_latents):
    engine = pipeline_engine
    _use(engine, "none")
    out = engine(**call_kwargs())
    assert out.images.shape == reference_latents.shape
    assert torch.allclose(out.images, reference_latents, atol=1e-5, rtol=0)
    assert engine.backend == "gloo" and engine.transfer_report["path"] == "object_store"
    workers = engine.workers
    assert workers[0]["ip"] == ray.util.get_node_ip_address() and len({w["pid"] for w in workers}) == 2
    ranks = engine.run_on_workers(lambda w: (w.rank, type(w.obj.transformer).__name__, torch.get_num_threads()))
    assert ranks == [(0, "CompiledDiT", 1), (1, "CompiledDiT", 1)]
    # the same Python error on every rank: the group is still in step, the engine stays usable
    with pytest.raises(RayWorkerError, match=r"rank 0 of 2 raised TypeError.*no_such_argument"):
        engine(**call_kwargs(), no_such_argument=1)
    assert torch.allclose(engine(**call_kwargs()).images, reference_latents, atol=1e-5, rtol=0)


@needs_cp
@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_pipeline_wrapper_context_parallel(pipeline_engine, reference_latents, kind):
    engine = pipeline_engine
    _use(engine, kind)
    got = engine(**call_kwargs()).images
    passes = engine.run_on_workers(lambda w: [p.name for p in w.obj.transformer.passes])
    counts = engine.run_on_workers(lambda w: len(w.obj.transformer.graphs))
    assert passes == [[kind], [kind]]
    assert counts == [1, 1]
    assert torch.allclose(got, reference_latents, atol=1e-5, rtol=0), (got - reference_latents).abs().max()


def _pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child its parent has not reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_pids_gone(pids, wait_s: float = 30.0):
    deadline = time.monotonic() + wait_s
    while any(map(_pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if _pid_alive(pid)]


def test_worker_sigkilled_mid_generation_names_it_and_a_new_launch_works(pipeline_engine, launched_pipeline,
                                                                        reference_latents, tmp_path):
    """A worker SIGKILLed by its pid while a generation is in flight (rank 1 waits in its step-0 callback, rank 0
    in Ulysses' all-to-all of the next step): the driver raises RayWorkerDiedError naming rank 1 and its pid within
    60 s, no worker process of the engine is left after shutdown(), and a new launch of the same pipeline object
    equals the single process. That engine then sees a worker that exits by itself (os._exit in a step callback)."""
    import signal
    import threading
    marker = str(tmp_path / "rank1_in_step")

    def wait_on_rank1(pipe, step, timestep, callback_kwargs):  # a closure: cloudpickled by value
        import torch.distributed as dist
        if step == 0 and dist.get_rank() == 1:
            open(marker, "w").close()
            time.sleep(120)  # killed here
        return callback_kwargs

    engine = pipeline_engine
    _use(engine, "ulysses" if HAVE_CP else "none")
    pids = [w["pid"] for w in engine.workers]

    def kill_rank1_once_in_flight():
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank1_once_in_flight, daemon=True)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(RayWorkerDiedError) as info:
        engine(**call_kwargs(steps=3), callback_on_step_end=wait_on_rank1)
    raised_after = time.monotonic() - t0
    killer.join(5)
    assert os.path.exists(marker)  # the kill landed mid-generation
    assert raised_after < 60, raised_after
    assert info.value.rank == 1 and info.value.pid == pids[1]
    assert f"rank 1 of 2 (pid {pids[1]} on " in str(info.value) and "broken" in str(info.value), str(info.value)
    assert _wait_pids_gone(pids[1:]) == [], "the killed worker is still there"
    with pytest.raises(RayLauncherError, match="broken"):
        engine(**call_kwargs())
    engine.shutdown()
    assert _wait_pids_gone(pids) == [], f"worker processes left after shutdown: {pids}"
    assert "shut down" in repr(engine)
    with pytest.raises(RayLauncherError, match="shut down"):
        engine(**call_kwargs())

    def die_on_rank1(pipe, step, timestep, callback_kwargs):
        import torch.distributed as dist
        if step == 0 and dist.get_rank() == 1:
            os._exit(3)
        return callback_kwargs

    again = RayLauncher(world_size=2, timeout_s=60).launch(launched_pipeline, passes=[])
    try:
        new_pids = [w["pid"] for w in again.workers]
        assert not set(new_pids) & set(pids)
        assert torch.allclose(again(**call_kwargs()).images, reference_latents, atol=1e-5, rtol=0)
        _use(again, "ulysses" if HAVE_CP else "none")  # with Ulysses rank 0 then waits in an all-to-all
        t0 = time.monotonic()
        with pytest.raises(RayWorkerError, match="rank 1 of 2 .*died|rank 0 of 2 raised") as info:
            again(**call_kwargs(steps=3), callback_on_step_end=die_on_rank1)
        assert time.monotonic() - t0 < 45
        assert isinstance(info.value, RayWorkerDiedError) or "Connection" in str(info.value)
        with pytest.raises(RayLauncherError, match="broken"):
            again(**call_kwargs())
    finally:
        again.shutdown()
    assert _wait_pids_gone(new_pids) == [], f"worker processes left after shutdown: {new_pids}"
