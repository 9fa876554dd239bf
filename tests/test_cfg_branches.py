"""CFG branches told apart from the calls (``enable_separate_cfg=None``), obeyed when set, refused when impossible.

A pipeline that calls the transformer twice per step (cond, then uncond: same timestep and latents, other prompt
embeddings) without naming a ``cache_context`` must give each branch its own cache state counting steps. References:
the same calls replayed branch by branch into two fresh single-state caches (``enable_separate_cfg=False``, tested
against cache-dit elsewhere), and cache-dit 1.5.3's ``enable_separate_cfg=True`` on a copy of the transformer.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build

torch.set_num_threads(1)  # CI: 2 xdist workers share 2 cores
STEPS = 8
# the tiny Wan's diffs are ~0.08-0.15: 0.12 caches some steps of each branch and computes others
CFG = dict(Fn_compute_blocks=1, residual_diff_threshold=0.12, max_warmup_steps=3)


def cfg_loop(model, kwargs, negative, steps=STEPS, gens=1, branches=("cond", "uncond"), replay=None):
    """A CFG sampler: per step the transformer on the prompt, then on the negative prompt (no context names); the
    latents move with the guided output. Returns ``{branch: [outputs]}`` and the ``(branch, inputs)`` of every call.
    ``replay``: run exactly these calls instead (one branch's inputs, recorded by an earlier run)."""
    outs = {b: [] for b in branches}
    calls = []
    if replay is not None:
        for b, kw in replay:
            with torch.no_grad():
                outs[b].append(model(**kw)[0])
        return outs, calls
    for _ in range(gens):
        lat = kwargs["hidden_states"].clone()
        for i in range(steps):
            t = torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / steps))
            step = {}
            for b in branches:
                kw = dict(kwargs, hidden_states=lat.clone(), timestep=t.clone(),
                          encoder_hidden_states=kwargs["encoder_hidden_states"] if b == "cond" else negative * len(b))
                with torch.no_grad():
                    step[b] = model(**kw)[0]
                outs[b].append(step[b])
                calls.append((b, kw))
            guided = step["cond"] + 3.0 * (step["cond"] - step["uncond"]) if "uncond" in step else step["cond"]
            lat = lat - 0.08 * guided.reshape(lat.shape)
    return outs, calls


def wan():
    zm = build("wan", num_layers=3)
    kwargs = zm.make_inputs()
    negative = torch.randn(kwargs["encoder_hidden_states"].shape, generator=torch.Generator().manual_seed(7))
    return zm.model, kwargs, negative


def per_context(store):
    return {name: c for name, c in store.summary()[-1]["contexts"].items()}


def test_unnamed_branches_each_keep_a_state_equal_to_running_alone():
    model, kwargs, negative = wan()
    ours = compile_dit(model, passes=[passes.DBCache(**CFG)])  # enable_separate_cfg=None
    outs, calls = cfg_loop(ours, kwargs, negative, gens=2)
    gens = ours.runtime.state["dbcache"].summary()
    assert len(gens) == 2, "the second loop must start a new generation of both branches"
    assert "state kept per CFG branch (2)" in ours.explain(print_output=False)
    for b, name in (("cond", "default"), ("uncond", "cfg")):
        alone = compile_dit(model, passes=[passes.DBCache(**CFG, enable_separate_cfg=False)])
        ref, _ = cfg_loop(alone, kwargs, negative, replay=[c for c in calls if c[0] == b])
        for got, want in zip(outs[b], ref[b]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        alone_gens = alone.runtime.state["dbcache"].summary()
        for g, a in zip(gens, alone_gens):
            mine, single = g["contexts"][name], a["contexts"]["default"]
            assert mine["executed_steps"] == single["executed_steps"] == STEPS  # steps, not calls
            assert mine["cached_steps"] == single["cached_steps"]
            assert mine["residual_diffs"] == single["residual_diffs"]
            assert min(mine["cached_steps"]) >= CFG["max_warmup_steps"]  # warm-up counted in steps
    first = gens[0]
    assert first["cached_steps"] and first["cfg_cached_steps"], "nothing cached: the states would not be told apart"
    assert len(first["cached_steps"]) < STEPS - CFG["max_warmup_steps"], "every step cached: no decision tested"
    # the single shared state (False) does differ here: the test tells the two behaviours apart
    shared = compile_dit(model, passes=[passes.DBCache(**CFG, enable_separate_cfg=False)])
    cfg_loop(shared, kwargs, negative)
    assert per_context(shared.runtime.state["dbcache"])["default"]["executed_steps"] == 2 * STEPS


@pytest.mark.reference
def test_unnamed_branches_match_cache_dit_separate_cfg():
    cache_dit = pytest.importorskip("cache_dit")
    logging.getLogger("cache_dit").setLevel(logging.ERROR)
    model, kwargs, negative = wan()
    ref_model = copy.deepcopy(model)
    cache_dit.enable_cache(ref_model, cache_config=cache_dit.DBCacheConfig(
        **CFG, enable_separate_cfg=True, num_inference_steps=STEPS))
    ref, _ = cfg_loop(ref_model, kwargs, negative)
    ref_stats = cache_dit.summary(ref_model, logging=False)[0]
    ours = compile_dit(model, passes=[passes.DBCache(**CFG)])
    got, _ = cfg_loop(ours, kwargs, negative)
    summ = ours.runtime.state["dbcache"].summary()[-1]
    assert summ["cached_steps"] == ref_stats.cached_steps and summ["cached_steps"]
    assert summ["cfg_cached_steps"] == ref_stats.cfg_cached_steps and summ["cfg_cached_steps"]
    assert summ["residual_diffs"] == pytest.approx(dict(ref_stats.residual_diffs), rel=1e-5)
    assert summ["cfg_residual_diffs"] == pytest.approx(dict(ref_stats.cfg_residual_diffs), rel=1e-5)
    for b in ("cond", "uncond"):
        err = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(got[b], ref[b]))
        assert err <= 1e-4, f"{b}: outputs differ by {err:.3g}"


def test_cfg_diff_shared_and_single_call_pipeline_under_none():
    """``cfg_diff_compute_separate=False``: the CFG branch takes the non-CFG branch's diff of the same step (as
    with True); a pipeline calling once per step keeps one state, as with False."""
    model, kwargs, negative = wan()
    shared = dict(CFG, cfg_diff_compute_separate=False)
    auto = compile_dit(model, passes=[passes.DBCache(**shared)])
    parity = compile_dit(model, passes=[passes.DBCache(**shared, enable_separate_cfg=True)])
    a, _ = cfg_loop(auto, kwargs, negative)
    p, _ = cfg_loop(parity, kwargs, negative)
    sa, sp = auto.runtime.state["dbcache"].summary()[-1], parity.runtime.state["dbcache"].summary()[-1]
    assert sa["cfg_residual_diffs"] == sp["cfg_residual_diffs"] == sa["residual_diffs"]
    assert sa["cfg_cached_steps"] == sp["cfg_cached_steps"]
    for b in a:
        for x, y in zip(a[b], p[b]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)

    single = compile_dit(model, passes=[passes.DBCache(**CFG)])
    plain = compile_dit(model, passes=[passes.DBCache(**CFG, enable_separate_cfg=False)])
    s, _ = cfg_loop(single, kwargs, negative, branches=("cond",))
    q, _ = cfg_loop(plain, kwargs, negative, branches=("cond",))
    for x, y in zip(s["cond"], q["cond"]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert per_context(single.runtime.state["dbcache"]).keys() == {"default"}
    assert per_context(single.runtime.state["dbcache"]) == per_context(plain.runtime.state["dbcache"])


def test_repeated_timestep_with_new_latents_is_a_new_step_and_a_third_branch_warns():
    """A Heun-type sampler evaluates twice at one timestep with other latents: one state, as with False. Three calls
    at one timestep and latents (more branches than kept) share the last state, which the summary says."""
    model, kwargs, negative = wan()
    outs = {}
    for sep in (None, False):
        compiled = compile_dit(model, passes=[passes.DBCache(**CFG, enable_separate_cfg=sep)])
        lat, got = kwargs["hidden_states"].clone(), []
        for i in range(STEPS):
            t = torch.full_like(kwargs["timestep"], 1000.0 * (1 - (i // 2) / STEPS))  # each timestep twice
            with torch.no_grad():
                got.append(compiled(**dict(kwargs, hidden_states=lat, timestep=t))[0])
            lat = lat - 0.08 * got[-1].reshape(lat.shape)
        outs[sep] = got, per_context(compiled.runtime.state["dbcache"])
    assert outs[None][1].keys() == {"default"} and outs[None][1] == outs[False][1]
    for x, y in zip(outs[None][0], outs[False][0]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)

    three = compile_dit(model, passes=[passes.DBCache(**CFG)])
    cfg_loop(three, kwargs, negative, steps=2, branches=("cond", "uncond", "uncond2"))
    with pytest.warns(UserWarning, match="more than 2 times at one timestep"):
        three.runtime.state["dbcache"].summary()


def test_separate_cfg_true_on_a_single_call_pipeline_fails_naming_the_setting():
    model, kwargs, negative = wan()
    forced = compile_dit(model, passes=[passes.DBCache(**CFG, enable_separate_cfg=True)])
    with pytest.raises(ValueError, match=r"enable_separate_cfg=True.*once per step.*enable_separate_cfg=None"):
        cfg_loop(forced, kwargs, negative, branches=("cond",), steps=2)
    # on a two-call pipeline True is obeyed (the reference's call parity): no error, both parities kept
    ok = compile_dit(model, passes=[passes.DBCache(**CFG, enable_separate_cfg=True)])
    cfg_loop(ok, kwargs, negative, steps=3)
    assert set(per_context(ok.runtime.state["dbcache"])) == {"non_cfg", "cfg"}


def test_dbprune_branches_under_none_equal_running_alone():
    model, kwargs, negative = wan()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.15, max_warmup_steps=2)
    ours = compile_dit(model, passes=[passes.DBPrune(**cfg)])
    outs, calls = cfg_loop(ours, kwargs, negative, steps=6)
    summ = ours.runtime.state["dbprune"].summary()[-1]
    assert summ["pruned_steps"] and summ["cfg_pruned_steps"]
    assert "state kept per CFG branch (2)" in ours.explain(print_output=False)
    for b, name in (("cond", "default"), ("uncond", "cfg")):
        alone = compile_dit(model, passes=[passes.DBPrune(**cfg, enable_separate_cfg=False)])
        ref, _ = cfg_loop(alone, kwargs, negative, replay=[c for c in calls if c[0] == b])
        for got, want in zip(outs[b], ref[b]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        single = alone.runtime.state["dbprune"].summary()[-1]["contexts"]["default"]
        mine = summ["contexts"][name]
        assert mine["pruned_blocks"] == single["pruned_blocks"] and mine["executed_steps"] == 6


# ------------------------------------------------------------------------------------- through real pipelines
def chroma_pipeline():
    """A tiny ChromaPipeline: it calls the transformer twice per step (prompt, negative prompt) without naming a
    cache context (diffusers 0.42)."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from dit_passes.testing.pipelines import tiny_vae
    torch.manual_seed(0)
    tr = ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
                                  approximator_layers=1).eval()
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(), text_encoder=None,
                          tokenizer=None, transformer=tr)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_chroma(pipe):
    g = torch.Generator().manual_seed(0)
    kw = dict(prompt_embeds=torch.randn(1, 7, 32, generator=g), negative_prompt_embeds=torch.randn(1, 7, 32, generator=g),
              prompt_attention_mask=torch.ones(1, 7), negative_prompt_attention_mask=torch.ones(1, 7))
    with torch.inference_mode():
        return pipe(height=16, width=16, num_inference_steps=STEPS, guidance_scale=4.0, output_type="latent",
                    generator=torch.Generator().manual_seed(3), **kw).images


def test_chroma_pipeline_finds_its_cfg_branches():
    """enable_cache(chroma_pipe) with the default enable_separate_cfg=None equals the reference's call parity
    (True, which cache-dit's table picks for Chroma): same latents, cached steps per branch, steps (not calls)
    counted, and cache-dit's tag (``_CFG1``). False (one shared state) counts every call as a step."""
    import dit_passes as cache_dit
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.4, max_warmup_steps=2)
    runs = {}
    for sep in (None, True, False):
        pipe = chroma_pipeline()
        cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(**cfg, enable_separate_cfg=sep))
        runs[sep] = (run_chroma(pipe), cache_dit.summary(pipe, logging=False)[0], cache_dit.strify(pipe))
    (auto, st, tag), (forced, st_true, _), (_, st_false, tag_false) = runs[None], runs[True], runs[False]
    torch.testing.assert_close(auto, forced, rtol=0, atol=0)
    assert st.cached_steps == st_true.cached_steps and st.cfg_cached_steps == st_true.cfg_cached_steps
    assert st.cached_steps and st.cfg_cached_steps
    assert st.accumulated_executed_steps == STEPS and st.accumulated_transformer_executed_steps == 2 * STEPS
    assert st_false.accumulated_executed_steps == 2 * STEPS  # the shared state's step count doubles
    assert tag.startswith("DBCache_F1B0_W2I1M0MC0_R0.4_CFG1_T0O0") and "_CFG0_" in tag_false


def wan_pipeline():
    """A tiny WanPipeline: CFG as two calls under cache_context("cond") / ("uncond")."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer=build("wan", num_layers=3, seed=1).model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_wan_pipeline_named_contexts_keep_one_state_each():
    import dit_passes as cache_dit
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=2)
    outs = {}
    for sep in (None, False):
        pipe = wan_pipeline()
        cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(**cfg, enable_separate_cfg=sep))
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            lat = pipe(prompt_embeds=torch.randn(1, 8, 32, generator=g),
                       negative_prompt_embeds=torch.randn(1, 8, 32, generator=g), height=32, width=32, num_frames=1,
                       num_inference_steps=STEPS, guidance_scale=4.0, output_type="latent",
                       generator=torch.Generator().manual_seed(3)).frames
        store = pipe.transformer.runtime.state["dbcache"]
        outs[sep] = lat, per_context(store), store
    (auto, ctx, store), (plain, ctx_plain, _) = outs[None], outs[False]
    torch.testing.assert_close(auto, plain, rtol=0, atol=0)
    assert ctx.keys() == {"cond", "uncond"} and ctx == ctx_plain
    assert all(c["executed_steps"] == STEPS for c in ctx.values())
    assert any(c["cached_steps"] for c in ctx.values())
    # a named context is a branch of its own: its other branch slot aliases the first (no second copy kept)
    for (gid, name), state in store._slots.items():
        slots = store._programs[gid][0].slots(state)
        assert all(a is b for a, b in zip(slots[0], slots[1])), name
