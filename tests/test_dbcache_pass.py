"""The DBCache graph pass, side by side with cache-dit 1.5.3 on real diffusers transformers.

The reference is cache-dit's own ``enable_cache`` on a copy of the same transformer: in transformer-only
mode (``num_inference_steps`` set, state refreshed by its step counter) for step loops, and on a real
FluxPipeline for pipeline runs. Both see identical inputs; we assert the same cached steps, the same
recorded diffs, and outputs within 1e-4 relative (fp32).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.cache.config import TaylorSeerCalibratorConfig
from dit_passes.infra.pass_base import PassError
from dit_passes.models.zoo import build

cache_dit = pytest.importorskip("cache_dit")
from cache_dit import steps_mask as ref_steps_mask  # noqa: E402

logging.getLogger("cache_dit").setLevel(logging.ERROR)
torch.set_num_threads(1)  # CI: 2 xdist workers and the rank tests share 2 cores; a second thread only spins
STEPS = 10

# family -> config overrides giving 2 + 2 (flux) or 4 blocks, so Bn > 0 leaves a middle to cache
FAMILIES = {"flux": {}, "wan": dict(num_layers=4), "qwenimage": dict(num_layers=4)}
CONFIGS = {
    "F1B0": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.45, max_warmup_steps=2),
    "F1B1_interval2": dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.45,
                           max_warmup_steps=4, warmup_interval=2),
    "max_continuous": dict(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=2,
                           max_continuous_cached_steps=2),
    "scm_static": dict(Fn_compute_blocks=1, steps_computation_mask=ref_steps_mask(total_steps=STEPS, mask_policy="fast"),
                       steps_computation_policy="static"),
    "scm_dynamic": dict(Fn_compute_blocks=2, residual_diff_threshold=0.6,
                        steps_computation_mask=ref_steps_mask(total_steps=STEPS, mask_policy="medium"),
                        steps_computation_policy="dynamic"),
}


def step_loop(model, kwargs, steps=STEPS, calls_per_step=1, after_call=None):
    """A plain Euler-like loop: the timestep falls, the latents move with the model's output. ``after_call()``
    runs after each transformer call (to read per-call records)."""
    outs, lat = [], kwargs["hidden_states"].clone()
    for i in range(steps):
        kw = dict(kwargs, hidden_states=lat, timestep=torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / steps)))
        for _ in range(calls_per_step):
            with torch.no_grad():
                o = model(**kw)[0]
            outs.append(o)
            if after_call is not None:
                after_call()
        lat = lat - 0.05 * o.reshape(lat.shape)
    return torch.stack(outs)


def reference_run(model, kwargs, cfg, calibrator=None, calls_per_step=1):
    ref = copy.deepcopy(model)
    extra = {} if calibrator is None else dict(calibrator_config=cache_dit.TaylorSeerCalibratorConfig(**calibrator))
    cache_dit.enable_cache(ref, cache_config=cache_dit.DBCacheConfig(num_inference_steps=STEPS * calls_per_step // (
        2 if cfg.get("enable_separate_cfg") else 1), **cfg), **extra)
    out = step_loop(ref, kwargs, calls_per_step=calls_per_step)
    return out, cache_dit.summary(ref)[0]


def ours_run(model, kwargs, cfg, calibrator=None, calls_per_step=1):
    cal = None if calibrator is None else TaylorSeerCalibratorConfig(**calibrator)
    compiled = compile_dit(model, passes=[passes.DBCache(calibrator=cal, **cfg)])
    out = step_loop(compiled, kwargs, calls_per_step=calls_per_step)
    return out, compiled.runtime.state["dbcache"].summary()[-1], compiled


def assert_same(ref, ours, rel=1e-4):
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= rel, f"outputs differ: max relative {err:.3g} > {rel}"


# every config on Flux (dual + single stream lists as one range), a spread on the others
CASES = [("flux", n) for n in CONFIGS] + [("wan", "F1B1_interval2"), ("wan", "scm_dynamic"),
                                           ("qwenimage", "F1B0"), ("qwenimage", "max_continuous")]


@pytest.mark.parity("DBCacheConfig.Fn_compute_blocks", "DBCacheConfig.Bn_compute_blocks")
@pytest.mark.reference
@pytest.mark.parametrize("family, name", CASES)
def test_step_loop_matches_cache_dit(family, name):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    cfg = dict(CONFIGS[name], enable_separate_cfg=False)
    ref, ref_stats = reference_run(zm.model, kwargs, cfg)
    ours, stats, _ = ours_run(zm.model, kwargs, cfg)
    assert stats["cached_steps"] == ref_stats.cached_steps
    assert stats["residual_diffs"] == pytest.approx(dict(ref_stats.residual_diffs), rel=1e-5)
    assert len(stats["cached_steps"]) >= 2, f"config {name} cached too little to test anything: {stats}"
    assert_same(ref, ours)


@pytest.mark.reference
@pytest.mark.parametrize("order", [1, 2])
def test_taylorseer_matches_cache_dit(order):
    zm = build("flux")
    kwargs = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=3, max_continuous_cached_steps=2,
               enable_separate_cfg=False)
    cal = dict(taylorseer_order=order)
    ref, ref_stats = reference_run(zm.model, kwargs, cfg, cal)
    ours, stats, _ = ours_run(zm.model, kwargs, cfg, cal)
    assert stats["cached_steps"] == ref_stats.cached_steps
    assert_same(ref, ours)


@pytest.mark.reference
def test_separate_cfg_by_call_parity_matches_cache_dit():
    """Two calls per step (cond, uncond) without named contexts: each parity keeps its own state."""
    zm = build("wan", num_layers=3)
    kwargs = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.45, max_warmup_steps=2, enable_separate_cfg=True)
    ref, ref_stats = reference_run(zm.model, kwargs, cfg, calls_per_step=2)
    ours, stats, _ = ours_run(zm.model, kwargs, cfg, calls_per_step=2)
    assert stats["cached_steps"] == ref_stats.cached_steps
    assert stats["cfg_cached_steps"] == ref_stats.cfg_cached_steps
    assert stats["cached_steps"], "nothing cached: the test would not tell separate states apart"
    assert_same(ref, ours)


# -- through a real FluxPipeline ----------------------------------------------------------------------------
def _pipeline_parts():
    from test_compiled_pipeline import TEXT_DIM, POOLED_DIM, IN_CH, tiny_pipe
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=3, num_single_layers=3,
                                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                pooled_projection_dim=POOLED_DIM, guidance_embeds=True,
                                axes_dims_rope=(4, 6, 6)).eval()
    return tr, tiny_pipe


@pytest.mark.reference
@pytest.mark.parametrize("true_cfg", [False, True])
def test_flux_pipeline_matches_cache_dit_over_two_generations(true_cfg):
    """Pipeline mode: two generations in a row; ours detects the second one from the timestep rising."""
    from test_compiled_pipeline import run_pipeline
    tr, tiny_pipe = _pipeline_parts()
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.3, max_warmup_steps=2,
               enable_separate_cfg=true_cfg)
    ref_pipe = tiny_pipe(copy.deepcopy(tr))
    cache_dit.enable_cache(ref_pipe, cache_config=cache_dit.DBCacheConfig(**cfg))
    ref = [run_pipeline(ref_pipe, cfg=true_cfg, steps=STEPS) for _ in range(2)]
    ref_stats = cache_dit.summary(ref_pipe)[0]
    pipe = tiny_pipe(tr)
    pipe.transformer = compile_dit(tr, passes=[passes.DBCache(**cfg)])
    ours = [run_pipeline(pipe, cfg=true_cfg, steps=STEPS) for _ in range(2)]
    summary = pipe.transformer.cache_summary(as_dict=True)
    assert len(summary) == 2, "the second pipeline call must start a new generation"
    for gen in summary:
        assert gen["cached_steps"] == ref_stats.cached_steps
        if true_cfg:
            assert gen["cfg_cached_steps"] == ref_stats.cfg_cached_steps
    assert summary[0]["cached_steps"], "nothing cached"
    for r, o in zip(ref, ours):
        assert_same(r, o)
    torch.testing.assert_close(ours[0], ours[1], rtol=0, atol=0)  # the state really reset


def test_explicit_new_generation_and_instances_do_not_share_state():
    zm = build("flux")
    kwargs = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.45, max_warmup_steps=2)
    a = compile_dit(zm.model, passes=[passes.DBCache(**cfg)])
    b = compile_dit(zm.model, passes=[passes.DBCache(**cfg)])
    first = step_loop(a, kwargs, steps=5)
    # b interleaved with a must not disturb a, and a second run of a after new_generation() repeats itself
    step_loop(b, kwargs, steps=3)
    a.new_generation()
    kw = dict(kwargs, timestep=torch.full_like(kwargs["timestep"], 1.0))  # timestep falls: no auto reset
    with torch.no_grad():
        a(**kw)
    a.new_generation()
    again = step_loop(a, kwargs, steps=5)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert a.runtime.state["dbcache"] is not b.runtime.state["dbcache"]
    gens = [g["generation"] for g in a.cache_summary(as_dict=True)]
    assert gens == [0, 1, 2]


def test_graph_shows_the_branch_and_compiles_fullgraph():
    zm = build("flux")
    kwargs = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.45, max_warmup_steps=2)
    eager = compile_dit(zm.model, passes=[passes.DBCache(**cfg)])
    ref = step_loop(eager, kwargs, steps=6)
    code = eager.code
    assert "torch.ops.higher_order.cond(" in code and "dbcache_decide" in code and "dbcache_commit" in code
    assert "class dbcache_compute" in code and "class dbcache_cached" in code
    assert "use_cache: \"b8[]\" = dbcache_decide[0]" in code
    assert ".item()" not in code
    assert eager.explain(print_output=False).count("dbcache") >= 1

    # the whole step, cache branch included, as one torch.compile graph (fullgraph=True: no graph break)
    fresh = compile_dit(zm.model, passes=[passes.DBCache(**cfg)], torch_compile={"backend": "eager"})
    out = step_loop(fresh, kwargs, steps=6)
    assert fresh._current().runner is not None and fresh._current().runner is not fresh.graph_module
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert fresh.cache_summary(as_dict=True)[-1]["cached_steps"] == eager.cache_summary(as_dict=True)[-1]["cached_steps"]


@pytest.mark.parametrize("make", [lambda: passes.DBCache(Fn_compute_blocks=2, residual_diff_threshold=0.45,
                                                          max_warmup_steps=2),
                                  lambda: passes.DBPrune(Fn_compute_blocks=1, Bn_compute_blocks=0,
                                                         residual_diff_threshold=0.45, max_warmup_steps=2)],
                         ids=["dbcache_cut_after_a_single_block", "dbprune_single_blocks"])
def test_cuts_after_single_stream_blocks_compile(make):
    """FLUX's single blocks end by splitting the joint sequence into two views of one tensor: a cond entered there
    gets them as operands (torch.compile refuses operands that alias) and returns the text view, whose size-1 batch
    stride differs from the cached arm's fresh tensor (the arms must agree on every stride). Both compile now.
    One double-stream block (the compile's cost grows with depth): Fn_compute_blocks=2 cuts after the first single
    block, as 3 does after two double blocks."""
    zm = build("flux", num_layers=1)
    kwargs = zm.make_inputs()
    ref = step_loop(compile_dit(zm.model, passes=[make()]), kwargs, steps=6)
    fresh = compile_dit(zm.model, passes=[make()], torch_compile={"backend": "aot_eager", "fullgraph": True})
    torch.testing.assert_close(step_loop(fresh, kwargs, steps=6), ref, rtol=1e-5, atol=1e-6)
    summary = fresh.cache_summary(as_dict=True)[-1]
    assert summary["cached_steps"], summary


def test_cache_summary_string_and_tag():
    zm = build("flux")
    compiled = compile_dit(zm.model, passes=[passes.DBCache(Fn_compute_blocks=1, residual_diff_threshold=0.45,
                                                            max_warmup_steps=2)])
    step_loop(compiled, zm.make_inputs(), steps=6)
    text = compiled.cache_summary()
    assert "cached steps" in text and "Diffs P50" in text
    assert "DBCache_F1B0_W2I1M0MC0_R0.45" in compiled.explain(print_output=False)


def test_bad_input():
    zm = build("flux")
    kwargs = zm.make_inputs()
    with pytest.raises(PassError, match=r"Fn_compute_blocks \+ Bn_compute_blocks = 3 \+ 1 must be smaller"):
        compile_dit(zm.model, passes=[passes.DBCache(Fn_compute_blocks=3, Bn_compute_blocks=1)], example_inputs=kwargs)
    with pytest.raises(ValueError, match="Fn_compute_blocks"):
        passes.DBCache(Fn_compute_blocks=-1)
    with pytest.raises((ValueError, TypeError), match="steps_computation_mask"):
        passes.DBCache(steps_computation_mask=[1, 0, 2])
    with pytest.raises(TypeError, match="config=DBCacheConfig"):
        from dit_passes.cache.config import DBCacheConfig
        passes.DBCache(DBCacheConfig(), Fn_compute_blocks=2)
    with pytest.raises(ValueError, match="steps_computation_mask has 5 entries but num_inference_steps=8"):
        passes.DBCache(steps_computation_mask=[1] * 5, num_inference_steps=8)


def test_a_config_that_caches_nothing_says_so():
    import warnings
    zm = build("flux")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile_dit(zm.model, passes=[passes.DBCache(Fn_compute_blocks=1, max_cached_steps=0)],
                               example_inputs=zm.make_inputs())
    assert any("dbcache: no step can be cached: max_cached_steps=0" in str(w.message) for w in caught)
    assert "no step can be cached" in compiled.explain(print_output=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_dit(zm.model, passes=[passes.DBCache(Fn_compute_blocks=1)], example_inputs=zm.make_inputs())
    assert not any("no step can be cached" in str(w.message) for w in caught)
