"""FirstBlockCache and MagCache under context parallelism (2 gloo CPU ranks): the same decisions and outputs
as the single-process pass on every rank, with the collectives the rule needs and no more (FirstBlockCache:
one all-reduce per call, of its diff's numerator and denominator; MagCache: none, its decision reads no
activation; MagCache calibration: one per computed step, of the mean magnitude ratio; TaylorSeerCache: none,
its attention modules, Ulysses' all-to-alls included, sit in the branches; SeaCache: none, its indicator
reads the transformer's input, whole on every rank; TeaCache: one per call, of its distance's two means over
the token-sharded modulated input; PyramidAttentionBroadcast and FasterCache (guidance distilled): none)."""
from __future__ import annotations

import statistics

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.testing import run_ranks
from dit_passes.testing.counting import OpCounter

STEPS = 8
RATIOS = [1.0, 1.1, 0.97, 1.02, 1.0, 0.95, 1.03, 1.0]


def _loop(model, kwargs, counter=None):
    outs, lat = [], kwargs["hidden_states"].clone()
    for i in range(STEPS):
        kw = dict(kwargs, hidden_states=lat, timestep=torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / STEPS)))
        with torch.no_grad(), (counter if counter is not None else torch.no_grad()):
            o = model(**kw)[0]
        outs.append(o)
        lat = lat - 0.05 * o
    return torch.stack(outs)


def _compare(make, kwargs, model, world, name):
    single = compile_dit(model, passes=[make()])
    ref = _loop(single, kwargs)
    par = compile_dit(model, passes=[passes.Ulysses(size=world), make()])
    par.lower(**dict(kwargs, timestep=torch.full_like(kwargs["timestep"], 1000.0)))  # capture outside the count
    counter = OpCounter(["all_reduce"])
    out = _loop(par, kwargs, counter)
    return {"rel": ((out - ref).abs().max() / ref.abs().max()).item(),
            "cached": par.report(name).last_generation()["step_cached"],
            "ref_cached": single.report(name).last_generation()["step_cached"],
            "all_reduce": counter.counts.get("all_reduce", 0), "single": single, "par": par}


def _rank_fn(rank, world):
    torch.set_num_threads(1)
    zm = build("flux")
    kwargs = zm.make_inputs(batch=1, seed=2)
    probe = compile_dit(zm.model, passes=[passes.FirstBlockCache(threshold=-1.0)])
    _loop(probe, kwargs)
    threshold = statistics.median(d for d in probe.report("first_block_cache").last_generation()["step_diffs"] if d)
    out = {}
    fbc = _compare(lambda: passes.FirstBlockCache(threshold=threshold), kwargs, zm.model, world, "first_block_cache")
    mag = _compare(lambda: passes.MagCache(threshold=0.06, num_inference_steps=STEPS, mag_ratios=RATIOS,
                                           retention_ratio=0.0), kwargs, zm.model, world, "mag_cache")
    cal = _compare(lambda: passes.MagCache(calibrate=True, num_inference_steps=STEPS), kwargs, zm.model, world,
                   "mag_cache")
    ts = _compare(lambda: passes.TaylorSeerCache(cache_interval=2, disable_cache_before_step=2,
                                                 taylor_factors_dtype=torch.float32), kwargs, zm.model, world,
                  "taylorseer_cache")
    sea = _compare(lambda: passes.SeaCache(threshold=0.2, num_inference_steps=STEPS, timestep_scale=1000.0), kwargs,
                   zm.model, world, "sea_cache")
    tea = _compare(lambda: passes.TeaCache(threshold=0.5, num_inference_steps=STEPS, coefficients=(1.0, 0.0)), kwargs,
                   zm.model, world, "tea_cache")
    pab = _compare(lambda: passes.PyramidAttentionBroadcast(spatial_attention_block_skip_range=2), kwargs, zm.model,
                   world, "pab")
    faster = _compare(lambda: passes.FasterCache(is_guidance_distilled=True), kwargs, zm.model, world, "faster_cache")
    cal["ratios"] = cal["par"].report("mag_cache").mag_ratios()
    cal["ref_ratios"] = cal["single"].report("mag_cache").mag_ratios()
    for name, r in (("fbc", fbc), ("mag", mag), ("cal", cal), ("taylorseer", ts), ("sea", sea), ("tea", tea),
                    ("pab", pab), ("faster", faster)):
        r.pop("single"), r.pop("par")
        out[name] = r
    return out


@pytest.mark.multiproc
def test_peer_caches_under_ulysses():
    results = run_ranks(_rank_fn, 2, timeout=300)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["rel"] <= 1e-5, f"rank {rank} {name}: max relative error {r['rel']:.2e}"
            assert r["cached"] == r["ref_cached"], f"rank {rank} {name}: {r['cached']} vs {r['ref_cached']}"
        assert any(res["fbc"]["cached"]) and not all(res["fbc"]["cached"]), res["fbc"]["cached"]
        assert any(res["mag"]["cached"]) and not all(res["mag"]["cached"]), res["mag"]["cached"]
        assert res["fbc"]["all_reduce"] == STEPS
        assert res["mag"]["all_reduce"] == 0
        for name in ("taylorseer", "pab", "faster"):  # attention-level: the decision reads only the timestep
            assert res[name]["all_reduce"] == 0 and any(res[name]["cached"]), (name, res[name]["cached"])
        assert res["cal"]["all_reduce"] == STEPS  # every calibration step computes
        for name in ("sea", "tea"):
            assert any(res[name]["cached"]) and not all(res[name]["cached"]), (name, res[name]["cached"])
        assert res["sea"]["all_reduce"] == 0  # its indicator reads the full input every rank is given
        assert res["tea"]["all_reduce"] == STEPS  # the modulated input is token-sharded: its two means
        torch.testing.assert_close(torch.tensor(res["cal"]["ratios"]), torch.tensor(res["cal"]["ref_ratios"]),
                                   rtol=1e-5, atol=0)
    assert results[0]["fbc"]["cached"] == results[1]["fbc"]["cached"]
