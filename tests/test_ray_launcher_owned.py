"""RayLauncher starting (and stopping) Ray itself, with a runtime_env that makes a user module importable; and
connecting to a cluster another process runs (``ParallelismConfig.ray_address``).

The other Ray tests share a cluster their fixture starts; here no Ray runs in this process before the launch, so
the launcher's own ``ray.init`` path is used: its runtime_env is job-wide, the factory lives in a module
importable only through that PYTHONPATH, and ``shutdown()`` must stop Ray and leave no process behind. With an
address it connects instead, and ``shutdown()`` only disconnects: the test stops that cluster itself.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

ray = pytest.importorskip("ray")
from dit_passes.launch.ray_launcher import RayLauncher  # noqa: E402
from dit_passes.passes.context_parallel import Ulysses  # noqa: E402
from dit_passes.testing.ray_cluster import session_processes, wait_gone  # noqa: E402

pytestmark = pytest.mark.ray

USER_MODULE = textwrap.dedent('''
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from dit_passes.models.zoo import build

    def make_pipeline():
        transformer = build("flux").model
        torch.manual_seed(1)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                            latent_channels=4, norm_num_groups=4, layers_per_block=1).eval()
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                            tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call_kwargs():
        g = torch.Generator().manual_seed(0)
        return dict(prompt_embeds=torch.randn(1, 7, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                    height=16, width=16, num_inference_steps=2, guidance_scale=3.5, output_type="latent",
                    generator=torch.Generator().manual_seed(3))
''')


def test_launcher_owned_ray_runtime_env_and_clean_shutdown(tmp_path):
    if ray.is_initialized():
        pytest.skip("a Ray cluster from another test is still running in this process")
    user_dir = tmp_path / "user_code"
    user_dir.mkdir()
    (user_dir / "dp_user_pipeline.py").write_text(USER_MODULE)
    sys.path.insert(0, str(user_dir))  # the driver imports it too; the workers only through runtime_env
    try:
        import dp_user_pipeline as user
        with torch.inference_mode():
            reference = user.make_pipeline()(**user.call_kwargs()).images
        engine = RayLauncher(world_size=2, runtime_env={"env_vars": {"PYTHONPATH": str(user_dir)}},
                             timeout_s=120).launch(user.make_pipeline, passes=[Ulysses(2)])
        temp_dir = engine._ray_temp_dir
        try:
            assert engine._owns_ray and temp_dir and ray.is_initialized()
            latents = engine(**user.call_kwargs()).images
            files = engine.run_on_workers(lambda worker: __import__("dp_user_pipeline").__file__)
            assert all(f.startswith(str(user_dir)) for f in files), files
        finally:
            engine.shutdown()
        torch.testing.assert_close(latents, reference, rtol=0, atol=1e-5)
        assert not ray.is_initialized(), "the launcher started Ray, so shutdown() must stop it"
        assert not wait_gone(temp_dir), "Ray processes left behind"
        assert not os.path.exists(temp_dir), "the launcher's Ray temp dir was not removed"
    finally:
        sys.path.remove(str(user_dir))
        sys.modules.pop("dp_user_pipeline", None)


def _stop_cluster(temp_dir: str) -> list:
    """Stop the cluster ``ray start`` began in ``temp_dir`` by its processes' ids (``ray stop`` would stop every
    Ray of this machine's user): SIGTERM, then SIGKILL for those still there after 2 s (gcs_server and the raylet
    outlast SIGTERM for longer); returns the processes left."""
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
        for line in session_processes(temp_dir):
            try:
                os.kill(int(line.split(":")[0]), sig)
            except ProcessLookupError:
                pass
        left = wait_gone(temp_dir, wait_s=wait_s)
        if not left:
            break
    return left


def _te_pipeline():
    """The tiny Flux pipeline with a tiny T5 as ``text_encoder_2`` (TE-P) beside its tiny VAE (VAE-P), and a tiny
    CLIP as ``text_encoder`` (run in the driver)."""
    import transformers as T
    from dit_passes.models.zoo import build
    from dit_passes.testing.pipelines import flux_pipeline
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        t5 = T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                         dropout_rate=0.0)).eval()
        clip = T.CLIPTextModel(T.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                                                bos_token_id=0, eos_token_id=2, pad_token_id=1)).eval()
    pipe = flux_pipeline(build("flux").model, text_encoder_2=t5)
    pipe.register_modules(text_encoder=clip)
    return pipe


def _decoded(pipe, user_module) -> torch.Tensor:
    with torch.inference_mode():  # output_type="pt": the pipeline's own vae.decode runs (VAE-P on the workers)
        return pipe(**dict(user_module["call_kwargs"](), output_type="pt")).images


def _ptq(pipe, user_module, out_dir, filter_fn) -> "object":
    """SVDQuant PTQ of the transformer, int8 of the main text encoder (``"text_encoder"``: the T5) and of the VAE's
    linears, float8 of the CLIP (named by the module itself); the components without the transformer's filter_fn
    (each entry inherits the other fields) and, for the CLIP, without the default exclusions ("mod" is in
    "text_model")."""
    import dit_passes as cache_dit
    encoder = dict(serialize_to=None, filter_fn=None)
    return cache_dit.QuantizeConfig(quant_type="svdq_int4_r8", filter_fn=filter_fn, serialize_to=str(out_dir),
                                    calibrate_fn=lambda: _decoded(pipe, user_module), components_to_quantize={
                                        "transformer": {},
                                        "text_encoder": dict(encoder, quant_type="int8_per_row"),
                                        "vae": dict(encoder, quant_type="int8_per_row"),
                                        pipe.text_encoder: dict(encoder, quant_type="float8_per_row", exclude_layers=[])})


def _encoded(encoder, ids) -> torch.Tensor:
    with torch.no_grad():
        return encoder(input_ids=ids).last_hidden_state


@pytest.mark.parity("ParallelismConfig.use_ray", "ParallelismConfig.ray_address", "ParallelismConfig.ray_worker_options",
                    "ParallelismConfig.ray_init_kwargs", "ParallelismConfig.ray_master_port",
                    "ParallelismConfig.extra_parallel_modules")
def test_ray_address_and_worker_options_through_enable_cache(monkeypatch, tmp_path):
    """``ParallelismConfig(ulysses_size=2, use_ray=True, ray_address=<a cluster started by ray start in another
    process>, ray_worker_options={"num_cpus": 0.5}, extra_parallel_modules=[pipe.text_encoder_2, pipe.vae])`` with
    ``QuantizeConfig(svdq_int4_r8 PTQ, filter_fn=..., components_to_quantize={"transformer", "text_encoder": int8,
    "vae": int8, pipe.text_encoder: float8})``: the workers run on that 1-CPU cluster (two of them fit only because
    each asks for half a CPU: the options reach the actors and their bundles); the T5 runs tensor-parallel then int8
    and the VAE's decode row-split then int8 there (TE-P / VAE-P inside the workers, each component quantized where
    it runs), the CLIP (not an extra module: it runs here) is quantized here, ``calibrate_fn`` drives the pipeline
    while the workers calibrate the transformer they run, filter_fn picks its linears there, rank 0 writes the
    checkpoint; the decoded images equal the single process's (same quantize config, no parallelism), the CLIP's
    output is its, the T5's within int8's bound of its; disable_cache puts every original back, disconnects and
    leaves the cluster running (it is not ours to stop)."""
    if ray.is_initialized():
        pytest.skip("a Ray cluster from another test is still running in this process")
    import dit_passes as cache_dit
    user_module: dict = {}
    exec(USER_MODULE, user_module)  # its call_kwargs(): the tiny Flux pipeline's call

    # defined here, not at module level: cloudpickle sends them by value (the workers cannot import this file)
    def ff_down(module, name: str) -> bool:  # the reference's filter_fn(module, name): the K=128 FF down projections
        return name.endswith(("ff.net.2", "ff_context.net.2")) and module.in_features % 64 == 0

    def worker_report(w):  # runs on each Ray worker: what TE-P / VAE-P / PTQ did there
        te, vae, tr = w.extras[0], w.extras[1], w.compiled[0]
        quant = next(r for r in tr._current().manager.records if r.name == "svdquant_w4a4")
        return {"te_passes": [r.name for r in te._current().manager.records],
                "te_all_reduces": sum("all_reduce" in str(n.target) for n in te._current().gm.graph.nodes),
                "vae": [(k.split("[")[0], v["world_size"], v["rank"]) for k, v in vae.report().items()],
                "vae_int8": [sum(n.meta.get("dit_quant") == "int8_per_row" for n in gm.graph.nodes)
                             for gm in vae._graphs.values()],
                "passes": [p.name for p in tr.passes], "quantized": quant.result.counts["replaced"]}
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the cluster's mode; with an address the driver keeps its env's
    temp_dir = tempfile.mkdtemp(prefix="rayx", dir="/tmp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with socket.socket() as sock:  # the process group's store (ray_master_port)
        sock.bind(("127.0.0.1", 0))
        master_port = sock.getsockname()[1]
    starting = None
    try:
        starting = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
                                     "--node-ip-address=127.0.0.1", "--num-cpus=1", "--include-dashboard=false",
                                     f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=temp_dir)
        single = _te_pipeline()  # the reference, built and run while the cluster starts
        cache_dit.enable_cache(single, quantize_config=_ptq(single, user_module, tmp_path / "single", ff_down))
        reference = _decoded(single, user_module)
        ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
        te_single, clip_single = _encoded(single.text_encoder_2, ids), _encoded(single.text_encoder, ids)
        single_quantized = next(r for r in single.transformer._current().manager.records
                                if r.name == "svdquant_w4a4").result.counts["replaced"]
        log, _ = starting.communicate(timeout=120)
        assert starting.returncode == 0, log.decode(errors="replace")

        pipe = _te_pipeline()
        t5, vae, clip = pipe.text_encoder_2, pipe.vae, pipe.text_encoder
        te_ref, clip_ref = _encoded(t5, ids), _encoded(clip, ids)
        cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(
            ulysses_size=2, use_ray=True, ray_address=f"127.0.0.1:{port}", ray_worker_options={"num_cpus": 0.5},
            ray_init_kwargs={"include_dashboard": False, "namespace": "dp_parity"}, ray_master_port=master_port,
            extra_parallel_modules=[pipe.text_encoder_2, pipe.vae]),
            quantize_config=_ptq(pipe, user_module, tmp_path / "ray", ff_down), keep_original=True)
        try:
            assert (tmp_path / "ray" / "svdq_int4_r8.safetensors").exists()  # rank 0 wrote it before enable returned
            assert type(pipe.text_encoder_2).__name__ == type(pipe.vae).__name__ == "RayModuleProxy"
            images = _decoded(pipe, user_module)
            te_out, clip_out = _encoded(pipe.text_encoder_2, ids), _encoded(pipe.text_encoder, ids)
            clip_passes = [p.name for p in pipe.text_encoder.passes]  # a CompiledDiT here
            engine = pipe.transformer._engine
            seen = engine.run_on_workers(lambda w: (
                ray.get_runtime_context().get_assigned_resources().get("CPU"),
                ray.get_runtime_context().gcs_address.rsplit(":", 1)[1], ray.get_runtime_context().namespace,
                getattr(getattr(w, "_store", None), "port", None)))
            reports = engine.run_on_workers(worker_report)
        finally:
            cache_dit.disable_cache(pipe)
        # rank 0 hosts the store on ray_master_port; ray.init got ray_init_kwargs (the job's namespace)
        assert seen == [(0.5, str(port), "dp_parity", master_port), (0.5, str(port), "dp_parity", None)], seen
        torch.testing.assert_close(images, reference, rtol=0, atol=1e-5)
        assert clip_passes == ["fp8_linear"] and torch.equal(clip_out, clip_single)
        assert not torch.equal(clip_out, clip_ref)
        # TP splits the T5's output projections along K: their int8 rows are scaled per shard, not bit-equal
        assert 0 < ((te_out - te_single).abs().max() / te_single.abs().max()).item() < 0.05
        assert 0 < ((te_out - te_ref).abs().max() / te_ref.abs().max()).item() < 0.05
        expected = sum(ff_down(m, n) for n, m in single.transformer.original.named_modules()
                       if isinstance(m, torch.nn.Linear))
        for rank, r in enumerate(reports):
            assert [n for n in r["te_passes"] if n != "cleanup"] == ["tensor_parallel", "int8_linear"], r
            assert r["te_all_reduces"] == 4, r  # 2 layers x (attention, FF)
            assert r["vae"] == [("decode", 2, rank)], r  # the pipeline's one decode, split over the 2 ranks
            assert r["vae_int8"] == [4], r  # then its mid-block attention's linears in int8
            assert r["passes"] == ["ulysses", "svdquant_w4a4"], r
            assert r["quantized"] == single_quantized == expected > 0, (r, single_quantized, expected)
        assert pipe.text_encoder_2 is t5 and pipe.vae is vae and pipe.text_encoder is clip
        assert not ray.is_initialized(), "disable_cache must disconnect the driver it connected"
        assert session_processes(temp_dir), "the cluster the driver connected to must keep running"
    finally:
        if starting is not None and starting.poll() is None:
            starting.communicate(timeout=120)  # ray start returns once its daemons run: then they are stopped
        left = _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"Ray processes left behind: {left}"
