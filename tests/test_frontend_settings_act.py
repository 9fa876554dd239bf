"""Every field the cache-dit-compatible front end accepts acts as in cache-dit 1.5.3, warns that it changes nothing,
or is refused with a message naming it; a quantization that quantizes nothing says so.

References: cache-dit 1.5.3's own behaviour read from its source (which ``parallel_kwargs`` keys set which fields,
which backend names it takes, what ``per_tensor_fallback`` does under tensor parallelism), the eager model (a
pass that changed nothing leaves its output bit for bit), and the quantized graph's own nodes.
"""
from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.frontend import (DBCacheConfig, ParallelismConfig, QuantizeConfig, enable_cache, load, quantize,
                                 summary)

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402

from dit_passes.testing.pipelines import flux_pipeline  # noqa: E402

torch.set_num_threads(1)
TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16


def tiny_flux(heads: int = 2, head_dim: int = 16, seed: int = 0) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    axes = (4, 6, 6) if head_dim == 16 else (2, 2, 4)
    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=2, num_single_layers=2,
                                  attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=POOLED_DIM, guidance_embeds=True, axes_dims_rope=axes).eval()


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, IN_CH, generator=g),
                encoder_hidden_states=torch.randn(1, 7, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(1, POOLED_DIM, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(7, 3), guidance=torch.tensor([3.5]))


def call(module, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        out = module(**inputs(seed))
    return out[0] if isinstance(out, tuple) else out.sample


def quant_record(compiled):
    return next(r for r in compiled._current().manager.records if "replaced" in r.result.counts)


def caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(x.message) for x in w]


# ------------------------------------------------------------------------------- ParallelismConfig
@pytest.mark.parity("ParallelismConfig.parallel_kwargs")
def test_parallel_kwargs_set_the_fields_they_name_and_refuse_others():
    """cache-dit's _maybe_flatten_deprecated_parallel_kwargs: a key naming a field sets it (over the field), the
    experimental_ulysses_* keys set ulysses_*; the passes then carry them."""
    pc, msgs = caught(lambda: ParallelismConfig(ulysses_size=2, parallel_kwargs={"ulysses_float8": True}))
    assert pc.ulysses_float8 is True and any("parallel_kwargs is deprecated" in m for m in msgs)
    (ulysses,) = pc.to_passes()
    assert type(ulysses).__name__ == "Ulysses" and ulysses.ulysses_float8 is True
    pc, _ = caught(lambda: ParallelismConfig(ulysses_size=2, ring_size=2, ring_rotate_method="p2p", parallel_kwargs={
        "experimental_ulysses_async": True, "ring_rotate_method": "allgather"}))
    (usp,) = pc.to_passes()
    assert (usp.ulysses_async, usp.ring_rotate_method) == (True, "allgather")
    with pytest.raises(ValueError, match=r"parallel_kwargs: unknown key\(s\) \['ulysses_fp8'\].*'ulysses_float8'"):
        ParallelismConfig(ulysses_size=2, parallel_kwargs={"ulysses_fp8": True})


@pytest.mark.parity("ParallelismConfig.backend")
def test_parallelism_backend_names_are_cache_dits():
    cache_dit = pytest.importorskip("cache_dit")
    from cache_dit.distributed.backend import ParallelismBackend
    from dit_passes.frontend.configs import PARALLEL_BACKENDS
    for name in PARALLEL_BACKENDS:  # each name we take is one the reference takes
        ParallelismBackend.from_str(name)
    del cache_dit
    assert ParallelismConfig(ulysses_size=2, backend="Native_Diffuser").to_passes()
    assert ParallelismConfig(tp_size=2, backend=ParallelismBackend.NATIVE_PYTORCH).to_passes()
    with pytest.raises(ValueError, match="backend='nccl' is not a parallelism backend"):
        ParallelismConfig(ulysses_size=2, backend="nccl")
    with pytest.raises(ValueError, match="'native_pytorch' does not run Ulysses2: it needs backend='cache_dit'"):
        ParallelismConfig(ulysses_size=2, backend="native_pytorch")


@pytest.mark.parity("ParallelismConfig.extra_parallel_kwargs", "ParallelismConfig.cp_plan",
                    "ParallelismConfig.ring_convert_to_fp32", status="partial")
def test_parallel_fields_without_effect_warn():
    _, msgs = caught(lambda: ParallelismConfig(ulysses_size=2, extra_parallel_kwargs={"boogu_double_stream_cp": False}))
    assert any("extra_parallel_kwargs ['boogu_double_stream_cp']: no key has an effect" in m for m in msgs)
    _, msgs = caught(lambda: ParallelismConfig(ulysses_size=2, cp_plan={"": {}}))
    assert any("cp_plan is not used" in m for m in msgs)
    _, msgs = caught(lambda: ParallelismConfig(ring_size=2, ring_convert_to_fp32=False))
    assert any("ring_convert_to_fp32=False has no effect" in m for m in msgs)
    with pytest.raises(TypeError, match="ray_auto_shutdown must be a bool"):
        ParallelismConfig(use_ray=True, ray_auto_shutdown="no")


@pytest.mark.parity("ParallelismConfig.attention_backend", status="partial")
def test_attention_backend_pins_the_sdpa_kernel_or_is_refused():
    (tp, pin) = ParallelismConfig(tp_size=2, attention_backend="_native_math").to_passes()
    assert type(pin).__name__ == "AttentionBackend" and pin.backends == ["math"]  # no fallback: as diffusers' pin
    assert [type(p).__name__ for p in ParallelismConfig(tp_size=2, attention_backend="native").to_passes()] == [
        "TensorParallel"]
    (_, cudnn) = ParallelismConfig(tp_size=2, attention_backend="_sdpa_cudnn").to_passes()
    assert cudnn.backends == ["cudnn"]
    with pytest.raises(NotImplementedError, match=r"attention_backend='sage' is another package's.*'_native_math'"):
        ParallelismConfig(ulysses_size=2, attention_backend="sage")
    with pytest.raises(ValueError, match="attention_backend='flashy' is not an attention backend"):
        ParallelismConfig(ulysses_size=2, attention_backend="flashy")
    # the pinned kernel runs the same attention: the pass on one device equals the eager model
    tr = tiny_flux()
    assert torch.allclose(call(compile_dit(tr, passes=[pin])), call(tr), atol=1e-5)
    # applied with parallelism only (cache-dit refuses a config of sizes 1): said, not dropped
    pipe = flux_pipeline(tiny_flux())
    _, msgs = caught(lambda: enable_cache(pipe, cache_config=DBCacheConfig(), parallelism_config=ParallelismConfig(
        ulysses_size=1, attention_backend="_native_math")))
    assert any("attention_backend='_native_math' is applied with parallelism only" in m for m in msgs)


@pytest.mark.parity("ParallelismConfig.ray_auto_shutdown")
@pytest.mark.ray
def test_ray_auto_shutdown_leaves_ray_running():
    """cache-dit's engine stops the Ray it started on shutdown unless ray_auto_shutdown=False (the default, True,
    stopping it: tests/test_ray_launcher_owned.py); the front end hands the field to the launcher."""
    ray = pytest.importorskip("ray")
    from dit_passes.frontend import api
    from dit_passes.launch.ray_engine import RayEngine
    if ray.is_initialized():
        pytest.skip("a Ray of this process is already running")
    launcher = api._ray_launcher(ParallelismConfig(use_ray=True, ray_auto_shutdown=False))
    engine = RayEngine(launcher, "transformer")
    engine._init_ray()
    try:
        engine.shutdown()
        assert ray.is_initialized()
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------- QuantizeConfig
@pytest.mark.parity("QuantizeConfig.backend")
def test_quantize_backend_names_are_cache_dits():
    cache_dit = pytest.importorskip("cache_dit")
    from cache_dit.quantization.backend import QuantizeBackend
    from dit_passes.frontend.configs import QUANT_BACKENDS
    for name in QUANT_BACKENDS:  # each name we take is one the reference takes
        QuantizeBackend.from_str(name)
    assert QuantizeConfig(backend="AO").backend == "torchao"
    assert QuantizeConfig(quant_type="svdq_int4_r16_dq", backend="cache-dit").backend == "cache_dit"
    assert QuantizeConfig(backend=QuantizeBackend.TORCHAO).backend == "torchao"  # the reference's enum
    del cache_dit
    with pytest.raises(ValueError, match="backend='triton' is not a quantization backend"):
        QuantizeConfig(backend="triton")
    with pytest.raises(ValueError, match="backend='torchao' runs torchao's types; svdq_int4_r16_dq is SVDQuant"):
        QuantizeConfig(quant_type="svdq_int4_r16_dq", backend="torchao")
    with pytest.raises(ValueError, match="backend='cache_dit' runs SVDQuant.*float8_per_row is a torchao type"):
        QuantizeConfig(backend="cache_dit")


@pytest.mark.parity("QuantizeConfig.per_tensor_fallback", status="partial")
def test_per_tensor_fallback_under_tensor_parallelism():
    """cache-dit, float8_per_row after TP: the row-parallel linears take fp8 per tensor (per_tensor_fallback=True)
    or stay unquantized (False). Checked on the quantized graph (the passes for tp_size=2, on one device)."""
    with pytest.raises(ValueError, match="per_tensor_fallback=False with svdq_int4_r16_dq"):
        QuantizeConfig(quant_type="svdq_int4_r16_dq", per_tensor_fallback=False)
    tr = tiny_flux()
    rows = ("attn.to_out", "to_add_out", "ff.net.2", "ff_context.net.2", "proj_out")
    for fallback, row_kind in ((True, "fp8_per_tensor"), (False, None)):
        q = QuantizeConfig(per_tensor_fallback=fallback)
        assert q.to_passes(tr) != [] and len(q.to_passes(tr)) == 1  # no TP: the reference does nothing either
        compiled = compile_dit(tr, passes=q.to_passes(tr, tp_size=2), keep_original=True)
        call(compiled)
        kinds = {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in compiled.graph.nodes
                 if n.meta.get("dit_quant")}
        row = {p: k for p, k in kinds.items() if any(r in p for r in rows)}
        assert {k for p, k in kinds.items() if p not in row} == {"fp8_per_row"}
        if row_kind is None:
            assert row == {}
        else:
            assert row and set(row.values()) == {row_kind}


@pytest.mark.parity("QuantizeConfig.verbose")
def test_verbose_prints_each_linear(capsys):
    tr = tiny_flux()
    compiled = quantize(tr, QuantizeConfig(quant_type="int8_per_row", verbose=True), keep_original=True)
    call(compiled)
    out = capsys.readouterr().out
    assert "[dit_passes] int8_linear:" in out
    assert re.search(r"\n  transformer_blocks\.0\.attn\.to_q +int8_per_row\n", out)
    assert re.search(r"\n  transformer_blocks\.0\.norm1\.linear +left: excluded \(exclude= / exclude_layers\)\n", out)
    assert re.search(r"\n  x_embedder +left: outside the (repeated blocks|named block classes)\n", out)
    call(quantize(tiny_flux(), QuantizeConfig(quant_type="int8_per_row"), keep_original=True))
    assert capsys.readouterr().out == ""  # not verbose: nothing printed


@pytest.mark.parity("QuantizeConfig.svdq_kwargs", status="partial")
def test_svdq_tuning_keys_and_unused_fields_warn():
    _, msgs = caught(lambda: QuantizeConfig(quant_type="svdq_int4_r16_dq", svdq_kwargs={"streaming": True}))
    assert any("svdq_kwargs {'streaming': True} have no effect here" in m for m in msgs)
    _, msgs = caught(lambda: QuantizeConfig(quant_type="svdq_int4_r16_dq", svdq_kwargs={"few_shot_steps": 2}))
    assert any("['few_shot_steps'] have no effect with smooth_strategy='identity'" in m for m in msgs)
    _, msgs = caught(lambda: QuantizeConfig(calibrate_fn=lambda: None))
    assert any("calibrate_fn is used by SVDQuant PTQ only" in m for m in msgs)
    with pytest.raises(TypeError, match="verbose must be a bool"):
        QuantizeConfig(verbose="yes")


# ------------------------------------------------------------------------------- quantize / load / summary
@pytest.mark.parity("quantize", "load")
def test_quantize_and_load_take_cache_dits_signatures(tmp_path):
    """cache_dit.quantize(module, quantize_config=None, **kwargs), cache_dit.load(module, quantize_config_or_path)."""
    tr = tiny_flux(heads=4)  # inner dim 64: int4 groups of 64
    reference = call(quantize(tr, QuantizeConfig(quant_type="int8_per_row"), keep_original=True))
    assert torch.equal(call(quantize(tr, quantize_config=QuantizeConfig(quant_type="int8_per_row"),
                                     keep_original=True)), reference)
    legacy, msgs = caught(lambda: quantize(tr, quant_type="int8_per_row", keep_original=True))
    assert torch.equal(call(legacy), reference) and any("deprecated form" in m for m in msgs)
    _, msgs = caught(lambda: quantize(tr, QuantizeConfig(quant_type="int8_per_row"), quant_type="float8_per_row",
                                      keep_original=True))
    assert any("['quant_type'] are ignored since quantize_config is given" in m for m in msgs)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['quant_tpye'\]"):
        quantize(tr, quant_tpye="int8_per_row")
    config = QuantizeConfig(quant_type="svdq_int4_r8_dq", serialize_to=str(tmp_path))
    quantized = call(quantize(tr, quantize_config=config, keep_original=True))
    assert (tmp_path / "svdq_int4_r8_dq.safetensors").exists()
    assert torch.equal(call(load(tr, config)), quantized)
    with pytest.raises(ValueError, match="has no serialize_to"):
        load(tr, QuantizeConfig(quant_type="svdq_int4_r8_dq"))


def test_summary_details_logs_every_cached_step(caplog):
    pipe = flux_pipeline(tiny_flux())
    enable_cache(pipe, cache_config=DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1,
                                                  residual_diff_threshold=0.5))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pipe(prompt_embeds=torch.randn(1, 7, TEXT_DIM, generator=g), pooled_prompt_embeds=torch.randn(1, POOLED_DIM,
             generator=g), height=16, width=16, num_inference_steps=6, output_type="latent")
    with caplog.at_level(logging.INFO, logger="dit_passes"):
        (plain,) = summary(pipe)
        assert "Residual Diffs:" not in caplog.text
        (st,) = summary(pipe, details=True)
    assert st.cached_steps == plain.cached_steps and st.cached_steps  # the threshold cached some steps
    assert f"Cache Steps: {len(st.cached_steps)}, {st.cached_steps}" in caplog.text
    assert f"Residual Diffs: {len(st.residual_diffs)}, {st.residual_diffs}" in caplog.text


# ------------------------------------------------------------------------------- a quantization that changes nothing
def test_quantization_that_quantizes_nothing_says_why():
    """Layers narrower than the kind's group (int4: K % 64) or an exclude list that takes every linear: the model
    runs unchanged, and the warning, explain() and the counts say why."""
    tr = tiny_flux(heads=1, head_dim=8)  # every K is 8, 32 or 40: none a multiple of 64
    compiled = quantize(tr, QuantizeConfig(quant_type="svdq_int4_r4_dq"), keep_original=True)
    out, msgs = caught(lambda: call(compiled))
    assert torch.equal(out, call(tr))
    rec = quant_record(compiled)
    c = rec.result.counts
    assert not rec.result.changed and c["replaced"] == 0 and c["skipped_k"] > 0
    assert c["considered"] == sum(v for k, v in c.items() if k.startswith("skipped_"))
    assert any(m.startswith("svdquant_w4a4: svdq_int4_r4_dq: quantized no linear") and "K % 64 != 0" in m
               for m in msgs)
    assert "quantized no linear" in compiled.explain(print_output=False) and "K % 64 != 0" in rec.result.report
    compiled = quantize(tr, QuantizeConfig(quant_type="float8_per_row", exclude_layers=["transformer"]),
                        keep_original=True)
    out, msgs = caught(lambda: call(compiled))
    assert torch.equal(out, call(tr))
    c = quant_record(compiled).result.counts
    assert c["replaced"] == 0 and c["skipped_excluded"] > 0
    assert any("fp8_linear" in m and f"{c['skipped_excluded']} excluded (exclude= / exclude_layers)" in m
               for m in msgs)
    # a quantization that did quantize reports what it left, by reason, beside what it took
    compiled = quantize(tr, QuantizeConfig(quant_type="float8_per_row"), keep_original=True)
    _, msgs = caught(lambda: call(compiled))
    rec = quant_record(compiled)
    c = rec.result.counts
    assert rec.result.changed and c["replaced"] > 0 and not any("quantized no linear" in m for m in msgs)
    assert c["considered"] == c["replaced"] + sum(v for k, v in c.items() if k.startswith("skipped_"))
    assert "left unquantized:" in rec.result.report and "outside the" in rec.result.report


def _row_parallel_rank(rank, world):
    """TP on ``world`` ranks then float8_per_row (per_tensor_fallback=True, the default): each quantized linear's
    kind (False, the row-parallel linears left out, is the single-device test's filter alone)."""
    import dit_passes as cache_dit
    from dit_passes.models.zoo import build
    zm = build("flux")
    compiled = cache_dit.enable_cache(zm.model, parallelism_config=cache_dit.ParallelismConfig(tp_size=world),
                                      quantize_config=cache_dit.QuantizeConfig())
    with torch.no_grad():
        compiled(**zm.make_inputs())
    return {n.meta["dit_module_path"]: n.meta["dit_quant"] for n in compiled.graph.nodes if n.meta.get("dit_quant")}


@pytest.mark.multiproc
def test_per_tensor_fallback_on_tensor_parallel_ranks():
    """The quantize passes after the TP pass find its row-parallel linears (by role) and give them fp8 per tensor."""
    from dit_passes.testing import run_ranks
    rows = ("attn.to_out", "to_add_out", "ff.net.2", "ff_context.net.2", "proj_out")
    for rank, kinds in enumerate(run_ranks(_row_parallel_rank, 2, timeout=300)):
        row = {p: k for p, k in kinds.items() if any(r in p for r in rows)}
        assert row and set(row.values()) == {"fp8_per_tensor"}, rank
        assert {k for p, k in kinds.items() if p not in row} == {"fp8_per_row"}, rank
