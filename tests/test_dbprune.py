"""The DBPrune graph pass, side by side with cache-dit 1.5.3's dynamic block pruning on the zoo's tiny DiTs.

The reference is cache-dit's ``enable_cache(transformer, cache_config=DBPruneConfig(...))`` on a copy of the same
transformer (transformer-only mode: ``num_inference_steps`` set). Both see identical inputs; per call we assert
the same pruned blocks (count per step, and which: a recorded diff below the threshold), the same recorded diffs
(every block's, in order) and outputs within fp32 rounding.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.cache.config import DBPruneConfig, FoCaCalibratorConfig
from dit_passes.cache.prune import last_pruned
from dit_passes.infra.pass_base import PassError
from dit_passes.models.zoo import build

cache_dit = pytest.importorskip("cache_dit")
from cache_dit import steps_mask as ref_steps_mask  # noqa: E402
from test_dbcache_pass import assert_same, step_loop  # noqa: E402

logging.getLogger("cache_dit").setLevel(logging.ERROR)
STEPS = 8

CONFIGS = {
    # the dynamic threshold raises a block's threshold from the diffs recorded before it in the step
    "dynamic": dict(Fn_compute_blocks=1, residual_diff_threshold=0.1, max_warmup_steps=2,
                    enable_dynamic_prune_threshold=True),
    # the dynamic threshold's relax ratio and its cap (binding: below the default cap of 2x the threshold)
    "dynamic_relaxed": dict(Fn_compute_blocks=1, residual_diff_threshold=0.1, max_warmup_steps=2,
                            enable_dynamic_prune_threshold=True, dynamic_prune_threshold_relax_ratio=1.5,
                            max_dynamic_prune_threshold=0.13),
    # Bn, a kept block in the middle, both step caps (the continuous cap counts earlier steps only)
    "caps": dict(Fn_compute_blocks=1, Bn_compute_blocks=1, non_prune_block_ids=[2], residual_diff_threshold=0.2,
                 max_warmup_steps=1, max_cached_steps=5, max_continuous_cached_steps=2),
    # a dynamic mask with threshold >= 1: every reached block prunes, recording -1
    "mask_always": dict(Fn_compute_blocks=1, residual_diff_threshold=1.0, max_warmup_steps=4,
                        steps_computation_mask=ref_steps_mask(total_steps=STEPS, mask_policy="medium")),
    "mask_static": dict(Fn_compute_blocks=2, steps_computation_policy="static",
                        steps_computation_mask=ref_steps_mask(total_steps=STEPS, mask_policy="fast")),
}
FAMILIES = {"flux": {}, "wan": dict(num_layers=5), "qwenimage": dict(num_layers=4)}
CASES = [("flux", "dynamic"), ("wan", "caps"), ("wan", "mask_always"), ("qwenimage", "dynamic_relaxed"),
         ("qwenimage", "mask_static")]


def reference_run(model, kwargs, cfg, calls_per_step=1):
    ref = copy.deepcopy(model)
    cache_dit.enable_cache(ref, cache_config=cache_dit.DBPruneConfig(num_inference_steps=STEPS, **cfg))
    out = step_loop(ref, kwargs, STEPS, calls_per_step)
    return out, cache_dit.summary(ref, logging=False)[0]


def ours_run(model, kwargs, cfg, calls_per_step=1, contexts=("default",), calibrator=None):
    compiled = compile_dit(model, passes=[passes.DBPrune(num_inference_steps=STEPS, calibrator=calibrator, **cfg)])
    records = {c: [] for c in contexts}
    calls = []

    def record():
        ctx = contexts[len(calls) % len(contexts)]
        calls.append(ctx)
        records[ctx].append(last_pruned(compiled.runtime.state["dbprune"], ctx))

    out = step_loop(compiled, kwargs, STEPS, calls_per_step, after_call=record)
    return out, records, compiled.runtime.state["dbprune"]


def assert_same_as_reference(records, pruned_blocks, residual_diffs, threshold, pruned_steps):
    """``records``: ours per call; the rest: the reference's summary of the same context."""
    assert [sum(r["pruned"]) for r in records] == pruned_blocks
    ours_steps = [i for i, r in enumerate(records) if any(r["pruned"])]
    assert ours_steps == pruned_steps
    ours_diffs = {str(i): [d for d in r["diffs"] if d is not None] for i, r in enumerate(records)}
    ours_diffs = {k: v for k, v in ours_diffs.items() if v}
    assert ours_diffs.keys() == residual_diffs.keys()
    for k, v in residual_diffs.items():
        assert ours_diffs[k] == pytest.approx(v, rel=1e-5), k
    for r in records:  # which blocks: a recorded diff below the (static) threshold prunes
        for p, d in zip(r["pruned"], r["diffs"]):
            if d is not None and threshold is not None:
                assert p == (d < threshold or d == -1.0)


@pytest.mark.parity("DBPruneConfig", "DBPruneConfig.enable_dynamic_prune_threshold",
                    "DBPruneConfig.non_prune_block_ids", "DBPruneConfig.max_dynamic_prune_threshold",
                    "DBPruneConfig.dynamic_prune_threshold_relax_ratio")
@pytest.mark.reference
@pytest.mark.parametrize("family, name", CASES)
def test_dbprune_matches_cache_dit(family, name):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    cfg = dict(CONFIGS[name], enable_separate_cfg=False)
    ref, ref_stats = reference_run(zm.model, kwargs, cfg)
    ours, records, store = ours_run(zm.model, kwargs, cfg)
    records = records["default"]
    assert sum(ref_stats.pruned_blocks) >= 2, f"{name}: the reference pruned too little to test anything"
    if name == "dynamic_relaxed":  # the ratio and the cap change the decisions: the test tells them apart
        _, other = reference_run(zm.model, kwargs, dict(CONFIGS["dynamic"], enable_separate_cfg=False))
        assert other.pruned_blocks != ref_stats.pruned_blocks
    static = None if cfg.get("enable_dynamic_prune_threshold") else cfg.get("residual_diff_threshold", 0.08)
    assert_same_as_reference(records, ref_stats.pruned_blocks, dict(ref_stats.residual_diffs), static,
                             ref_stats.pruned_steps)
    assert store.summary()[-1]["cached_steps"] == ref_stats.cached_steps
    assert store.fidelity_stats()["executed_block_fraction"] == pytest.approx(1 - ref_stats.pruned_ratio)
    assert_same(ref, ours, rel=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize("foca", [False, True], ids=["plain", "foca"])
def test_dbprune_separate_cfg_by_call_parity_matches_cache_dit(foca):
    """Two calls per step without named contexts: the CFG branch (odd calls) keeps its own blocks' state (with a
    calibrator: its own calibrator states, the reference's ``cfg_calibrator``)."""
    zm = build("wan", num_layers=3)
    kwargs = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.12, max_warmup_steps=2, enable_separate_cfg=True)
    ref_model = copy.deepcopy(zm.model)
    cache_dit.enable_cache(ref_model, cache_config=cache_dit.DBPruneConfig(num_inference_steps=STEPS, **cfg),
                           calibrator_config=cache_dit.FoCaCalibratorConfig() if foca else None)
    ref = step_loop(ref_model, kwargs, STEPS, calls_per_step=2)
    st = cache_dit.summary(ref_model, logging=False)[0]
    ours, records, _ = ours_run(zm.model, kwargs, cfg, calls_per_step=2, contexts=("non_cfg", "cfg"),
                                calibrator=FoCaCalibratorConfig() if foca else None)
    assert_same_as_reference(records["non_cfg"], st.pruned_blocks, dict(st.residual_diffs), 0.12, st.pruned_steps)
    assert_same_as_reference(records["cfg"], st.cfg_pruned_blocks, dict(st.cfg_residual_diffs), 0.12,
                             st.cfg_pruned_steps)
    assert sum(st.pruned_blocks) and sum(st.cfg_pruned_blocks), "nothing pruned: the test tells nothing apart"
    assert_same(ref, ours, rel=1e-5)
    if foca:  # the reference without it is far off: the forecast was used
        plain, _ = reference_run(zm.model, kwargs, cfg, calls_per_step=2)
        assert (plain - ref).abs().max() > 100 * (ours - ref).abs().max(), "FoCa made no difference"


# -- with a calibrator: each block's residual forecast from its own calibrator state ---------------------------
CAL_STEPS = 10
# decisions that differ between blocks (the dynamic threshold, or diffs near the threshold), so blocks forecast from
# different last computed steps, with runs of two pruned steps (elapsed 1 and 2)
CAL_CASES = {
    # through enable_cache, cache-dit's config classes converted; TaylorSeer of order 2 on the image stream only (a
    # dual-stream block whose image stream leaves second: the calibrator's stream 0 is the image one)
    "flux-taylorseer": ("flux", "TaylorSeerCalibratorConfig", dict(taylorseer_order=2, enable_encoder_calibrator=False),
                        dict(Fn_compute_blocks=1, residual_diff_threshold=0.06, max_warmup_steps=4,
                             max_continuous_cached_steps=3, enable_dynamic_prune_threshold=True)),
    "wan-foca": ("wan", "FoCaCalibratorConfig", {}, dict(
        Fn_compute_blocks=1, residual_diff_threshold=0.035, max_warmup_steps=3, max_continuous_cached_steps=3)),
    # the DMD forecast from the warm-up's 4 evenly spaced residuals, the Taylor fallback after uneven ones; the
    # decision compares every 4th channel (force_reduce_calibrator_vram, as the reference)
    "qwenimage-dmd": ("qwenimage", "DMDCalibratorConfig", dict(dmd_history=4), dict(
        Fn_compute_blocks=1, residual_diff_threshold=0.06, max_warmup_steps=4, max_continuous_cached_steps=2,
        enable_dynamic_prune_threshold=True, force_reduce_calibrator_vram=True)),
}


@pytest.mark.parity("DBPruneConfig.force_reduce_calibrator_vram")
@pytest.mark.reference
@pytest.mark.parametrize("case", list(CAL_CASES))
def test_dbprune_with_calibrator_matches_cache_dit(case):
    """Per call the same pruned blocks and diffs as cache-dit with the same calibrator, outputs within fp32 rounding;
    the tags as the reference's."""
    import dit_passes
    from dit_passes.cache import config as ours_config

    family, cls, cal_kw, cfg = CAL_CASES[case]
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    theirs = getattr(cache_dit, cls)(**cal_kw)
    prune_cfg = dict(cfg, num_inference_steps=CAL_STEPS, enable_separate_cfg=False)
    runs = {}
    for name, cal in (("ref", theirs), ("ref_plain", None)):
        model = copy.deepcopy(zm.model)
        cache_dit.enable_cache(model, cache_config=cache_dit.DBPruneConfig(**prune_cfg), calibrator_config=cal)
        runs[name] = (step_loop(model, kwargs, CAL_STEPS), cache_dit.summary(model, logging=False)[0], model)
    ref, st, ref_model = runs["ref"]
    if family == "flux":
        compiled = dit_passes.enable_cache(zm.model, cache_config=cache_dit.DBPruneConfig(**prune_cfg),
                                           calibrator_config=theirs)
    else:
        compiled = compile_dit(zm.model, passes=[passes.DBPrune(
            calibrator=getattr(ours_config, cls)(**cal_kw), **prune_cfg)])
    records = []
    ours = step_loop(compiled, kwargs, CAL_STEPS,
                     after_call=lambda: records.append(last_pruned(compiled.runtime.state["dbprune"])))
    assert len({tuple(r["pruned"]) for r in records if 0 < sum(r["pruned"]) < len(r["pruned"])}) >= 1, \
        f"no step pruned only some blocks: {[r['pruned'] for r in records]}"
    assert_same_as_reference(records, st.pruned_blocks, dict(st.residual_diffs), None, st.pruned_steps)
    assert_same(ref, ours, rel=1e-5)
    plain = runs["ref_plain"][0]
    assert (plain - ref).abs().max() > 100 * (ours - ref).abs().max(), "the calibrator made no difference"
    if family == "flux":
        tag = cache_dit.strify(ref_model)
        assert dit_passes.strify(compiled) == tag and f"_{theirs.strify()}_S" in tag, tag
        assert isinstance(compiled.runtime.state["frontend"].calibrator_config, ours_config.TaylorSeerCalibratorConfig)


def test_dbprune_forecasts_in_the_pruned_arm_only():
    """A block's calibrator forecast is formed in its cond's pruned arm: DMD's SVD runs once per pruned block and
    call, and on no call where every block computed (a forecast formed by the decide module ran on every call)."""
    from dit_passes.cache.config import DMDCalibratorConfig
    from dit_passes.testing.counting import OpCounter

    zm = build("wan", num_layers=5)
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.035, max_warmup_steps=4, max_continuous_cached_steps=3,
               num_inference_steps=CAL_STEPS, enable_separate_cfg=False)
    compiled = compile_dit(zm.model, passes=[passes.DBPrune(calibrator=DMDCalibratorConfig(dmd_history=4), **cfg)])
    totals, pruned = [], []
    with OpCounter(["svd"]) as counter:
        def record():
            totals.append(counter.counts["svd"])
            pruned.append(sum(last_pruned(compiled.runtime.state["dbprune"])["pruned"]))
        step_loop(compiled, zm.make_inputs(), CAL_STEPS, after_call=record)
    per_call = [b - a for a, b in zip([0] + totals, totals)]
    # computed calls once the DMD history is full (a forecast could be formed), and calls pruning only some blocks
    assert 0 in pruned[4:] and any(0 < p < 4 for p in pruned), f"the test tells nothing apart: {pruned}"
    per_forecast = max(per_call) // max(pruned)
    assert per_forecast > 0 and per_call == [per_forecast * p for p in pruned], (per_call, pruned)


def test_dbprune_graph_and_refusals():
    """One cond per prunable block; the decisions need no host read; configs the reference mishandles refuse."""
    zm = build("wan", num_layers=4)
    kwargs = zm.make_inputs()
    compiled = compile_dit(zm.model, passes=[passes.DBPrune(Fn_compute_blocks=1, non_prune_block_ids=[3],
                                                            max_warmup_steps=0)])
    with torch.no_grad():
        compiled(**kwargs)
    gm = compiled.graph_module
    conds = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == 2  # blocks 1 and 2 (0 is Fn, 3 is kept)
    assert not any(n.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)
                   for n in gm.graph.nodes)
    assert compiled.report("dbprune") is not None
    with pytest.raises(ValueError, match="enable_separate_cfg"):
        DBPruneConfig(enable_separate_cfg=True, enable_dynamic_prune_threshold=True)
    with pytest.raises(ValueError, match="cache_type"):
        passes.DBCache(cache_type="DBPrune")
    with pytest.raises(TypeError, match="TaylorSeerCalibratorConfig"):
        passes.DBPrune(calibrator=object())
    with pytest.raises(ValueError, match="calibrator_cache_type"):
        passes.DBPrune(calibrator=FoCaCalibratorConfig(calibrator_cache_type="hidden_states"))
    everything_kept = compile_dit(build("wan", num_layers=2).model, passes=[passes.DBPrune(Fn_compute_blocks=1,
                                                                                           Bn_compute_blocks=1)])
    with pytest.raises(PassError, match="no block can be pruned"):
        everything_kept.lower(**build("wan", num_layers=2).make_inputs())


# -- through the front end, on a real FluxPipeline ----------------------------------------------------------
@pytest.mark.reference
def test_enable_cache_dbprune_matches_cache_dit():
    from test_frontend import rel_err as latents_err, run, tiny_flux, tiny_pipe

    import dit_passes
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.2, max_warmup_steps=2,
               enable_dynamic_prune_threshold=True)
    tr = tiny_flux()
    ref_pipe = tiny_pipe(copy.deepcopy(tr))
    cache_dit.enable_cache(ref_pipe, cache_config=cache_dit.DBPruneConfig(**cfg))
    ref = run(ref_pipe)
    ref_st = cache_dit.summary(ref_pipe, logging=False)[0]

    pipe = tiny_pipe(tr)
    dit_passes.enable_cache(pipe, cache_config=dit_passes.DBPruneConfig(**cfg))
    ours = run(pipe)
    st = dit_passes.summary(pipe, logging=False)[0]
    assert sum(ref_st.pruned_blocks) >= 2, f"the reference pruned too little to test anything: {ref_st.pruned_blocks}"
    for k in ("pruned_steps", "pruned_blocks", "actual_blocks", "cached_steps", "cfg_pruned_blocks"):
        assert getattr(st, k) == getattr(ref_st, k), k
    assert st.pruned_ratio == pytest.approx(ref_st.pruned_ratio)
    assert st.residual_diffs.keys() == ref_st.residual_diffs.keys()
    for k, v in ref_st.residual_diffs.items():
        assert st.residual_diffs[k] == pytest.approx(v, rel=1e-5), k
    assert latents_err(ours, ref) <= 1e-5
    # the reference's tag of its transformer's stats (strify(pipe) reads its last, empty, Flux block list's)
    percent = round(100 * ref_st.pruned_ratio, 2)
    assert dit_passes.strify(pipe) == cache_dit.strify(ref_st) == \
        f"DBPrune_F1B1_W2I1M0MC0_R0.2_P{percent}_T0O0_S{len(ref_st.pruned_steps)}"
    # a migrating user's cache-dit DBPruneConfig is taken as it is
    other = tiny_pipe(tiny_flux())
    dit_passes.enable_cache(other, cache_config=cache_dit.DBPruneConfig(**cfg))
    assert other.transformer.runtime.state["frontend"].cache_config == dit_passes.DBPruneConfig(**cfg)  # None kept
