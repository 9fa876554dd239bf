"""SVDQuant DQ with few-shot smoothing (cache-dit 1.5.3's ``svdq_kwargs["smooth_strategy"] = "few_shot"``).

* the relaxation and smoothing (every relax strategy) equal cache-dit 1.5.3's own ``_apply_few_shot_relaxation`` on
  the same spans and weight, within fp32 rounding;
* through ``enable_cache``: the first ``few_shot_steps`` forwards give the unquantized model's outputs and record
  exactly the input abs-max that forward hooks on a copy of the model record; the next forward equals a copy whose
  selected linears are SVDQuant linears built with smoothing factors computed here from those hook spans;
* with DBCache the residual cache keeps its state across the re-lowering; bad keys and values are refused;
* on two Ulysses ranks (gloo) the ranks' spans are merged, so each quantizes from the whole sequence's spans.
Tiny FLUX (hidden 128, two double and two single blocks): seconds on one core.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from dit_passes.frontend import DBCacheConfig, QuantizeConfig, enable_cache, strify
from dit_passes.quant.few_shot import RELAX_STRATEGIES, few_shot_smoothing
from dit_passes.quant.svdquant import prepare_svdquant, svdq_w4a4_linear_reference

pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402

torch.set_num_threads(1)
TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16


def tiny_flux(num_layers: int = 2, num_single_layers: int = 2) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CH, num_layers=num_layers,
                                  num_single_layers=num_single_layers,
                                  attention_head_dim=64, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=POOLED_DIM, guidance_embeds=True,
                                  axes_dims_rope=(16, 24, 24)).eval()


def inputs(seed: int, t: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, IN_CH, generator=g) * (1 + seed),
                encoder_hidden_states=torch.randn(1, 7, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(1, POOLED_DIM, generator=g), timestep=torch.tensor([t]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(7, 3), guidance=torch.tensor([3.5]),
                return_dict=False)


def run(module, seed: int, t: float = 0.5):
    with torch.no_grad():
        return module(**inputs(seed, t))[0]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def spans_with_outliers(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(k, generator=g) * 2
    a[torch.randperm(k, generator=g)[:5]] *= 40  # a few outlier channels, as DiT activations have
    a[3] = 0.0  # a channel that never lit up: its factor is repaired to 1
    return a


@pytest.mark.parametrize("strategy", [*RELAX_STRATEGIES, "top_q4"])
def test_relaxation_matches_cache_dit(strategy):
    quantizer = pytest.importorskip("cache_dit.quantization.svdquant.quantizer")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=g)
    w[:, 7] = 0.0  # a dead weight column: infinite factor, repaired to 1
    span = spans_with_outliers(128, 2)
    ours, ours_obs = few_shot_smoothing(span, w, alpha=0.5, relax_factor=2.0, relax_top_ratio=0.3,
                                        relax_strategy=strategy)
    theirs, theirs_obs = quantizer._apply_few_shot_relaxation(span, w.abs().amax(dim=0), alpha=0.5, relax_factor=2.0,
                                                              relax_top_ratio=0.3, relax_strategy=strategy,
                                                              math_dtype=torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=0)
    torch.testing.assert_close(ours_obs, theirs_obs, rtol=2e-6, atol=0)
    assert ours[3] == 1 and ours[7] == 1
    if strategy != "fixed":  # the relaxation moved the large channels, never shrank one
        assert (ours >= ours_obs * (1 - 1e-6)).all() and (ours > ours_obs * 1.05).any()
    else:
        assert torch.equal(ours, ours_obs)


def _hook_spans(model, paths, calls):
    """The input abs-max of each linear in ``paths`` over ``calls`` forwards of ``model``, by forward pre-hooks."""
    spans = {}

    def hook(path):
        def fn(_mod, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            spans[path] = a if path not in spans else torch.maximum(spans[path], a)
        return fn
    handles = [model.get_submodule(p).register_forward_pre_hook(hook(p)) for p in paths]
    try:
        outs = [run(model, seed) for seed in calls]
    finally:
        for h in handles:
            h.remove()
    return spans, outs


class _Quantized(torch.nn.Module):
    def __init__(self, q):
        super().__init__()
        self.q = q

    def forward(self, x):
        return svdq_w4a4_linear_reference(x, self.q)


def test_few_shot_through_enable_cache_equals_smoothing_from_the_observed_spans():
    tr = tiny_flux()
    ref = copy.deepcopy(tr)  # the wrapper releases the quantized weights from tr
    kw = {"smooth_strategy": "few_shot", "few_shot_steps": 2, "few_shot_relax_strategy": "top",
          "few_shot_relax_factor": 2.0, "few_shot_relax_top_ratio": 0.2}
    cfg = QuantizeConfig(quant_type="svdq_int4_r8_dq", svdq_kwargs=kw)
    wrapper = enable_cache(tr, quantize_config=cfg)
    assert strify(wrapper) == "svdq_int4_r8_dq_few_shot_top"
    collected = [run(wrapper, 0)]  # the two observed forwards: the unquantized model
    code = wrapper.code
    assert code.count("few_shot_observe.default(") == 34 and "svdq_w4a4_linear" not in code  # nothing quantized yet
    session = wrapper.report("svdquant_w4a4_few_shot")
    assert session.collecting and session.completed_forwards == 1
    collected.append(run(wrapper, 1))
    assert not session.collecting and session.completed_forwards == 2 and not wrapper.released
    paths = sorted(session.observed())
    assert len(paths) == 34 and not any("norm" in p for p in paths)  # the block linears, not the AdaLN ones
    spans, want = _hook_spans(ref, paths, (0, 1))
    for got, w in zip(collected, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    for p in paths:
        assert torch.equal(session.observed()[p], spans[p]), p
    quantized = run(wrapper, 2)  # lowered again: quantized from the spans
    assert wrapper.code.count("svdq_w4a4_linear.default(") == 34
    assert all(f"{p}.weight" in wrapper.released for p in paths)
    unquantized = run(ref, 2)
    for p in paths:  # the same smoothing, computed here: "top" multiplies the top 20 % spans by 2
        lin = ref.get_submodule(p)
        a = spans[p]
        a = torch.where(a >= torch.quantile(a, 0.8), a * 2.0, a)
        s = a.sqrt() / lin.weight.detach().abs().amax(dim=0).sqrt()
        s = torch.where((s == 0) | ~torch.isfinite(s), torch.ones_like(s), s)
        q = prepare_svdquant(lin.weight.detach(), lin.bias.detach(), rank=8, smooth_scale=s, dtype=torch.float32)
        parent, _, name = p.rpartition(".")
        setattr(ref.get_submodule(parent), name, _Quantized(q))
    expected = run(ref, 2)
    torch.testing.assert_close(quantized, expected, rtol=1e-5, atol=1e-5)
    assert 0 < rel(quantized, unquantized) < 0.05, rel(quantized, unquantized)  # measured ~0.02
    plain = run(enable_cache(copy.deepcopy(tiny_flux()), quantize_config=QuantizeConfig(
        quant_type="svdq_int4_r8_dq")), 2)  # identity smoothing: other numbers
    assert not torch.allclose(plain, quantized, rtol=1e-3, atol=1e-4)
    assert torch.equal(run(wrapper, 2), quantized)  # built once, reused


def test_few_shot_keeps_the_residual_cache_across_the_relowering():
    tr = tiny_flux()
    cache = DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1,
                          residual_diff_threshold=10.0)  # every step after the warmup one may be cached
    wrapper = enable_cache(tr, cache_config=cache, quantize_config=QuantizeConfig(
        quant_type="svdq_int4_r8_dq", svdq_kwargs={"smooth_strategy": "few_shot"}))
    outs = [run(wrapper, 0, t) for t in (1.0, 0.75, 0.5)]
    session = wrapper.report("svdquant_w4a4_few_shot")
    assert session.completed_forwards == 1 and not session.collecting
    assert "svdq_w4a4_linear" in wrapper.code
    # step 0 computed (and observed) everything; steps 1 and 2 reuse its residual: the store outlived the graph
    assert [bool(c) for c in wrapper.cache_report().last_generation()["step_cached"]] == [False, True, True]
    assert not torch.equal(outs[1], outs[0])


def test_few_shot_keys_and_values_are_checked(caplog):
    dq = "svdq_int4_r8_dq"
    p = QuantizeConfig(quant_type=dq, svdq_kwargs={"smooth_strategy": "FEW_SHOT",
                                                  "few_shot_relax_strategy": "top_q4"}).to_pass()
    assert (p.smooth, p.few_shot) == ("few_shot", {"steps": 1, "relax_factor": 1.5, "relax_top_ratio": 0.25,
                                                   "relax_strategy": "top"})  # cache-dit's defaults
    assert QuantizeConfig(quant_type="svdq_nvfp4_r8_dq", svdq_kwargs={"smooth_strategy": "few_shot"}
                          ).to_pass().precision == "nvfp4"
    bad = [({"few_shot_steps": 0}, "few_shot_steps'] must be a positive int"),
           ({"few_shot_steps": None}, "few_shot_steps'] must be a positive int"),
           ({"few_shot_relax_factor": 0.5}, r"few_shot_relax_factor'] must be a finite number >= 1.0"),
           ({"few_shot_relax_top_ratio": 0.0}, r"few_shot_relax_top_ratio'] must lie in \(0, 1\]"),
           ({"few_shot_relax_top_ratio": 1.5}, r"few_shot_relax_top_ratio'] must lie in \(0, 1\]"),
           ({"few_shot_relax_strategy": "median"}, "few_shot_relax_strategy'] must be one of"),
           ({"few_shot_count": 2}, "unknown key 'few_shot_count'"),
           ({"smooth_strategy": "fewshot"}, r"'fewshot' is not valid for svdq_int4_r8_dq: use one of")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            QuantizeConfig(quant_type=dq, svdq_kwargs={"smooth_strategy": "few_shot", **kw})
    with pytest.raises(TypeError, match="few_shot_auto_compile"):
        QuantizeConfig(quant_type=dq, svdq_kwargs={"smooth_strategy": "few_shot", "few_shot_auto_compile": "yes"})
    with pytest.raises(ValueError, match="'few_shot' is not valid for svdq_int4_r8: use one of \\['activation'\\]"):
        QuantizeConfig(quant_type="svdq_int4_r8", svdq_kwargs={"smooth_strategy": "few_shot"},
                       calibrate_fn=lambda: None, serialize_to="/nonexistent")
    with pytest.warns(UserWarning, match="read only with smooth_strategy='few_shot'"):  # as the reference
        p = QuantizeConfig(quant_type=dq, svdq_kwargs={"few_shot_steps": 3, "few_shot_auto_compile": True}).to_pass()
    assert p.smooth == "none"
    with caplog.at_level(logging.WARNING, logger="dit_passes"):
        QuantizeConfig(quant_type=dq, svdq_kwargs={"smooth_strategy": "few_shot", "few_shot_relax_factor": 4.0})
    assert "is aggressive" in caplog.text


def _ulysses_rank(rank, world):
    from dit_passes.frontend import ParallelismConfig
    cfg = dict(quant_type="svdq_int4_r8_dq", svdq_kwargs={"smooth_strategy": "few_shot", "few_shot_steps": 2})
    single = enable_cache(tiny_flux(), quantize_config=QuantizeConfig(**cfg))
    sharded = enable_cache(tiny_flux(), quantize_config=QuantizeConfig(**cfg),
                           parallelism_config=ParallelismConfig(ulysses_size=world))
    out = {"single": [run(single, s) for s in range(3)], "sharded": [run(sharded, s) for s in range(3)]}
    out["spans"] = sharded.report("svdquant_w4a4_few_shot").observed()
    out["single_spans"] = single.report("svdquant_w4a4_few_shot").observed()
    out["quantized"] = sharded.code.count("svdq_w4a4_linear.default(")
    return out


@pytest.mark.multiproc
def test_few_shot_under_ulysses_merges_the_ranks_spans():
    """Each Ulysses rank sees half the tokens; the spans are merged (max over the sequence group) before quantizing,
    so every rank quantizes from the whole sequence's spans: the single-process ones up to the fp32 rounding of the
    sharded attention (a rank's own spans would miss the other half's maxima)."""
    from dit_passes.testing import run_ranks
    for rank, r in enumerate(run_ranks(_ulysses_rank, 2, timeout=300)):
        assert r["quantized"] == 34 and sorted(r["spans"]) == sorted(r["single_spans"]), rank
        for p, want in r["single_spans"].items():
            torch.testing.assert_close(r["spans"][p], want, rtol=1e-5, atol=1e-6)
        for step, (got, want) in enumerate(zip(r["sharded"], r["single"])):
            # observed steps: the unquantized model, exact up to fp32 rounding; the quantized one: spans equal up to
            # rounding can flip a few int4 roundings (measured 1.2e-3)
            assert rel(got, want) < (1e-5 if step < 2 else 1e-2), (rank, step, rel(got, want))


def test_the_observing_graph_runs_eagerly_and_the_quantized_one_compiled():
    """torch.cond refuses the observe ops' mutation under torch.compile: the observing graph is marked eager_only,
    the graph lowered after it is compiled as asked (here whole, with the residual cache's torch.cond; without the
    mark aot_eager fails on the observing graph). One block of each stream: the mark and the cond do not depend on
    the depth, and the compile of the quantized graph (most of the time) scales with it."""
    from dit_passes import compile_dit, passes

    def build(**kw):
        return compile_dit(tiny_flux(num_layers=1, num_single_layers=1), passes=[
            passes.SVDQuantFewShot(rank=8, steps=2, exclude=("modulation",)),
            passes.DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1,
                           residual_diff_threshold=0.0)], **kw)  # threshold 0: every step computed
    eager, compiled = build(), build(torch_compile={"backend": "aot_eager"})
    want = [run(eager, s) for s in range(3)]
    got = [run(compiled, 0)]
    assert compiled._current().runner is None and compiled.report("svdquant_w4a4_few_shot").collecting
    got += [run(compiled, 1), run(compiled, 2)]
    assert compiled._current().runner is not None and "svdq_w4a4_linear" in compiled.code
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
