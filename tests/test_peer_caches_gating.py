"""SeaCache side by side with diffusers 0.42's hook, TeaCache against a pure-python transcription of the paper's rule.

SeaCache: diffusers' own hook (``model.enable_cache(SeaCacheConfig(...))``) on a copy of the same fp32 CPU
transformer, called under ``cache_context(name, step_index=i, sigma=s, num_inference_steps=N)`` as Wan's
pipeline does; for 3-D token inputs it gets a ``raw_vision_callback`` giving the square token grid (what our
pass builds itself). Its decision after each call: the context's ``consecutive_cached`` (> 0 iff skipped).

TeaCache has no diffusers hook: :class:`TeaRule` is the paper's rule as its FLUX code writes it, driven by
forward hooks on an eager copy (block 0's ``norm1`` output is the modulated input; a skipped step replaces
the last block's image output by block 0's input + the stored residual, which is what skipping the blocks
returns). Same per-step decisions, outputs within 1e-5 relative. Thresholds come from the run's own
distances so that some steps skip and some compute (asserted).
"""
from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from test_peer_caches import FAMILIES, STEPS, assert_close, denoise  # noqa: E402 - tests folder on sys.path

hooks = pytest.importorskip("diffusers.hooks")
torch.set_num_threads(1)  # CI: 2 xdist workers and the rank tests share 2 cores; a second thread only spins


def _grid(module, args, kwargs):
    """diffusers' raw_vision_callback for [B, L, D] tokens: one (D, 1, sqrt L, sqrt L) latent per sample."""
    x = kwargs["hidden_states"]
    side = math.isqrt(x.shape[1])
    return [s.reshape(side, side, -1).permute(2, 0, 1).unsqueeze(1) for s in x]


def _sea_reference(model, kwargs, fields, contexts=("cond",)):
    ref = copy.deepcopy(model)
    callback = _grid if kwargs["hidden_states"].dim() == 3 else None
    ref.enable_cache(hooks.SeaCacheConfig(**fields, raw_vision_callback=callback))
    leader = next(m for n, m in ref.named_children() if isinstance(m, torch.nn.ModuleList) and "block" in n)[0]
    hook = leader._diffusers_hook.get_hook("sea_cache_leader_block")
    outs, cached = [], []
    for g in range(2):
        lat = kwargs["hidden_states"] + 0.3 * g
        for i in range(STEPS):
            t = torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / STEPS))
            for c, name in enumerate(contexts):
                kw = dict(kwargs, hidden_states=lat, timestep=t,
                          encoder_hidden_states=kwargs["encoder_hidden_states"] * (1.0 - 0.5 * c))
                with torch.no_grad(), ref.cache_context(name, step_index=i, sigma=float(t[0]) / 1000.0,
                                                        num_inference_steps=STEPS):
                    o = ref(**kw)[0]
                    cached.append(hook.state_manager.get_state().consecutive_cached > 0)
                outs.append(o)
            lat = lat - 0.05 * o.reshape(lat.shape)
        ref._reset_stateful_cache()
    return torch.stack(outs), cached


def _ours(model, kwargs, pass_, name, **kw):
    compiled = compile_dit(model, passes=[pass_])
    out, _ = denoise(compiled, kwargs, **kw)
    return out, [r["cached"] for r in compiled.report(name).stats.records()], compiled


def _sea_threshold(model, kwargs, fields):
    """1.5x the median one-step distance: single steps skip, two accumulated ones mostly compute."""
    probe = compile_dit(model, passes=[passes.SeaCache(**dict(fields, threshold=0.0))])
    denoise(probe, kwargs, generations=1)
    return 1.5 * statistics.median(d for d in probe.report("sea_cache").last_generation()["step_diffs"]
                                   if d is not None and d == d)


SEA = {"o1": dict(residual_order=1, retention_steps=1, cache_end_steps=1, max_consecutive_cached=2),
       "o0_nocap": dict(residual_order=0, retention_steps=2, cache_end_steps=0, max_consecutive_cached=0,
                        power_exp=2.0)}


@pytest.mark.parity("diffusers.SeaCacheConfig", "diffusers.SeaCacheConfig.threshold",
                    "diffusers.SeaCacheConfig.residual_order", "diffusers.SeaCacheConfig.retention_steps",
                    "diffusers.SeaCacheConfig.cache_end_steps", "diffusers.SeaCacheConfig.max_consecutive_cached",
                    "diffusers.SeaCacheConfig.power_exp")
@pytest.mark.parametrize("family,config", [("flux", "o1"), ("wan", "o1"), ("qwenimage", "o0_nocap")])
def test_sea_cache_matches_diffusers(family, config):
    zm = build(family, **FAMILIES[family])
    kwargs = zm.make_inputs()
    fields = dict(dict(power_exp=3.0), **SEA[config])
    ours_extra = dict(num_inference_steps=STEPS, timestep_scale=1000.0)
    threshold = _sea_threshold(zm.model, kwargs, dict(fields, **ours_extra))
    ref_out, ref_cached = _sea_reference(zm.model, kwargs, dict(fields, threshold=threshold))
    out, cached, compiled = _ours(zm.model, kwargs, passes.SeaCache(threshold=threshold, **fields, **ours_extra),
                                  "sea_cache")
    assert any(ref_cached) and not all(ref_cached), f"threshold {threshold} should skip some steps: {ref_cached}"
    assert cached == ref_cached
    assert_close(ref_out, out)
    assert "sea_cache_decide" in compiled.code and ".item()" not in compiled.code


def test_sea_cache_per_context():
    zm = build("flux")
    kwargs = zm.make_inputs()
    fields = dict(SEA["o1"], max_consecutive_cached=3)
    extra = dict(num_inference_steps=STEPS, timestep_scale=1000.0)
    threshold = _sea_threshold(zm.model, kwargs, dict(fields, **extra))
    ref_out, ref_cached = _sea_reference(zm.model, kwargs, dict(fields, threshold=threshold), ("cond", "uncond"))
    out, cached, _ = _ours(zm.model, kwargs, passes.SeaCache(threshold=threshold, **fields, **extra), "sea_cache",
                           contexts=("cond", "uncond"))
    assert any(ref_cached) and not all(ref_cached)
    assert cached == ref_cached
    assert_close(ref_out, out)


class TeaRule:
    """TeaCache's rule, as the paper's TeaCache4FLUX writes it (one per cache context)."""

    def __init__(self, threshold, num_steps, coefficients):
        self.threshold, self.num_steps, self.coefficients = threshold, num_steps, coefficients
        self.cnt, self.acc, self.prev, self.residual = 0, 0.0, None, None

    def poly(self, x):
        y = 0.0
        for c in self.coefficients:
            y = y * x + c
        return y

    def should_calc(self, modulated):
        if self.cnt == 0 or self.cnt == self.num_steps - 1:
            calc, self.acc = True, 0.0
        else:
            rel = ((modulated - self.prev).abs().mean() / self.prev.abs().mean()).item()
            self.acc += self.poly(rel)
            calc = not self.acc < self.threshold
            if calc:
                self.acc = 0.0
        self.prev = modulated
        self.cnt = 0 if self.cnt + 1 == self.num_steps else self.cnt + 1
        return calc


def _tea_reference(model, kwargs, threshold, coefficients):
    ref = copy.deepcopy(model)
    rule = TeaRule(threshold, STEPS, coefficients)
    first, last = ref.transformer_blocks[0], ref.single_transformer_blocks[-1]
    call = {}

    def enter(_, args, kw):
        call["h_in"] = kw["hidden_states"]

    def modulated(_, args, out):
        call["calc"] = rule.should_calc(out[0])

    def leave(_, args, out):
        h_in = call["h_in"]
        i = next(k for k, o in enumerate(out) if o.shape == h_in.shape)
        if call["calc"]:
            rule.residual = out[i] - h_in
            return out
        return tuple(h_in + rule.residual if k == i else o for k, o in enumerate(out))

    first.register_forward_pre_hook(enter, with_kwargs=True)
    first.norm1.register_forward_hook(modulated)
    last.register_forward_hook(leave)
    return denoise(ref, kwargs, probe=lambda: not call["calc"])


@pytest.mark.parametrize("coefficients", [None, (1.0, 0.0)], ids=["paper_flux", "identity"])
def test_tea_cache_matches_paper_rule(coefficients):
    zm = build("flux")
    kwargs = zm.make_inputs()
    coeffs = {} if coefficients is None else {"coefficients": coefficients}
    probe = compile_dit(zm.model, passes=[passes.TeaCache(threshold=-1e30, num_inference_steps=STEPS, **coeffs)])
    denoise(probe, kwargs, generations=1)
    diffs = [d for d in probe.report("tea_cache").last_generation()["step_diffs"] if d is not None and d == d]
    threshold = 1.5 * statistics.median(diffs)
    pass_ = passes.TeaCache(threshold=threshold, num_inference_steps=STEPS, **coeffs)
    ref_out, ref_cached = _tea_reference(zm.model, kwargs, threshold, pass_.config.coefficients)
    out, cached, compiled = _ours(zm.model, kwargs, pass_, "tea_cache")
    assert any(ref_cached) and not all(ref_cached), f"threshold {threshold} should skip some steps: {ref_cached}"
    assert cached == ref_cached
    assert_close(ref_out, out)
    assert "tea_cache_decide" in compiled.code and ".item()" not in compiled.code
    assert compiled.report("tea_cache").fidelity_stats()["executed_block_fraction"] < 1.0


@pytest.mark.parity("diffusers.SeaCacheConfig.raw_vision_callback", status="refused")
def test_frontend_and_refusals():
    import dit_passes as cache_dit
    from dit_passes.infra.pass_base import PassError
    zm = build("flux")
    wrapped = cache_dit.enable_cache(zm.model, cache_config=hooks.SeaCacheConfig(cache_end_steps=0, threshold=0.3))
    assert [p.name for p in wrapped.passes] == ["sea_cache"]
    assert isinstance(wrapped.passes[0].config, cache_dit.SeaCacheConfig) and wrapped.passes[0].config.threshold == 0.3
    denoise(wrapped, zm.make_inputs(), generations=1)
    assert cache_dit.strify(cache_dit.summary(wrapped, logging=False)[0]).startswith("SeaCache_R0.3")
    cache_dit.disable_cache(wrapped)
    tea = cache_dit.enable_cache(zm.model, cache_config=cache_dit.TeaCacheConfig(threshold=0.4, num_inference_steps=4))
    assert [p.name for p in tea.passes] == ["tea_cache"]
    cache_dit.disable_cache(tea)
    with pytest.raises(ValueError, match="num_inference_steps"):  # diffusers reads N from the cache context
        cache_dit.enable_cache(zm.model, cache_config=hooks.SeaCacheConfig())
    with pytest.raises(ValueError, match="raw_vision_callback: a host callback cannot run inside the graph"):
        passes.SeaCache(raw_vision_callback=_grid, cache_end_steps=0)
    with pytest.raises(ValueError, match="coefficients"):
        cache_dit.TeaCacheConfig(coefficients=[])
    with pytest.raises(PassError, match="sea_cache: hidden_states of shape"):
        compile_dit(zm.model, passes=[passes.SeaCache(cache_end_steps=0)],
                    example_inputs=dict(zm.make_inputs(), hidden_states=torch.randn(1, 15, 16),
                                        img_ids=torch.zeros(15, 3)))
