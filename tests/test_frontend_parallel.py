"""The front end on gloo ranks: ``enable_cache(pipe, cache_config=..., parallelism_config=...)`` gives the
single-process images (decoded) and cached steps, and ``extra_parallel_modules`` parallelises the text
encoder (TE-P) and the VAE (VAE-P, the pipeline's own decode) on the same pipeline instance;
``disable_cache`` puts every original object back.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes.testing import run_ranks

STEPS = 6


def _pipeline():
    import transformers as T
    from dit_passes.models.zoo import build
    from dit_passes.testing.pipelines import flux_pipeline

    torch.manual_seed(1)
    t5 = T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                     dropout_rate=0.0)).eval()
    return flux_pipeline(build("flux", num_layers=2, num_single_layers=3).model, text_encoder_2=t5)


def _call(pipe):
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        return pipe(prompt_embeds=torch.randn(1, 7, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                    height=16, width=16, num_inference_steps=STEPS, guidance_scale=3.5, output_type="pt",
                    generator=torch.Generator().manual_seed(3)).images


def _rank_fn(rank, world):
    return {kind: _case(world, kind) for kind in ("ulysses", "tp")}


def _case(world, kind):
    import dit_passes as cache_dit
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.3, max_warmup_steps=2)
    single = _pipeline()
    cache_dit.enable_cache(single, cache_config=cache_dit.DBCacheConfig(**cfg))
    ref = _call(single)
    ref_cached = cache_dit.summary(single, logging=False)[0].cached_steps

    pipe = _pipeline()
    original_t5, original_transformer, original_vae = pipe.text_encoder_2, pipe.transformer, pipe.vae
    sizes = {"ulysses": dict(ulysses_size=world), "tp": dict(tp_size=world),
             "ulysses_x_tp": dict(ulysses_size=2, tp_size=world // 2)}[kind]
    pc = cache_dit.ParallelismConfig(extra_parallel_modules=[pipe.text_encoder_2, pipe.vae], **sizes)
    # keep_original: the originals run below (te_ref) and disable_cache restores them (TP would release them)
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(**cfg), parallelism_config=pc, keep_original=True)
    out = _call(pipe)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        te_ref = original_t5(input_ids=ids).last_hidden_state
        te_out = pipe.text_encoder_2(input_ids=ids).last_hidden_state
    te_passes = [r.name for r in pipe.text_encoder_2._current().manager.records]
    vae_report = pipe.vae.report()  # one decode graph, split over the ranks
    cached = cache_dit.summary(pipe, logging=False)[0].cached_steps
    passes = [p.name for p in pipe.transformer.runtime.state["frontend"].passes]
    cache_dit.disable_cache(pipe)
    return {"rel": ((out - ref).abs().max() / ref.abs().max()).item(), "cached": cached, "ref_cached": ref_cached,
            "te_rel": ((te_out - te_ref).abs().max() / te_ref.abs().max()).item(), "te_passes": te_passes, "passes": passes,
            "vae_graphs": len(vae_report), "vae_world": [v["world_size"] for v in vae_report.values()],
            "restored": (pipe.text_encoder_2 is original_t5 and pipe.transformer is original_transformer
                         and pipe.vae is original_vae)}


@pytest.mark.parity("ParallelismConfig", "ParallelismConfig.ulysses_size", "ParallelismConfig.tp_size",
                    "ParallelismConfig.extra_parallel_modules")
@pytest.mark.multiproc
def test_enable_cache_parallel_with_text_encoder_parallelism():
    results = run_ranks(_rank_fn, 2, timeout=300)
    cases = [(f"{kind} rank {rank}", r) for rank, res in enumerate(results) for kind, r in res.items()]
    assert len(cases) == 4
    for where, r in cases:
        assert r["rel"] <= 1e-5, f"{where}: latents differ from the single process by {r['rel']:.2e}"
        assert r["cached"] == r["ref_cached"] and r["cached"], f"{where}: {r['cached']} vs {r['ref_cached']}"
        assert r["te_rel"] <= 1e-5 and "tensor_parallel" in r["te_passes"], f"{where}: {r}"
        assert r["vae_graphs"] == 1 and r["vae_world"] == [2], f"{where}: the pipeline's decode did not run split: {r}"
        assert r["restored"], f"{where}: disable_cache did not restore the original modules"


def _quantized_te_rank_fn(rank, world):
    """A text encoder both in extra_parallel_modules and in components_to_quantize: TP, then its linears in int8."""
    import dit_passes as cache_dit
    from torch.distributed.tensor.debug import CommDebugMode

    pipe = _pipeline()
    t5 = pipe.text_encoder_2
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    cache_dit.enable_cache(pipe, parallelism_config=cache_dit.ParallelismConfig(tp_size=world,
                                                                               extra_parallel_modules=[t5]),
                           quantize_config=cache_dit.QuantizeConfig(quant_type="int8_per_row",
                                                                    components_to_quantize=["text_encoder"]),
                           keep_original=True)
    comm = CommDebugMode()
    with torch.no_grad():
        want = t5(input_ids=ids).last_hidden_state
        pipe.text_encoder_2(input_ids=ids)  # captured and lowered outside the counting mode
        with comm:
            got = pipe.text_encoder_2(input_ids=ids).last_hidden_state
    te = pipe.text_encoder_2
    quantized = sorted({n.meta["dit_module_path"] for n in te.graph_module.graph.nodes if n.meta.get("dit_quant")})
    out = {"rel": ((got - want).abs().max() / want.abs().max()).item(), "passes": [r.name for r in te._current().manager.records],
           "quantized": quantized, "linears": sorted(p for p, m in t5.named_modules() if isinstance(m, torch.nn.Linear)),
           "all_reduce": sum(v for k, v in comm.get_comm_counts().items() if "all_reduce" in str(k)),
           "transformer_quant": pipe.transformer.runtime.state["frontend"].quantize_config}
    cache_dit.disable_cache(pipe)
    out["restored"] = pipe.text_encoder_2 is t5
    return out


@pytest.mark.multiproc
def test_text_encoder_parallel_and_quantized():
    for rank, r in enumerate(run_ranks(_quantized_te_rank_fn, 2, timeout=300)):
        where = f"rank {rank}: {r}"
        assert r["passes"][-2:] == ["tensor_parallel", "int8_linear"], where  # after the cleanup
        assert r["quantized"] == r["linears"] and r["transformer_quant"] is None, where  # only the listed component
        assert r["all_reduce"] == 4, where  # one per row-parallel linear (attention out, MLP out) of the 2 layers
        assert 0 < r["rel"] < 0.05 and r["restored"], where
