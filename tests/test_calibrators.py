"""cache-dit 1.5.3's FoCa and DMD calibrators beside TaylorSeer, side by side with the reference.

First on synthetic calls through cache-dit's own context manager (the harness of ``test_cache_decision``: the
decision and the calibrator exactly as its block forward drives them), then as the DBCache graph pass on a tiny
Flux, and through ``enable_cache(calibrator_config=...)`` on a real pipeline.
"""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.cache.config import DMDCalibratorConfig, FoCaCalibratorConfig
from dit_passes.cache.decision import apply_hit, decide, hit_values, middle_cache_values, update_after_branch
from dit_passes.cache.state import CacheContexts
from dit_passes.models.zoo import build

cache_dit = pytest.importorskip("cache_dit")
from test_cache_decision import Ours, Reference, make_calls, timesteps  # noqa: E402
from test_dbcache_pass import step_loop  # noqa: E402

logging.getLogger("cache_dit").setLevel(logging.ERROR)


class ReferenceWith(Reference):
    """The reference manager with any of its calibrator configs."""

    def __init__(self, cfg: dict, calibrator):
        super().__init__(cfg)
        self.kw["calibrator_config"] = calibrator


class OursWith(Ours):
    """Our decision with a calibrator; the branch's values are the hits on a cached step (as the graph's)."""

    def __init__(self, cfg: dict, calibrator):
        super().__init__(cfg)
        self.ts = calibrator
        self.ctxs = CacheContexts(self.cfg, calibrator)

    def step(self, state, r, t, h, e, mid, mid_e, partner=None):
        use, new, diff = decide(state, r, t, self.cfg, partner=partner)
        hits = hit_values(new, 2, self.ts)
        computed = [h + mid, e + mid_e]
        outs = [torch.where(use, a, b) for a, b in zip(apply_hit([h, e], hits, self.ts), computed)]
        values = [torch.where(use, a, b) for a, b in zip(hits, middle_cache_values([h, e], computed, self.ts))]
        return use, update_after_branch(new, use, values, self.ts), diff, outs[0], outs[1]


def side_by_side(cfg, ref_cal, our_cal, n=20, gens=2):
    ref, ours = ReferenceWith(cfg, ref_cal), OursWith(cfg, our_cal)
    decisions = []
    for gen in range(gens):
        ref.new_generation()
        seq = []
        for i, c in enumerate(make_calls(n, 3 + 11 * gen)):
            hit, h, e, _ = ref.call(c)
            use, h2, e2, _, _ = ours.call(c, timesteps(n)[i])
            assert bool(use) == hit, f"gen {gen} call {i}: ours {bool(use)} vs cache-dit {hit} ({seq})"
            torch.testing.assert_close(h2, h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(e2, e, rtol=1e-5, atol=1e-5)
            seq.append(hit)
        decisions.append(seq)
    return decisions


def runs_of_cached(seq):
    """The lengths of the runs of cached calls."""
    out, n = [], 0
    for s in seq + [False]:
        if s:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out


@pytest.mark.parity("FoCaCalibratorConfig", "CalibratorConfig.enable_calibrator")
@pytest.mark.parametrize("variant", ["residual", "hidden_states", "image_only", "encoder_only"])
def test_foca_matches_cache_dit(variant):
    kw = {"hidden_states": dict(calibrator_cache_type="hidden_states"),
          "image_only": dict(enable_encoder_calibrator=False),
          "encoder_only": dict(enable_calibrator=False)}.get(variant, {})
    # runs of up to 5 cached steps: the Heun step (elapsed <= 3) and the damped one beyond it
    cfg = dict(max_warmup_steps=4, residual_diff_threshold=0.6, max_continuous_cached_steps=5)
    gens = side_by_side(cfg, cache_dit.FoCaCalibratorConfig(**kw), FoCaCalibratorConfig(**kw))
    assert max(runs_of_cached(gens[0])) >= 4, gens[0]


@pytest.mark.parity("DMDCalibratorConfig", "DMDCalibratorConfig.dmd_history", "DMDCalibratorConfig.dmd_rank",
                    "DMDCalibratorConfig.dmd_svd_precision", "DMDCalibratorConfig.dmd_ridge")
@pytest.mark.parametrize("variant", ["default", "history4_rank2", "low_image_only"])
def test_dmd_matches_cache_dit(variant):
    # calibrator_kwargs under a field's key: the field wins, as the reference's to_kwargs
    kw = {"history4_rank2": dict(dmd_history=4, dmd_rank=2, calibrator_kwargs={"history": 9, "n_derivatives": 1}),
          "low_image_only": dict(dmd_history=5, dmd_svd_precision="low", enable_encoder_calibrator=False,
                                 dmd_ridge=1e-2)
          }.get(variant, {})
    # warm-up 5 computed steps (a uniform tail of 5: the DMD forecast), then computed steps at uneven spacings (tails of
    # 2-3: the Taylor fallback) and evenly spaced again (the forecast on a longer spacing)
    cfg = dict(max_warmup_steps=5, residual_diff_threshold=0.6, max_continuous_cached_steps=3)
    # every (tail length, rank) form is evaluated on each call (fixed shapes): one generation where that is costly
    gens = side_by_side(cfg, cache_dit.DMDCalibratorConfig(**kw), DMDCalibratorConfig(**kw),
                        gens=2 if variant == "history4_rank2" else 1)
    assert max(runs_of_cached(gens[0])) >= 2, gens[0]


@pytest.mark.parity("CalibratorConfig", "CalibratorConfig.calibrator_kwargs", status="partial")
def test_base_calibrator_config_and_kwargs():
    """cache-dit's base ``CalibratorConfig`` (its calibrator_type picks the calibrator) converts to ours and decides
    and predicts as the reference's; ``calibrator_kwargs`` keys act as there or are refused, naming the key (partial:
    our own base class is abstract, and keys whose effect differs are refused)."""
    from dit_passes.cache.config import CalibratorConfig, TaylorSeerCalibratorConfig
    from dit_passes.frontend.cache_configs import resolve_calibrator
    theirs = cache_dit.CalibratorConfig(enable_calibrator=True, enable_encoder_calibrator=True,
                                        calibrator_kwargs={"max_warmup_steps": 1, "n_derivatives": 3})
    ours = resolve_calibrator(theirs)
    # the base class's to_kwargs hands n_derivatives to the calibrator as it is: the order
    assert isinstance(ours, TaylorSeerCalibratorConfig) and ours.taylorseer_order == 3
    cfg = dict(max_warmup_steps=3, residual_diff_threshold=0.6, max_continuous_cached_steps=3)
    assert any(side_by_side(cfg, theirs, ours, gens=1)[0])
    with pytest.raises(ValueError, match="calibrator_type='magic' is not one of"):
        resolve_calibrator(cache_dit.CalibratorConfig(calibrator_type="magic"))
    with pytest.raises(ValueError, match="use a subclass|one class per calibrator"):
        CalibratorConfig()
    with pytest.raises(ValueError, match=r"calibrator_kwargs\['n_derivatives'\]=2: only 1 is taken \(the forecast's "
                                         r"fallback"):
        DMDCalibratorConfig(calibrator_kwargs={"n_derivatives": 2})
    with pytest.raises(ValueError, match=r"calibrator_kwargs\['skip_interval_steps'\]=3: only 1 is taken \(it feeds"):
        TaylorSeerCalibratorConfig(calibrator_kwargs={"skip_interval_steps": 3})
    with pytest.raises(ValueError, match=r"calibrator_kwargs\['alpha'\]: not a setting of this calibrator"):
        FoCaCalibratorConfig(calibrator_kwargs={"alpha": 0.5})


def test_dmd_forecast_is_exact_on_exponential_modes():
    """The defining property: values that are sums of (damped / oscillating) exponentials of the step are forecast
    exactly, where the first-order Taylor fallback is not."""
    from dit_passes.cache.dmd import dmd_after_call, dmd_keys, dmd_predict, dmd_spec

    g = torch.Generator().manual_seed(0)
    modes = torch.randn(3, 1, 24, dtype=torch.float64, generator=g)
    rho, theta = 0.9, 0.4

    def value(k):  # one real decaying mode and one damped oscillation
        return modes[0] * 0.8 ** k + rho ** k * (modes[1] * math.cos(theta * k) + modes[2] * math.sin(theta * k))

    state = {k: torch.full(shape, fill, dtype=dt) for k, (shape, dt, fill) in dmd_spec(0, value(0), 6).items()}
    last = torch.tensor(-1)
    for k in range(6):
        step = torch.tensor(k)
        state.update(dmd_after_call(state, 0, torch.tensor(False), value(k), step, last))
        last = step
    for ahead in (6, 7, 9):
        pred = dmd_predict(state, 0, torch.tensor(ahead), last)
        torch.testing.assert_close(pred, value(ahead), rtol=1e-6, atol=1e-7)  # the ridge: 1e-8 of S
    f = dict(zip(("cur0", "cur1"), (state[k] for k in dmd_keys(0)[2:4])))
    taylor = f["cur0"] + f["cur1"] * 4
    assert (taylor - value(9)).abs().max() > 1e3 * (dmd_predict(state, 0, torch.tensor(9), last) - value(9)).abs().max()


# -- the graph pass and the front end -------------------------------------------------------------------------
STEPS = 10


def against_cache_dit(max_warmup_steps, ref_calibrator, compile_ours):
    """A tiny Flux over STEPS calls: ``(compiled, ours, ref, cache-dit's cached steps, plain DBCache's outputs)``,
    cache-dit with ``ref_calibrator`` beside ``compile_ours(model, cfg)``; always cached after the warm-up but for
    every fifth step (runs of 4)."""
    zm = build("flux")
    kwargs = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=max_warmup_steps,
               max_continuous_cached_steps=4, enable_separate_cfg=False, num_inference_steps=STEPS)
    ref_model = copy.deepcopy(zm.model)
    cache_dit.enable_cache(ref_model, cache_config=cache_dit.DBCacheConfig(**cfg), calibrator_config=ref_calibrator)
    ref = step_loop(ref_model, kwargs)
    ref_cached = cache_dit.summary(ref_model, logging=False)[0].cached_steps
    compiled = compile_ours(zm.model, cfg)
    ours = step_loop(compiled, kwargs)
    plain = step_loop(compile_dit(zm.model, passes=[passes.DBCache(**cfg)]), kwargs)
    return compiled, ours, ref, ref_cached, plain


@pytest.mark.reference
def test_foca_dbcache_pass_matches_cache_dit():
    compiled, ours, ref, ref_cached, plain = against_cache_dit(3, cache_dit.FoCaCalibratorConfig(), lambda m, cfg: (
        compile_dit(m, passes=[passes.DBCache(calibrator=FoCaCalibratorConfig(), **cfg)])))
    # warm-up 3, then always cached but for every fifth step: runs of 4 (elapsed up to 4: both FoCa forms)
    assert compiled.runtime.state["dbcache"].summary()[-1]["cached_steps"] == ref_cached == [3, 4, 5, 6, 8, 9]
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, err
    assert (plain - ref).abs().max() > 100 * (ours - ref).abs().max(), "FoCa made no difference: nothing tested"


@pytest.mark.parity("CalibratorConfig.calibrator_type")
@pytest.mark.reference
def test_dmd_dbcache_pass_and_enable_cache_match_cache_dit():
    """DMD as the graph pass (through ``enable_cache`` on the transformer, cache-dit's config class converted): the
    same cached steps and outputs as cache-dit on a tiny Flux; its tags as the reference's."""
    import dit_passes
    # warm-up 5 (a uniform tail of 5 snapshots), then a run of 4 cached steps: the forecast at horizons 1-4
    theirs = cache_dit.DMDCalibratorConfig(dmd_history=5)
    compiled, ours, ref, ref_cached, plain = against_cache_dit(5, theirs, lambda m, cfg: dit_passes.enable_cache(
        m, cache_config=dit_passes.DBCacheConfig(**cfg), calibrator_config=theirs))
    assert isinstance(compiled.runtime.state["frontend"].calibrator_config, DMDCalibratorConfig)
    assert compiled.runtime.state["dbcache"].summary()[-1]["cached_steps"] == ref_cached == [5, 6, 7, 8]
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, err
    assert (plain - ref).abs().max() > 100 * (ours - ref).abs().max(), "DMD made no difference: nothing tested"
    for precision in ("low", "medium", "high"):
        kw = dict(dmd_history=5, dmd_svd_precision=precision)
        theirs = cache_dit.DMDCalibratorConfig(**kw)
        assert DMDCalibratorConfig(**kw).strify() == theirs.strify() and DMDCalibratorConfig(**kw).strify(
            details=True) == theirs.strify(details=True)


@pytest.mark.parity("DMDCalibratorConfig")
@pytest.mark.reference
def test_dmd_short_warmup_pipeline_matches_cache_dit():
    """DMD after a warm-up of 3 on a FluxPipeline (Fn=2, Bn=0, threshold 0.4, 12 steps): the first cached steps follow
    the computed steps 0-2, where the Taylor fallback applies. cache-dit's calibrator counts one step behind the
    context, so step 2 forms no difference there and the first cached steps reuse step 2's value; a difference formed
    at step 2 extrapolates instead (further from cache-dit than cache-dit is from the uncached run)."""
    import dit_passes
    from dit_passes.testing.pipelines import flux_pipeline

    def generate(pipe):
        g = torch.Generator().manual_seed(0)
        c = pipe.transformer.config
        with torch.inference_mode():
            return pipe(prompt_embeds=torch.randn(1, 7, c.joint_attention_dim, generator=g),
                        pooled_prompt_embeds=torch.randn(1, c.pooled_projection_dim, generator=g), height=16,
                        width=16, num_inference_steps=12, guidance_scale=3.5, output_type="latent",
                        generator=torch.Generator().manual_seed(3)).images

    cfg = dict(Fn_compute_blocks=2, Bn_compute_blocks=0, residual_diff_threshold=0.4, max_warmup_steps=3)
    model = build("flux").model
    ref_pipe = flux_pipeline(copy.deepcopy(model))
    cache_dit.enable_cache(ref_pipe, cache_config=cache_dit.DBCacheConfig(**cfg),
                           calibrator_config=cache_dit.DMDCalibratorConfig())
    ref = generate(ref_pipe)
    ref_cached = cache_dit.summary(ref_pipe, logging=False)[0].cached_steps
    pipe = flux_pipeline(model)
    dit_passes.enable_cache(pipe, cache_config=dit_passes.DBCacheConfig(**cfg),
                            calibrator_config=dit_passes.DMDCalibratorConfig())
    ours = generate(pipe)
    cached = dit_passes.summary(pipe, logging=False)[0].cached_steps
    assert cached == ref_cached and cached[0] == 3, (cached, ref_cached)  # cached right after the warm-up
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-4, err


def test_the_prediction_runs_on_cached_steps_only():
    """The calibrator's prediction is formed in the cached arm of the ``torch.cond``: DMD's SVDs run on the cached
    steps and on none of the computed ones (before the branch, every call paid for them)."""
    from dit_passes.testing.counting import OpCounter
    zm = build("flux")
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=5, max_continuous_cached_steps=4,
               enable_separate_cfg=False, num_inference_steps=STEPS)
    compiled = compile_dit(zm.model, passes=[passes.DBCache(calibrator=DMDCalibratorConfig(dmd_history=5), **cfg)])
    totals = []
    with OpCounter(["svd"]) as counter:
        step_loop(compiled, zm.make_inputs(), after_call=lambda: totals.append(counter.counts["svd"]))
    per_call = [b - a for a, b in zip([0] + totals, totals)]
    cached = compiled.runtime.state["dbcache"].summary()[-1]["cached_steps"]
    assert cached == [5, 6, 7, 8]
    assert [i for i, n in enumerate(per_call) if n > 0] == cached, per_call


@pytest.mark.reference
def test_enable_cache_with_foca_matches_cache_dit():
    """``enable_cache(pipe, cache_config=..., calibrator_config=FoCaCalibratorConfig())`` on a real FluxPipeline."""
    from test_frontend import CFG, rel_err, run, tiny_flux, tiny_pipe

    import dit_passes
    tr = tiny_flux()
    ref_pipe = tiny_pipe(copy.deepcopy(tr))
    cache_dit.enable_cache(ref_pipe, cache_config=cache_dit.DBCacheConfig(**CFG),
                           calibrator_config=cache_dit.FoCaCalibratorConfig())
    ref = run(ref_pipe)
    ref_stats = cache_dit.summary(ref_pipe, logging=False)[0]
    pipe = tiny_pipe(tr)
    dit_passes.enable_cache(pipe, cache_config=dit_passes.DBCacheConfig(**CFG),
                            calibrator_config=cache_dit.FoCaCalibratorConfig())  # the reference's class, converted
    ours = run(pipe)
    st = dit_passes.summary(pipe, logging=False)[0]
    assert len(st.cached_steps) >= 2 and st.cached_steps == ref_stats.cached_steps
    assert rel_err(ours, ref) <= 1e-5
    assert isinstance(pipe.transformer.runtime.state["frontend"].calibrator_config, FoCaCalibratorConfig)
    tag = f"DBCache_F1B1_W2I1M0MC0_R0.3_CFG0_FoCa_S{len(st.cached_steps)}"  # Flux: separate CFG resolved off
    assert dit_passes.strify(pipe) == cache_dit.strify(ref_stats) == tag
