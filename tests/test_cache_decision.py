"""The residual-cache decision layer, side by side with cache-dit 1.5.3's own cache context objects.

The reference is driven exactly as its block forward (``CachedBlocks_Pattern_Base.forward``) drives it:
``set_context`` -> ``mark_step_begin`` -> ``can_cache`` -> ``add_cached_step`` + ``apply_cache`` on a hit, or
``set_Fn_buffer`` + ``set_Bn_buffer`` + ``set_Bn_encoder_buffer`` on a miss; a new generation is the
pipeline wrapper's ``reset_context``. Our side detects the new generation itself (timestep rise).
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("cache_dit")
from cache_dit import steps_mask as ref_steps_mask  # noqa: E402
from cache_dit.caching.cache_contexts.cache_config import DBCacheConfig as RefConfig  # noqa: E402
from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager  # noqa: E402
from cache_dit.caching.cache_contexts.calibrators import TaylorSeerCalibratorConfig as RefTS  # noqa: E402

from dit_passes.cache.config import DBCacheConfig, TaylorSeerCalibratorConfig, full_tag  # noqa: E402
from dit_passes.cache.decision import (apply_hit, decide, hit_values, middle_cache_values,  # noqa: E402
                                       update_after_branch)
from dit_passes.cache.state import CacheContexts, CacheState  # noqa: E402
from dit_passes.cache.stats import CacheStats, diff_statistics  # noqa: E402
from dit_passes.cache.steps_mask import steps_mask  # noqa: E402

torch.set_num_threads(1)
SHAPE, ENC_SHAPE = (2, 12, 8), (2, 5, 8)


# -- synthetic transformer calls -------------------------------------------------------------------------
def make_calls(n, seed, dtype=torch.float32, drift=0.02, jitter=0.08):
    """n calls: Fn residual R (drifting, with jittered relative changes), Fn outputs, middle residuals."""
    g = torch.Generator().manual_seed(seed)
    base, d = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    m0, m1, m2 = (torch.randn(SHAPE, generator=g) for _ in range(3))
    e0, e1 = torch.randn(ENC_SHAPE, generator=g), torch.randn(ENC_SHAPE, generator=g)
    eps = torch.rand(n, generator=g) * jitter
    calls = []
    for k in range(n):
        r = base + drift * k * d + eps[k] * torch.randn(SHAPE, generator=g)
        calls.append(dict(R=r.to(dtype), h=torch.randn(SHAPE, generator=g).to(dtype),
                          e=torch.randn(ENC_SHAPE, generator=g).to(dtype),
                          mid=(m0 + 0.1 * k * m1 + 0.01 * k * k * m2).to(dtype), mid_e=(e0 + 0.1 * k * e1).to(dtype)))
    return calls


class Reference:
    """cache-dit's context manager, driven like its block forward; pipeline mode (reset per generation)."""

    def __init__(self, cfg: dict, ts: dict | None = None):
        self.m = CachedContextManager(name="ref")
        self.kw = dict(cache_config=RefConfig(**cfg), calibrator_config=RefTS(**ts) if ts is not None else None)

    def new_generation(self):
        self.m.reset_context("blocks", **copy.deepcopy(self.kw))

    def call(self, c):
        m = self.m
        m.set_context("blocks")
        m.mark_step_begin()
        hit = m.can_cache(c["R"], parallelized=False, prefix="b_Fn_residual")
        pre = "b_Bn_residual" if m.is_cache_residual() else "b_Bn_hidden_states"
        pre_e = "b_Bn_residual" if m.is_encoder_cache_residual() else "b_Bn_hidden_states"
        if hit:
            m.add_cached_step()
            h, e = m.apply_cache(c["h"], c["e"], prefix=pre, encoder_prefix=pre_e)
        else:
            m.set_Fn_buffer(c["R"], prefix="b_Fn_residual")
            h, e = c["h"] + c["mid"], c["e"] + c["mid_e"]
            m.set_Bn_buffer(h - c["h"] if m.is_cache_residual() else h, prefix=pre)
            m.set_Bn_encoder_buffer(e - c["e"] if m.is_encoder_cache_residual() else e, prefix=pre_e)
        ctx = m.get_context()
        return bool(hit), h, e, ctx


class Ours:
    def __init__(self, cfg: dict, ts: dict | None = None, stats: CacheStats | None = None):
        self.cfg = DBCacheConfig(**cfg)
        self.ts = TaylorSeerCalibratorConfig(**ts) if ts is not None else None
        self.ctxs = CacheContexts(self.cfg, self.ts)
        self.stats = stats

    def call(self, c, t, name=None, step_fn=None):
        ctx, st, partner = self.ctxs.select(name)
        st.ensure(c["R"], [c["h"], c["e"]])
        fn = step_fn or self.step
        use, new, diff, h, e = fn(st.as_tensors(), c["R"], t, c["h"], c["e"], c["mid"], c["mid_e"],
                                  None if partner is None else partner.as_tensors())
        st.update(new)
        if self.stats is not None:
            self.stats.record(ctx, new)
        return use, h, e, new, diff

    def step(self, state, r, t, h, e, mid, mid_e, partner=None):
        use, new, diff = decide(state, r, t, self.cfg, partner=partner)
        hit = apply_hit([h, e], hit_values(new, 2, self.ts), self.ts)
        computed = [h + mid, e + mid_e]
        outs = [torch.where(use, a, b) for a, b in zip(hit, computed)]
        new = update_after_branch(new, use, middle_cache_values([h, e], computed, self.ts), self.ts)
        return use, new, diff, outs[0], outs[1]


def timesteps(n):
    return torch.linspace(1000.0, 10.0, n)


def run_side_by_side(cfg, n=20, gens=2, seed=0, ts=None, calls_per_step=1, dtype=torch.float32, rtol=1e-5):
    ref, ours = Reference(cfg, ts), Ours(cfg, ts, stats=CacheStats(capacity=512))
    decisions = []
    for gen in range(gens):
        ref.new_generation()
        calls = make_calls(n * calls_per_step, seed + 17 * gen, dtype)
        ts_ = timesteps(n)
        seq = []
        for i, c in enumerate(calls):
            hit, h, e, _ = ref.call(c)
            use, h2, e2, _, _ = ours.call(c, ts_[i // calls_per_step])
            assert bool(use) == hit, f"gen {gen} call {i}: ours {bool(use)} vs cache-dit {hit} (seq {seq})"
            torch.testing.assert_close(h2, h, rtol=rtol, atol=rtol)
            torch.testing.assert_close(e2, e, rtol=rtol, atol=rtol)
            seq.append(hit)
        decisions.append(seq)
        ctx = ref.m.get_context("blocks")
        summ = ours.stats.summary()[-1]
        if not cfg.get("enable_separate_cfg"):
            assert summ["cached_steps"] == ctx.get_cached_steps()
            assert summ["residual_diffs"] == dict(ctx.get_residual_diffs())
        else:
            assert summ["cached_steps"] == ctx.get_cached_steps()
            assert summ["cfg_cached_steps"] == ctx.get_cfg_cached_steps()
            assert summ["residual_diffs"] == dict(ctx.get_residual_diffs())
            assert summ["cfg_residual_diffs"] == dict(ctx.get_cfg_residual_diffs())
    return decisions


CONFIGS = {
    "default": dict(Fn_compute_blocks=1),
    "thr0": dict(residual_diff_threshold=0.0, max_warmup_steps=2),
    "thr1": dict(residual_diff_threshold=1.0, max_warmup_steps=3),
    "interval2": dict(max_warmup_steps=6, warmup_interval=2, residual_diff_threshold=0.2),
    "max_cached": dict(max_warmup_steps=2, residual_diff_threshold=0.3, max_cached_steps=3),
    "max_cont": dict(max_warmup_steps=2, residual_diff_threshold=0.5, max_continuous_cached_steps=2),
    "acc_cap": dict(max_warmup_steps=2, residual_diff_threshold=0.3, max_accumulated_residual_diff_threshold=0.5),
    "scm_dynamic": dict(max_warmup_steps=4, residual_diff_threshold=0.2,
                        steps_computation_mask=ref_steps_mask(total_steps=28, mask_policy="fast")),
    # warm-up 8 is cut to the mask's 6 leading 1s
    "scm_static": dict(max_warmup_steps=8, steps_computation_mask=ref_steps_mask(total_steps=28, mask_policy="medium"),
                       steps_computation_policy="static"),
    "bf16": dict(max_warmup_steps=2, residual_diff_threshold=0.15),
}


@pytest.mark.parity("DBCacheConfig", "DBCacheConfig.residual_diff_threshold", "DBCacheConfig.max_warmup_steps",
                    "DBCacheConfig.warmup_interval", "DBCacheConfig.max_cached_steps",
                    "DBCacheConfig.max_continuous_cached_steps",
                    "DBCacheConfig.max_accumulated_residual_diff_threshold", "DBCacheConfig.steps_computation_mask",
                    "DBCacheConfig.steps_computation_policy")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decisions_match_cache_dit(name):
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    gens = run_side_by_side(CONFIGS[name], n=28 if name.startswith("scm") else 20, dtype=dtype, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    flat = [d for g in gens for d in g]
    if name == "thr0":
        assert not any(flat)
    elif name == "thr1":
        assert gens[0] == [False] * 3 + [True] * 17
    else:  # the sequences exercise both outcomes, so a constant answer cannot pass
        assert any(flat) and not all(flat), (name, gens)
    if name == "max_cached":
        assert all(sum(g) == 3 for g in gens)
    if name == "scm_static":  # 0 slots after the (cut) warm-up are always cached
        mask = CONFIGS[name]["steps_computation_mask"]
        assert all(g == [m == 0 and i >= 6 for i, m in enumerate(mask)] for g in gens)


@pytest.mark.parametrize("cfg", [
    dict(enable_separate_cfg=True, max_warmup_steps=2, residual_diff_threshold=0.25),
    dict(enable_separate_cfg=True, max_warmup_steps=2, residual_diff_threshold=0.25, cfg_diff_compute_separate=False),
    dict(enable_separate_cfg=True, cfg_compute_first=True, cfg_diff_compute_separate=False, max_warmup_steps=2,
         residual_diff_threshold=0.25, max_cached_steps=4),
])
@pytest.mark.parity("DBCacheConfig.enable_separate_cfg", "DBCacheConfig.cfg_compute_first",
                    "DBCacheConfig.cfg_diff_compute_separate")
def test_separate_cfg_matches_cache_dit(cfg):
    gens = run_side_by_side(cfg, n=12, calls_per_step=2)
    assert any(gens[0]) and not all(gens[0])


@pytest.mark.parity("DBCacheConfig.force_refresh_step_hint", "DBCacheConfig.force_refresh_step_policy")
@pytest.mark.parametrize("policy", ["once", "repeat"])
def test_force_refresh_matches_cache_dit(policy):
    run_side_by_side(dict(max_warmup_steps=2, residual_diff_threshold=0.3, force_refresh_step_hint=6,
                          force_refresh_step_policy=policy), n=20)


@pytest.mark.parity("TaylorSeerCalibratorConfig", "TaylorSeerCalibratorConfig.taylorseer_order",
                    "CalibratorConfig.calibrator_cache_type", "CalibratorConfig.enable_encoder_calibrator")
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("variant", ["residual", "hidden_states", "image_only"])
def test_taylorseer_matches_cache_dit(order, variant):
    ts = dict(taylorseer_order=order)
    if variant == "hidden_states":
        ts["calibrator_cache_type"] = "hidden_states"
    if variant == "image_only":
        ts["enable_encoder_calibrator"] = False
    cfg = dict(max_warmup_steps=4, residual_diff_threshold=0.6, max_continuous_cached_steps=3)
    gens = run_side_by_side(cfg, n=20, ts=ts, rtol=1e-5)
    assert sum(gens[0]) >= 6


def scaled_calls(vs, seed=0):
    """Calls whose Fn residual is the constant v: the relative diff to a stored v_p is |v_p - v| / v_p (exact
    in float32 for dyadic v)."""
    calls = make_calls(len(vs), seed)
    for c, v in zip(calls, vs):
        c["R"] = torch.full(SHAPE, float(v))
    return calls


@pytest.mark.parametrize("cfg, vs, expect", [
    # accumulated cap 0.26: diffs 0.1 + 0.2 reach it, so step 3 must compute
    (dict(max_warmup_steps=1, residual_diff_threshold=0.3, max_accumulated_residual_diff_threshold=0.26),
     [1, 1.1, 1.2, 1.25, 1.3], [False, True, True, False, False]),  # the sum is per generation
    # diff == threshold does not cache (strict <); just below does
    (dict(max_warmup_steps=1, residual_diff_threshold=0.25), [1, 1.25, 1.2, 1.6],
     [False, False, True, False]),
    # threshold >= 1 caches everything except when nothing is stored yet (step 0, no warm-up)
    (dict(max_warmup_steps=0, residual_diff_threshold=1.0), [1, 5, 9], [False, True, True]),
    # continuous cap 1: cached, computed, cached ...
    (dict(max_warmup_steps=1, residual_diff_threshold=0.5, max_continuous_cached_steps=1), [1, 1, 1, 1, 1],
     [False, True, False, True, False]),
    # a zero stored residual: diff is inf/nan, never cached
    (dict(max_warmup_steps=1, residual_diff_threshold=0.5), [0, 0, 1], [False, False, False]),
])
def test_controlled_boundaries(cfg, vs, expect):
    ref, ours = Reference(cfg), Ours(cfg)
    ref.new_generation()
    got = []
    for i, c in enumerate(scaled_calls(vs)):
        hit, _, _, _ = ref.call(c)
        use, _, _, new, _ = ours.call(c, torch.tensor(float(100 - i)))
        assert bool(use) == hit, (i, got)
        got.append(hit)
    assert got == expect
    ref_acc = ref.m.get_context("blocks").get_accumulated_residual_diff()
    assert float(new["acc_diff"]) == pytest.approx(ref_acc, rel=1e-12, abs=0)


@pytest.mark.parity("DBCacheConfig.num_inference_steps")
def test_num_inference_steps_and_explicit_reset():
    """Without timesteps: num_inference_steps restarts the state after N calls; so does new_generation()."""
    n = 14
    for cfg, explicit in ((dict(max_warmup_steps=2, residual_diff_threshold=0.3, num_inference_steps=n), False),
                          (dict(max_warmup_steps=2, residual_diff_threshold=0.3), True)):
        ref, ours = Reference(cfg), Ours(cfg)
        for gen in range(2):
            ref.new_generation()
            if explicit:
                ours.ctxs.new_generation()
            for c in make_calls(n, 5 + gen):
                hit, h, _, _ = ref.call(c)
                use, h2, _, new, _ = ours.call(c, None)
                assert bool(use) == hit
            assert int(new["gen"]) == gen and int(new["step"]) == n - 1


def test_reference_transformer_only_refresh_is_one_call_late():
    """Documents a cache-dit 1.5.3 quirk we do not copy: with a persistent context, maybe_refresh tests
    ``current_step >= num_inference_steps`` before mark_step_begin, so call N is step N of the old run."""
    m = CachedContextManager(name="p", persistent_context=True)
    m.new_context(name="c", cache_config=RefConfig(num_inference_steps=4, max_warmup_steps=1))
    steps = []
    for _ in range(6):
        m.set_context("c")
        m.mark_step_begin()
        steps.append(m.get_current_step())
    assert steps == [0, 1, 2, 3, 4, 0]
    cfg = DBCacheConfig(num_inference_steps=4, max_warmup_steps=1)
    st = CacheState(cfg).ensure(torch.ones(2), [torch.ones(2)])
    ours = []
    for _ in range(6):
        _, new, _ = decide(st.as_tensors(), torch.ones(2), None, cfg)
        st.update(new)
        ours.append(int(new["step"]))
    assert ours == [0, 1, 2, 3, 0, 1]


def test_timestep_direction_increasing():
    cfg = DBCacheConfig(max_warmup_steps=1, residual_diff_threshold=1.0)
    for direction, t_seq, expect in (("increasing", [0.1, 0.2, 0.3, 0.05], [0, 1, 2, 0]),
                                     ("decreasing", [0.1, 0.2, 0.3, 0.05], [0, 0, 0, 1]),
                                     ("none", [0.1, 0.2, 0.3, 0.05], [0, 1, 2, 3])):
        st = CacheState(cfg).ensure(torch.ones(3), [torch.ones(3)])
        got = []
        for t in t_seq:
            _, new, _ = decide(st.as_tensors(), torch.ones(3), torch.tensor([t, t]), cfg, timestep_direction=direction)
            st.update(new)
            got.append(int(new["step"]))
        assert got == expect, direction


def test_allreduce_applied_before_division():
    cfg = DBCacheConfig(max_warmup_steps=1, residual_diff_threshold=0.5)
    calls = make_calls(3, 3)
    seen = []

    def halve_den(num, den):  # stands for "average with other ranks"
        seen.append((num.clone(), den.clone()))
        return num, den / 2

    diffs = {}
    for ar in (None, halve_den):
        st = CacheState(cfg).ensure(calls[0]["R"], [calls[0]["h"]])
        for c in calls[:2]:
            _, new, diff = decide(st.as_tensors(), c["R"], None, cfg, allreduce=ar)
            st.update(new)
        diffs[ar is None] = float(diff)
    assert len(seen) == 2
    r0, r1 = calls[0]["R"], calls[1]["R"]
    expect = float(((r0 - r1).abs().mean() / r0.abs().mean()).item())
    assert diffs[True] == pytest.approx(expect, rel=1e-6)
    assert diffs[False] == pytest.approx(2 * expect, rel=1e-6)


def test_decide_traces_with_compile_and_matches_eager():
    cfg = dict(max_warmup_steps=2, residual_diff_threshold=0.3, max_continuous_cached_steps=2,
               max_accumulated_residual_diff_threshold=2.0,
               steps_computation_mask=ref_steps_mask(total_steps=12, mask_policy="fast"))
    eager, comp = Ours(cfg, dict(taylorseer_order=2)), Ours(cfg, dict(taylorseer_order=2))
    compiled = torch.compile(comp.step, fullgraph=True, backend="eager")
    ts_ = timesteps(12)
    seq = []
    for gen in range(2):
        for i, c in enumerate(make_calls(12, 11 + gen)):
            u1, h1, e1, s1, d1 = eager.call(c, ts_[i])
            u2, h2, e2, s2, d2 = comp.call(c, ts_[i], step_fn=compiled)
            assert bool(u1) == bool(u2)
            torch.testing.assert_close(h1, h2)
            for k in s1:
                torch.testing.assert_close(s1[k], s2[k], equal_nan=True, msg=k)
            seq.append(bool(u1))
    assert any(seq) and not all(seq)


def test_decide_exports_without_host_reads_or_constants():
    mask = steps_mask(total_steps=70, mask_policy="fast")  # 70 steps: two packed mask words
    cfg = DBCacheConfig(max_warmup_steps=1, residual_diff_threshold=0.3, steps_computation_mask=mask,
                        max_accumulated_residual_diff_threshold=1.0, num_inference_steps=70)
    ts = TaylorSeerCalibratorConfig(taylorseer_order=2)
    c = make_calls(3, 1)
    st = CacheState(cfg, ts).ensure(c[0]["R"], [c[0]["h"], c[0]["e"]])
    keys = st.names()
    ours = Ours(dataclasses.asdict(cfg), dataclasses.asdict(ts))

    class Step(torch.nn.Module):
        def forward(self, r, t, h, e, mid, mid_e, *state):
            use, new, diff, h2, e2 = ours.step(dict(zip(keys, state)), r, t, h, e, mid, mid_e)
            return (use, diff, h2, e2) + tuple(new[k] for k in keys)

    def args(i, state):
        return (c[i]["R"], torch.tensor([10.0 - i]), c[i]["h"], c[i]["e"], c[i]["mid"], c[i]["mid_e"], *state)

    ep = torch.export.export(Step(), args(0, st.as_tensors().values()), strict=False)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten._local_scalar_dense.default not in targets and torch.ops.aten.item.default not in targets
    assert not ep.constants and torch.ops.aten.lift_fresh_copy.default not in targets
    state_e = state_r = tuple(st.as_tensors().values())
    for i in range(3):
        out = ep.module()(*args(i, state_e))
        ref = Step()(*args(i, state_r))
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, equal_nan=True)
        state_e, state_r = out[4:], ref[4:]


def test_mask_lookup_on_device():
    from dit_passes.cache.decision import _mask_slot_is_one
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(130, generator=g) > 0.5).long().tolist()
    got = [bool(_mask_slot_is_one(mask, torch.tensor(k))) for k in range(-1, 135)]
    assert got == [0 <= k < len(mask) and mask[k] == 1 for k in range(-1, 135)]


@pytest.mark.parity("steps_mask")
@pytest.mark.parametrize("total", [4, 6, 8, 9, 10, 12, 15, 16, 20, 27, 28, 29, 40, 50, 100])
def test_steps_mask_presets_equal_cache_dit(total):
    for policy in ("slow", "medium", "fast", "ultra"):
        assert steps_mask(total_steps=total, mask_policy=policy) == ref_steps_mask(total_steps=total,
                                                                                  mask_policy=policy)


def test_steps_mask_bins_and_errors():
    for cb, kb, n in (([4, 2], [3, 1], None), ([4, 2], [3, 1], 8), ([1, 0, 2], [2, 2], 6), ([3], [], 3)):
        assert steps_mask(cb, kb, n) == ref_steps_mask(cb, kb, n)
    assert "".join(map(str, steps_mask(total_steps=28, mask_policy="slow"))) == "1111111101110011100110010001"
    with pytest.raises(ValueError, match="total_steps is required"):
        steps_mask()
    with pytest.raises(ValueError, match="mask_policy"):
        steps_mask(total_steps=28, mask_policy="turbo")
    with pytest.raises(ValueError, match="4 or 6"):
        steps_mask(total_steps=5)
    with pytest.raises(ValueError, match="both"):
        steps_mask(compute_bins=[2], total_steps=4)
    with pytest.raises(ValueError, match="fewer than"):
        steps_mask([1], [1], 5)
    with pytest.raises(ValueError, match="ints >= 0"):
        steps_mask([1, -1], [1], None)


def test_strify_equal_cache_dit():
    from cache_dit.summary import CacheStats as RefStats, strify as ref_strify
    cases = [dict(), dict(Fn_compute_blocks=1, Bn_compute_blocks=2, residual_diff_threshold=0.12, max_cached_steps=5,
                          max_continuous_cached_steps=2, warmup_interval=2),
             dict(residual_diff_threshold=1, steps_computation_mask=[1, 1, 0, 1], steps_computation_policy="static",
                  num_inference_steps=4, enable_separate_cfg=True),
             dict(force_refresh_step_hint=3, force_refresh_step_policy="repeat", enable_separate_cfg=False)]
    for kw in cases:
        assert DBCacheConfig(**kw).strify() == RefConfig(**kw).strify()
    assert DBCacheConfig().strify() == "DBCache_F8B0_W8I1M0MC0_R0.08"
    for order in (0, 1, 2):
        ours, ref = TaylorSeerCalibratorConfig(taylorseer_order=order), RefTS(taylorseer_order=order)
        assert ours.strify() == ref.strify() and ours.strify(details=True) == ref.strify(details=True)
        for cached in (0, 7):
            ref_tag = ref_strify(RefStats(cache_options={"cache_config": RefConfig(), "calibrator_config": ref},
                                          accumulated_cached_steps=cached))
            assert full_tag(DBCacheConfig(), ours, cached) == ref_tag
    assert full_tag(DBCacheConfig()) == ref_strify(RefStats(cache_options={"cache_config": RefConfig()}))
    ref_fields = {f.name: f.default for f in dataclasses.fields(RefConfig)}
    our_fields = {f.name: f.default for f in dataclasses.fields(DBCacheConfig)}
    assert list(our_fields) == list(ref_fields)
    assert {k: str(v) for k, v in our_fields.items()} == {k: str(v) for k, v in ref_fields.items()}
    ts_ref = {f.name for f in dataclasses.fields(RefTS)}
    assert ts_ref == {f.name for f in dataclasses.fields(TaylorSeerCalibratorConfig)}


@pytest.mark.parametrize("kw, match", [
    (dict(Fn_compute_blocks=0), "Fn_compute_blocks"),
    (dict(Bn_compute_blocks=-1), "Bn_compute_blocks"),
    (dict(max_warmup_steps=-2), "max_warmup_steps"),
    (dict(warmup_interval=0), "warmup_interval"),
    (dict(max_cached_steps=-3), "max_cached_steps"),
    (dict(max_continuous_cached_steps=-5), "max_continuous_cached_steps"),
    (dict(max_accumulated_residual_diff_threshold=-0.1), "max_accumulated"),
    (dict(steps_computation_policy="lazy"), "steps_computation_policy"),
    (dict(steps_computation_mask=[1, 2, 0]), "only the ints 0 and 1"),
    (dict(steps_computation_mask=[True, False]), "only the ints 0 and 1"),
    (dict(steps_computation_mask=[]), "non-empty"),
    (dict(steps_computation_mask=[1, 0, 1], num_inference_steps=4), "num_inference_steps=4"),
    (dict(steps_computation_mask=[0, 1], steps_computation_policy="static"), "must start with 1"),
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(cache_type="DBPrune"), "only 'DBCache'"),
    (dict(enable_separate_cfg=True, cfg_compute_first=True), "cfg_compute_first"),
    (dict(force_refresh_step_hint=0), "force_refresh_step_hint"),
    (dict(force_refresh_step_hint=4, enable_separate_cfg=True), "not supported"),
    (dict(force_refresh_step_policy="always"), "force_refresh_step_policy"),
    (dict(Fn_compute_blocks=2.0), "must be an int"),
    (dict(residual_diff_threshold=torch.tensor(0.1)), "Python float"),
])
def test_config_errors(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DBCacheConfig(**kw)


def test_calibrator_config_errors_and_state_misuse():
    for kw, match in ((dict(taylorseer_order=-1), "taylorseer_order"), (dict(calibrator_type="foca"), "taylorseer"),
                      (dict(calibrator_cache_type="both"), "calibrator_cache_type")):
        with pytest.raises(ValueError, match=match):
            TaylorSeerCalibratorConfig(**kw)
    cfg = DBCacheConfig()
    st = CacheState(cfg)
    with pytest.raises(RuntimeError, match="not allocated"):
        st.as_tensors()
    st.ensure(torch.ones(2, 3), [torch.ones(2, 3)])
    with pytest.raises(ValueError, match="changed shape"):
        st.ensure(torch.ones(2, 4), [torch.ones(2, 4)])
    with pytest.raises(KeyError, match="missing"):
        st.update({"step": torch.zeros((), dtype=torch.int64)})
    with pytest.raises(ValueError, match="partner"):
        decide(st.as_tensors(), torch.ones(2, 3), None, cfg, partner=st.as_tensors())
    with pytest.raises(ValueError, match="timestep_direction"):
        decide(st.as_tensors(), torch.ones(2, 3), None, cfg, timestep_direction="up")


def test_stats_summary_percentiles_and_ring():
    cfg = dict(max_warmup_steps=2, residual_diff_threshold=0.3)
    ref, ours = Reference(cfg), Ours(cfg, stats=CacheStats(capacity=8))
    ref.new_generation()
    ts_ = timesteps(6)
    for i, c in enumerate(make_calls(6, 2)):
        ref.call(c)
        ours.call(c, ts_[i])
    s = ours.stats.summary()[0]
    diffs = dict(ref.m.get_context("blocks").get_residual_diffs())
    vals = list(diffs.values())
    assert s["residual_diffs"] == diffs and len(vals) >= 3
    expect = {"P00": np.percentile(vals, 0), "P25": np.percentile(vals, 25), "P50": np.percentile(vals, 50),
              "P75": np.percentile(vals, 75), "P95": np.percentile(vals, 95), "Min": min(vals), "Max": max(vals)}
    assert s["residual_diff_stats"] == pytest.approx(expect)
    assert diff_statistics([]) == {}
    assert "Diffs P95" in ours.stats.summary_string()
    for i, c in enumerate(make_calls(6, 3)):  # 12 calls into 8 slots
        ours.call(c, ts_[i])
    recs = ours.stats.records()
    assert ours.stats.dropped == 4 and len(recs) == 8
    assert [r["step"] for r in recs] == [4, 5, 0, 1, 2, 3, 4, 5]
    assert [r["generation"] for r in recs] == [0, 0, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("cfg, reason", [
    (dict(max_cached_steps=0, residual_diff_threshold=1.0, max_warmup_steps=1), "max_cached_steps=0"),
    (dict(max_warmup_steps=12, residual_diff_threshold=1.0, num_inference_steps=12), "covers all 12 steps"),
    (dict(max_warmup_steps=2, residual_diff_threshold=0.0), "never below it"),
    (dict(max_warmup_steps=2, residual_diff_threshold=0.5, steps_computation_mask=[1] * 12), "computes every step"),
    (dict(max_warmup_steps=20, residual_diff_threshold=1.0, steps_computation_mask=[1] * 4 + [0] * 8,
          num_inference_steps=12), None),  # the warm-up is cut to the mask's leading 1s: steps 4.. may cache
    (dict(max_warmup_steps=12, warmup_interval=2, residual_diff_threshold=1.0, num_inference_steps=12), None),
    (dict(max_warmup_steps=2, residual_diff_threshold=0.0, steps_computation_mask=[1, 1] + [0] * 10,
          steps_computation_policy="static"), None),  # static zeros are cached whatever the threshold
])
def test_never_caches_agrees_with_cache_dit(cfg, reason):
    """``DBCacheConfig.never_caches`` (what the cache passes warn about) against cache-dit's own decisions over a
    12-step generation: a config it names caches nothing there; one it does not name caches some step."""
    got = DBCacheConfig(**cfg).never_caches()
    assert (got is None) if reason is None else (got is not None and reason in got), got
    ref = Reference(cfg)
    ref.new_generation()
    hits = [ref.call(c)[0] for c in make_calls(12, 4, drift=0.0, jitter=0.0)]
    assert any(hits) == (reason is None), hits
