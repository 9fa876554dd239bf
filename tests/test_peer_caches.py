"""FirstBlockCache, MagCache and TaylorSeerCache passes side by side with diffusers 0.42's hooks on the same tiny
transformers (SeaCache / TeaCache: test_peer_caches_gating.py; all five compile with fullgraph=True here).

The reference is diffusers' own hook (``model.enable_cache(FirstBlockCacheConfig(...))`` /
``MagCacheConfig``) on a copy of the same fp32 CPU transformer; both run the same denoising loop (falling
timestep, latents moving with the output, two generations). We read the hook's decision after every call
(its shared state's ``should_compute``) and assert the same per-step decisions and outputs within 1e-5
relative. Thresholds are set from the run's own diffs / ratios so that some steps cache and some compute
(asserted: a wrong rule then changes the decisions).
"""
from __future__ import annotations

import ast
import contextlib
import copy
import io
import re
import statistics

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.infra.pass_base import PassError
from dit_passes.models.zoo import build

hooks = pytest.importorskip("diffusers.hooks")
torch.set_num_threads(1)  # CI: 2 xdist workers and the rank tests share 2 cores; a second thread only spins
STEPS = 8
FAMILIES = {"flux": {}, "wan": dict(num_layers=4), "qwenimage": dict(num_layers=4)}
_LEADER = {"fbc": "fbc_leader_block_hook", "mag": "mag_cache_leader_block_hook"}


def _head_hook(ref, kind):
    first = next(m for n, m in ref.named_children() if isinstance(m, torch.nn.ModuleList) and "block" in n)[0]
    return first._diffusers_hook.get_hook(_LEADER[kind])


def _taylorseer_probe(ref):
    """Whether diffusers' TaylorSeer hook predicted the last call (its first hooked module did not update)."""
    hook = next(m._diffusers_hook.get_hook("taylorseer_cache") for _, m in ref.named_modules()
                if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("taylorseer_cache"))

    def probe():
        state = hook.state_manager.get_state()
        return state.last_update_step != state.current_step
    return probe


def denoise(model, kwargs, generations=2, contexts=("cond",), probe=None, reset=None):
    """``generations`` loops of STEPS steps; per step one call per cache context (the encoder states differ
    per context, as CFG's). Returns the stacked outputs and, with ``probe``, per call whether it was cached."""
    outs, cached = [], []
    for g in range(generations):
        lat = kwargs["hidden_states"] + 0.3 * g  # another start each generation
        for i in range(STEPS):
            t = torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / STEPS))
            for c, name in enumerate(contexts):
                kw = dict(kwargs, hidden_states=lat, timestep=t,
                          encoder_hidden_states=kwargs["encoder_hidden_states"] * (1.0 - 0.5 * c))
                with torch.no_grad(), model.cache_context(name):
                    o = model(**kw)[0]
                    if probe is not None:
                        cached.append(probe())
                outs.append(o)
            lat = lat - 0.05 * o.reshape(lat.shape)
        if reset is not None:
            reset()  # what a pipeline does when its call ends (maybe_free_model_hooks)
    return torch.stack(outs), cached


def reference(model, kwargs, config, kind, **kw):
    ref = copy.deepcopy(model)
    ref.enable_cache(config)
    if kind == "taylorseer":
        probe = _taylorseer_probe(ref)
    else:
        hook = _head_hook(ref, kind)
        probe = lambda: not hook.state_manager.get_state().should_compute  # noqa: E731
    return denoise(ref, kwargs, probe=probe, reset=ref._reset_stateful_cache, **kw)


def ours(model, kwargs, pass_, name, **kw):
    compiled = compile_dit(model, passes=[pass_])
    out, _ = denoise(compiled, kwargs, **kw)
    recs = compiled.report(name).stats.records()
    return out, [r["cached"] for r in recs], compiled


def assert_close(ref, out, rel=1e-5):
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= rel, f"outputs differ: max relative {err:.3g} > {rel}"


def _fbc_threshold(model, kwargs):
    """The median first-block diff of a run that never caches: some steps fall below it, some above."""
    probe = compile_dit(model, passes=[passes.FirstBlockCache(threshold=-1.0)])
    denoise(probe, kwargs, generations=1)
    diffs = [d for d in probe.report("first_block_cache").last_generation()["step_diffs"] if d is not None]
    return statistics.median(diffs)


@pytest.mark.parity("diffusers.FirstBlockCacheConfig", "diffusers.FirstBlockCacheConfig.threshold")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_first_block_cache_matches_diffusers(family):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    threshold = _fbc_threshold(zm.model, kwargs)
    ref_out, ref_cached = reference(zm.model, kwargs, hooks.FirstBlockCacheConfig(threshold=threshold), "fbc")
    out, cached, compiled = ours(zm.model, kwargs, passes.FirstBlockCache(threshold=threshold), "first_block_cache")
    assert any(ref_cached) and not all(ref_cached), f"threshold {threshold} should cache some steps: {ref_cached}"
    assert cached == ref_cached
    assert_close(ref_out, out)
    assert "first_block_cache_decide" in compiled.code and ".item()" not in compiled.code


def test_first_block_cache_per_context():
    """Two cache contexts per step (CFG's cond / uncond): each keeps its own state, as diffusers' state manager."""
    zm = build("flux")
    kwargs = zm.make_inputs()
    threshold = _fbc_threshold(zm.model, kwargs)
    cfg = hooks.FirstBlockCacheConfig(threshold=threshold)
    ref_out, ref_cached = reference(zm.model, kwargs, cfg, "fbc", generations=1, contexts=("cond", "uncond"))
    out, cached, _ = ours(zm.model, kwargs, passes.FirstBlockCache(cfg), "first_block_cache", generations=1,
                          contexts=("cond", "uncond"))
    assert any(ref_cached) and not all(ref_cached)
    assert cached == ref_cached
    assert_close(ref_out, out)


def _calibrate_reference(model, kwargs):
    ref = copy.deepcopy(model)
    ref.enable_cache(hooks.MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # diffusers prints the ratios when the last step ends
        out, _ = denoise(ref, kwargs, generations=1)
    text = printed.getvalue()
    return out, ast.literal_eval(text[text.index("[1.0"):].splitlines()[0])


@pytest.mark.parity("diffusers.MagCacheConfig.calibrate", "diffusers.MagCacheConfig.num_inference_steps")
def test_mag_cache_calibration_matches_diffusers():
    zm = build("flux")
    kwargs = zm.make_inputs()
    ref_out, ref_ratios = _calibrate_reference(zm.model, kwargs)
    compiled = compile_dit(zm.model, passes=[passes.MagCache(calibrate=True, num_inference_steps=STEPS)])
    out, _ = denoise(compiled, kwargs, generations=1)
    ratios = compiled.report("mag_cache").mag_ratios()
    assert len(ratios) == STEPS and ratios[0] == 1.0 and len(set(ratios)) > 2
    torch.testing.assert_close(torch.tensor(ratios), torch.tensor(ref_ratios), rtol=1e-6, atol=0)
    assert_close(ref_out, out)
    assert compiled.report("mag_cache").last_generation()["step_cached"] == [False] * STEPS


@pytest.mark.parity("diffusers.MagCacheConfig", "diffusers.MagCacheConfig.threshold",
                    "diffusers.MagCacheConfig.num_inference_steps", "diffusers.MagCacheConfig.mag_ratios",
                    "diffusers.MagCacheConfig.max_skip_steps")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mag_cache_matches_diffusers(family):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    _, ratios = _calibrate_reference(zm.model, kwargs)
    # one step's error |1 - r| at the median: single steps skip, accumulations past it compute again
    threshold = statistics.median(abs(1.0 - r) for r in ratios[2:])
    fields = dict(threshold=threshold, num_inference_steps=STEPS, mag_ratios=ratios, max_skip_steps=2,
                  retention_ratio=0.2)
    ref_out, ref_cached = reference(zm.model, kwargs, hooks.MagCacheConfig(**fields), "mag")
    out, cached, compiled = ours(zm.model, kwargs, passes.MagCache(**fields), "mag_cache")
    assert any(ref_cached) and not all(ref_cached), f"threshold {threshold} should skip some steps: {ref_cached}"
    assert cached == ref_cached
    assert not any(cached[:2]) and not any(cached[STEPS:STEPS + 2])  # retention: int(0.2 * 8 + 0.5) = 2 steps
    assert_close(ref_out, out)
    assert "mag_cache_decide" in compiled.code and "fn_residual" not in compiled.code


@pytest.mark.parity("diffusers.MagCacheConfig.max_skip_steps", "diffusers.MagCacheConfig.retention_ratio",
                    "diffusers.MagCacheConfig.mag_ratios")
def test_mag_cache_skip_cap_and_list_ratios():
    """``max_skip_steps`` bounds the run of skipped steps; ratios given as a shorter list are resampled."""
    zm = build("flux")
    kwargs = zm.make_inputs()
    fields = dict(threshold=1.0, num_inference_steps=STEPS, mag_ratios=[1.0, 1.01, 1.0, 0.99, 1.0], max_skip_steps=1,
                  retention_ratio=0.0)
    ref_out, ref_cached = reference(zm.model, kwargs, hooks.MagCacheConfig(**fields), "mag", generations=1)
    out, cached, _ = ours(zm.model, kwargs, passes.MagCache(**fields), "mag_cache", generations=1)
    assert cached == ref_cached == [False] + [True, False] * 3 + [True]
    assert_close(ref_out, out)


# Wan's attention modules are blocks.i.attn1 / attn2, which diffusers' default patterns do not match
TAYLORSEER_IDS = {"flux": None, "qwenimage": None, "wan": [r"blocks\.\d+\.attn\d"]}
TAYLORSEER_CONFIGS = {"o1_fp32": dict(cache_interval=3, disable_cache_before_step=2, max_order=1,
                                      taylor_factors_dtype=torch.float32),
                      "o2_bf16_cooldown": dict(cache_interval=3, disable_cache_before_step=3, max_order=2,
                                               disable_cache_after_step=7)}


@pytest.mark.parity("diffusers.TaylorSeerCacheConfig", "diffusers.TaylorSeerCacheConfig.cache_interval",
                    "diffusers.TaylorSeerCacheConfig.disable_cache_before_step",
                    "diffusers.TaylorSeerCacheConfig.disable_cache_after_step",
                    "diffusers.TaylorSeerCacheConfig.max_order",
                    "diffusers.TaylorSeerCacheConfig.taylor_factors_dtype",
                    "diffusers.TaylorSeerCacheConfig.cache_identifiers")
@pytest.mark.parametrize("family,config", [("flux", "o1_fp32"), ("flux", "o2_bf16_cooldown"), ("wan", "o1_fp32"),
                                           ("qwenimage", "o2_bf16_cooldown")])
def test_taylorseer_matches_diffusers(family, config):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    fields = dict(TAYLORSEER_CONFIGS[config], cache_identifiers=TAYLORSEER_IDS[family])
    ref_out, ref_cached = reference(zm.model, kwargs, hooks.TaylorSeerCacheConfig(**fields), "taylorseer")
    out, cached, compiled = ours(zm.model, kwargs, passes.TaylorSeerCache(**fields), "taylorseer_cache")
    assert any(ref_cached) and not all(ref_cached), ref_cached
    assert cached == ref_cached
    assert_close(ref_out, out)
    plain, _ = denoise(zm.model, kwargs)
    assert ((plain - ref_out).abs().max() / plain.abs().max()).item() > 1e-4  # predictions do change outputs
    # one cond per module diffusers hooks
    from dit_passes.passes.taylorseer_cache import DEFAULT_IDENTIFIERS
    patterns = fields["cache_identifiers"] or DEFAULT_IDENTIFIERS
    hooked = [n for n, _ in zm.model.named_modules() if any(re.fullmatch(p, n) for p in patterns)]
    conds = sum(1 for n in compiled.graph_module.graph.nodes if n.target is torch.ops.higher_order.cond)
    assert conds == len(hooked) > 1


@pytest.mark.parity("diffusers.TaylorSeerCacheConfig.skip_predict_identifiers",
                    "diffusers.TaylorSeerCacheConfig.use_lite_mode", status="refused")
def test_taylorseer_refusals():
    zm = build("flux")
    with pytest.raises(PassError, match="use_lite_mode .* not implemented; use cache_identifiers"):
        compile_dit(zm.model, passes=[passes.TaylorSeerCache(use_lite_mode=True)], example_inputs=zm.make_inputs())
    with pytest.raises(PassError, match="skip_predict_identifiers .* not implemented; use cache_identifiers"):
        compile_dit(zm.model, passes=[passes.TaylorSeerCache(skip_predict_identifiers=[r"single_transformer_blocks"])],
                    example_inputs=zm.make_inputs())
    with pytest.raises(PassError, match="no module path matches"):
        compile_dit(zm.model, passes=[passes.TaylorSeerCache(cache_identifiers=[r"nothing\.here"])],
                    example_inputs=zm.make_inputs())
    with pytest.raises(ValueError, match="predicts step 0"):
        passes.TaylorSeerCache(disable_cache_before_step=0)


@pytest.mark.parametrize("make,backend", [
    (lambda: passes.FirstBlockCache(threshold=0.4), "eager"),
    (lambda: passes.TaylorSeerCache(cache_interval=2, disable_cache_before_step=2), "eager"),
    (lambda: passes.MagCache(threshold=0.3, num_inference_steps=STEPS, max_skip_steps=2,
                             mag_ratios=[1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 0.95, 1.0]), "eager"),
    # SeaCache's FFT indicator: eager backend (aot_eager takes ~3 min on 2 CPU cores); TeaCache: aot_eager
    (lambda: passes.SeaCache(threshold=0.5, num_inference_steps=STEPS, timestep_scale=1000.0), "eager"),
    (lambda: passes.TeaCache(threshold=1.0, num_inference_steps=STEPS, coefficients=(1.0, 0.0)), "aot_eager"),
    (lambda: passes.PyramidAttentionBroadcast(spatial_attention_block_skip_range=2), "eager"),
    (lambda: passes.FasterCache(is_guidance_distilled=True), "eager")],
    ids=["fbc", "taylorseer", "mag", "sea", "tea", "pab", "faster"])
def test_compiles_fullgraph(make, backend):
    """The whole step, decision and branch included, as one torch.compile graph (fullgraph=True). One block of each
    stream: the decision and the branch are the same at any depth, and the compile's cost grows with it."""
    zm = build("flux", num_layers=1, num_single_layers=1)
    kwargs = zm.make_inputs()
    eager = compile_dit(zm.model, passes=[make()])
    ref, _ = denoise(eager, kwargs, generations=1)
    fresh = compile_dit(zm.model, passes=[make()], torch_compile={"backend": backend})
    out, _ = denoise(fresh, kwargs, generations=1)
    assert fresh._current().runner is not fresh.graph_module
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    a, b = fresh.cache_report().last_generation(), eager.cache_report().last_generation()
    assert a["step_cached"] == b["step_cached"] and any(a["step_cached"])


def test_frontend_takes_diffusers_configs():
    import dit_passes as cache_dit
    zm = build("flux")
    kwargs = zm.make_inputs()
    threshold = _fbc_threshold(zm.model, kwargs)
    wrapped = cache_dit.enable_cache(zm.model, cache_config=hooks.FirstBlockCacheConfig(threshold=threshold))
    assert [p.name for p in wrapped.passes] == ["first_block_cache"]
    assert isinstance(wrapped.passes[0].config, cache_dit.FirstBlockCacheConfig)
    _, ref_cached = reference(zm.model, kwargs, hooks.FirstBlockCacheConfig(threshold=threshold), "fbc",
                              generations=1)
    denoise(wrapped, kwargs, generations=1)
    stats = cache_dit.summary(wrapped, logging=False)[0]
    assert stats.cached_steps == [i for i, c in enumerate(ref_cached) if c] and stats.cached_steps
    assert cache_dit.strify(stats).startswith(f"FBCache_R{threshold}")
    assert cache_dit.disable_cache(wrapped) is zm.model

    mag = cache_dit.enable_cache(zm.model, cache_config=cache_dit.MagCacheConfig(calibrate=True, num_inference_steps=4))
    assert [p.name for p in mag.passes] == ["mag_cache"]
    with pytest.raises(ValueError, match="DBCacheConfig / DBPruneConfig only"):
        cache_dit.enable_cache(zm.model, cache_config=hooks.FirstBlockCacheConfig(),
                               calibrator_config=cache_dit.TaylorSeerCalibratorConfig())


def test_refusals():
    from dit_passes import MagCacheConfig
    with pytest.raises(ValueError, match="mag_ratios are needed"):
        MagCacheConfig()
    with pytest.raises(ValueError, match="max_skip_steps"):
        MagCacheConfig(max_skip_steps=-1, calibrate=True)
    with pytest.raises(TypeError, match="FirstBlockCacheConfig"):
        passes.FirstBlockCache(MagCacheConfig(calibrate=True))
    zm = build("flux")
    compiled = compile_dit(zm.model, passes=[passes.MagCache(mag_ratios=[1.0] * STEPS, num_inference_steps=STEPS)])
    denoise(compiled, zm.make_inputs(), generations=1)
    with pytest.raises(RuntimeError, match="calibrate=True"):
        compiled.report("mag_cache").mag_ratios()
