"""DBCache under context parallelism (gloo CPU ranks): every rank takes the same decision.

The Fn residual is sharded along the sequence; the cache pass all-reduces (averages) the diff's
numerator and denominator over the parallel group before dividing, as the reference does. Each rank
compares Ulysses(2) + DBCache with the single-process DBCache on the same model and inputs.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.testing import run_ranks
from dit_passes.testing.counting import OpCounter

STEPS = 8
CFG = dict(Fn_compute_blocks=1, residual_diff_threshold=0.45, max_warmup_steps=2)


def _loop(model, kwargs, counter=None):
    outs, lat = [], kwargs["hidden_states"].clone()
    for i in range(STEPS):
        kw = dict(kwargs, hidden_states=lat, timestep=torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / STEPS)))
        with torch.no_grad():
            if counter is None:
                o = model(**kw)[0]
            else:
                with counter:
                    o = model(**kw)[0]
        outs.append(o)
        lat = lat - 0.05 * o
    return torch.stack(outs)


def _rank_fn(rank, world):
    torch.set_num_threads(1)
    zm = build("flux")
    kwargs = zm.make_inputs(batch=1, seed=2)
    single = compile_dit(zm.model, passes=[passes.DBCache(**CFG)])
    ref = _loop(single, kwargs)
    par = compile_dit(zm.model, passes=[passes.Ulysses(size=world), passes.DBCache(**CFG)])
    par.lower(**dict(kwargs, timestep=torch.full_like(kwargs["timestep"], 1000.0)))  # capture outside the count
    counter = OpCounter(["all_reduce", "all_to_all_single", "all_gather_into_tensor"])
    out = _loop(par, kwargs, counter)
    summary = par.cache_summary(as_dict=True)[-1]
    return {"rel": ((out - ref).abs().max() / ref.abs().max()).item(),
            "cached": summary["cached_steps"], "ref_cached": single.cache_summary(as_dict=True)[-1]["cached_steps"],
            "diffs": summary["residual_diffs"], "counts": dict(counter.counts),
            "attention_sites": _sites_outside_and_inside_branch(par)}


def _sites_outside_and_inside_branch(compiled):
    """Ulysses attention nodes in the main graph (the Fn blocks) and in the compute branch (the middle)."""
    gm = compiled.graph_module
    count = lambda g: sum(1 for n in g.nodes if "ulysses_attention" in str(n.target))  # noqa: E731
    return count(gm.graph), count(gm.dbcache_compute.graph)


@pytest.mark.multiproc
def test_ulysses_with_dbcache_same_decisions_on_every_rank():
    results = run_ranks(_rank_fn, 2, timeout=240)
    for rank, r in enumerate(results):
        assert r["rel"] <= 1e-5, f"rank {rank}: max relative error {r['rel']:.2e}"
        assert r["cached"] == r["ref_cached"], f"rank {rank}: cached {r['cached']} vs single process {r['ref_cached']}"
        # one all-reduce per call (the averaged diff), before the branch; nothing else reduces
        assert r["counts"].get("all_reduce", 0) == STEPS, f"rank {rank}: {r['counts']}"
    assert results[0]["cached"], "nothing cached: the test would not show agreement"
    assert results[0]["cached"] == results[1]["cached"]
    assert results[0]["diffs"] == results[1]["diffs"]
    # the attention collectives run only on computed steps: 4 all-to-alls per attention site each
    computed = STEPS - len(results[0]["cached"])
    sites = results[0]["attention_sites"]
    assert results[0]["counts"]["cond"] == STEPS
    assert results[0]["counts"]["all_to_all_single"] == 4 * computed * sites[1] + 4 * STEPS * sites[0]
