"""PyramidAttentionBroadcast and FasterCache passes side by side with diffusers 0.42's hooks on the same tiny
transformers (fp32 CPU, the denoising loop of ``test_peer_caches``: falling timestep 1000 .. 125, two
generations with the pipeline's reset between them).

Per call we count which attention modules ran in the reference (a forward hook on each hooked module's ``to_q``)
and compare with our per-call decisions and executed-attention fraction; outputs agree within 1e-5 relative.
The configs' ranges are chosen so that some steps reuse and some compute (asserted).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.infra.pass_base import PassError
from dit_passes.models.zoo import build
from test_peer_caches import STEPS, assert_close, denoise  # noqa: E402 - the tests folder is on sys.path

hooks = pytest.importorskip("diffusers.hooks")
_HOOK_NAMES = ("pyramid_attention_broadcast", "faster_cache_block")


class _Plain(torch.nn.Module):
    """A model without diffusers' CacheMixin (PixArt) in the loop: no cache contexts (one state either way)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)

    def cache_context(self, name):
        return contextlib.nullcontext()


def reference(model, kwargs, config, **kw):
    """diffusers' hooks on a copy; returns outputs, per call whether any hooked module reused, and the
    fraction of hooked-module calls that computed."""
    ref = copy.deepcopy(model)
    now = {}
    config.current_timestep_callback = lambda: now["t"]
    ref.register_forward_pre_hook(lambda m, a, k: now.update(t=float(k["timestep"].reshape(-1)[0])),
                                  with_kwargs=True)
    if isinstance(config, hooks.FasterCacheConfig):
        for m in ref.modules():  # its temporal check reads the attribute without getattr's default (the spatial
            if type(m).__name__.endswith("Attention") and not hasattr(m, "is_cross_attention"):  # one has False)
                m.is_cross_attention = False
        hooks.apply_faster_cache(ref, config)
    else:
        hooks.apply_pyramid_attention_broadcast(ref, config)
    hooked = [m for _, m in ref.named_modules() if getattr(m, "_diffusers_hook", None) is not None
              and any(m._diffusers_hook.get_hook(h) is not None for h in _HOOK_NAMES)]
    ran = []  # the batch of each hooked module's computation this call
    for m in hooked:
        m.to_q.register_forward_hook(lambda mod, args, out: ran.append(args[0].shape[0]))
    per_call = []
    batch = kwargs["hidden_states"].shape[0]

    def probe():
        """Reused: a hooked module did not compute, or FasterCache ran the conditional half alone."""
        per_call.append(len(ran))
        cached = len(ran) < len(hooked) or any(b < batch for b in ran)
        ran.clear()
        return cached

    reset = hooks.HookRegistry.check_if_exists_or_initialize(ref).reset_stateful_hooks
    out, reused = denoise(ref if hasattr(ref, "cache_context") else _Plain(ref), kwargs, probe=probe, reset=reset, **kw)
    return out, reused, sum(per_call) / (len(per_call) * len(hooked)), len(hooked)


def ours(model, kwargs, pass_, **kw):
    compiled = compile_dit(model, passes=[pass_])
    out, _ = denoise(compiled, kwargs, **kw)
    report = compiled.report(pass_.name)
    return out, [r["cached"] for r in report.stats.records()], compiled


def _check(family, ref_config, pass_, batch=1, generations=2):
    zm = build(family, **({"out_channels": 4} if family == "pixart" else {}))  # the loop adds the output to latents
    kwargs = zm.make_inputs(batch=batch)
    ref_out, ref_reused, ref_frac, hooked = reference(zm.model, kwargs, ref_config, generations=generations)
    out, reused, compiled = ours(zm.model, kwargs, pass_, generations=generations)
    assert any(ref_reused) and not all(ref_reused), ref_reused
    assert reused == ref_reused
    assert_close(ref_out, out)
    stats = compiled.fidelity_stats()  # the last generation
    assert stats["executed_attention_fraction"] == pytest.approx(
        ref_frac if generations == 1 else _last_generation_fraction(zm.model, kwargs, ref_config))
    assert compiled.graph_module.graph is not None and ".item()" not in compiled.code
    conds = sum(1 for n in compiled.graph_module.graph.nodes if n.target is torch.ops.higher_order.cond)
    assert conds == hooked
    return zm, kwargs, compiled, out


def _last_generation_fraction(model, kwargs, config):
    return reference(model, kwargs, copy.copy(config), generations=1)[2]


PAB = {"flux_s2": ("flux", dict(spatial_attention_block_skip_range=2)),
       "flux_s3_range": ("flux", dict(spatial_attention_block_skip_range=3,
                                      spatial_attention_timestep_skip_range=(200, 900))),
       "pixart_cross": ("pixart", dict(spatial_attention_block_skip_range=3, cross_attention_block_skip_range=2,
                                       cross_attention_timestep_skip_range=(50, 1000))),
       # the kinds by identifiers: Flux's single-stream blocks' attention as "temporal" (own range and schedule),
       # PixArt's cross attention of block 0 only
       "flux_temporal_ids": ("flux", dict(spatial_attention_block_skip_range=2,
                                          spatial_attention_block_identifiers=(r"^transformer_blocks",),
                                          temporal_attention_block_skip_range=3,
                                          temporal_attention_timestep_skip_range=(50, 700),
                                          temporal_attention_block_identifiers=(r"^single_transformer_blocks",))),
       "pixart_cross_ids": ("pixart", dict(cross_attention_block_skip_range=3,
                                           cross_attention_timestep_skip_range=(50, 900),
                                           cross_attention_block_identifiers=(r"transformer_blocks\.0\.",)))}


@pytest.mark.parity("diffusers.PyramidAttentionBroadcastConfig",
                    "diffusers.PyramidAttentionBroadcastConfig.spatial_attention_block_skip_range",
                    "diffusers.PyramidAttentionBroadcastConfig.spatial_attention_timestep_skip_range",
                    "diffusers.PyramidAttentionBroadcastConfig.spatial_attention_block_identifiers",
                    "diffusers.PyramidAttentionBroadcastConfig.temporal_attention_block_skip_range",
                    "diffusers.PyramidAttentionBroadcastConfig.temporal_attention_timestep_skip_range",
                    "diffusers.PyramidAttentionBroadcastConfig.temporal_attention_block_identifiers",
                    "diffusers.PyramidAttentionBroadcastConfig.cross_attention_block_skip_range",
                    "diffusers.PyramidAttentionBroadcastConfig.cross_attention_timestep_skip_range",
                    "diffusers.PyramidAttentionBroadcastConfig.cross_attention_block_identifiers")
@pytest.mark.parametrize("case", list(PAB))
def test_pab_matches_diffusers(case):
    family, fields = PAB[case]
    _, _, compiled, out = _check(family, hooks.PyramidAttentionBroadcastConfig(**fields),
                                 passes.PyramidAttentionBroadcast(**fields))
    if case == "pixart_cross":  # attn2 (cross attention, found in the graph) and attn1 follow different schedules
        assert "reuse_cross" in compiled.code and "reuse_spatial" in compiled.code


FASTER_DISTILLED = {"spatial": dict(spatial_attention_block_skip_range=2, is_guidance_distilled=True,
                                    attention_weight=0.3),
                    # Flux's single-stream blocks' attention as "temporal": its own schedule and range
                    "temporal_ids": dict(spatial_attention_block_skip_range=3, is_guidance_distilled=True,
                                         attention_weight=0.3,
                                         spatial_attention_block_identifiers=(r"^transformer_blocks.*attn",),
                                         temporal_attention_block_skip_range=2,
                                         temporal_attention_timestep_skip_range=(-1, 700),
                                         temporal_attention_block_identifiers=(r"^single_transformer_blocks.*attn",))}


@pytest.mark.parity("diffusers.FasterCacheConfig", "diffusers.FasterCacheConfig.is_guidance_distilled",
                    "diffusers.FasterCacheConfig.spatial_attention_block_skip_range",
                    "diffusers.FasterCacheConfig.spatial_attention_block_identifiers",
                    "diffusers.FasterCacheConfig.temporal_attention_block_skip_range",
                    "diffusers.FasterCacheConfig.temporal_attention_timestep_skip_range",
                    "diffusers.FasterCacheConfig.temporal_attention_block_identifiers")
@pytest.mark.parametrize("case", list(FASTER_DISTILLED))
def test_faster_cache_distilled_matches_diffusers(case):
    fields = FASTER_DISTILLED[case]
    ref_fields = {k: v for k, v in fields.items() if k != "attention_weight"}
    cfg = hooks.FasterCacheConfig(**ref_fields, attention_weight_callback=lambda _: 0.3)
    zm, kwargs, _, out = _check("flux", cfg, passes.FasterCache(**fields))
    plain, _ = denoise(zm.model, kwargs)
    assert ((plain - out).abs().max() / plain.abs().max()).item() > 1e-4  # the extrapolation changes outputs


@pytest.mark.parity("diffusers.FasterCacheConfig.spatial_attention_timestep_skip_range",
                    "diffusers.FasterCacheConfig.unconditional_batch_skip_range",
                    "diffusers.FasterCacheConfig.unconditional_batch_timestep_skip_range",
                    "diffusers.FasterCacheConfig.low_frequency_weight_update_timestep_range",
                    "diffusers.FasterCacheConfig.high_frequency_weight_update_timestep_range",
                    "diffusers.FasterCacheConfig.alpha_low_frequency", "diffusers.FasterCacheConfig.alpha_high_frequency",
                    "diffusers.FasterCacheConfig.tensor_format", "diffusers.FasterCacheConfig.is_guidance_distilled")
def test_faster_cache_cfg_batch_matches_diffusers():
    """Not distilled, a batched CFG call (batch 2: unconditional row first): the unconditional half is
    approximated in frequency space on the steps diffusers skips it, and attention is reused only there."""
    fields = dict(spatial_attention_block_skip_range=2, unconditional_batch_skip_range=3,
                  unconditional_batch_timestep_skip_range=(-1, 900), spatial_attention_timestep_skip_range=(-1, 800),
                  low_frequency_weight_update_timestep_range=(99, 700),
                  high_frequency_weight_update_timestep_range=(-1, 500),
                  alpha_low_frequency=1.2, alpha_high_frequency=1.05, tensor_format="BCHW")
    cfg = hooks.FasterCacheConfig(**fields, attention_weight_callback=lambda _: 0.5)
    zm, kwargs, compiled, out = _check("pixart", cfg, passes.FasterCache(**fields), batch=2)
    assert "faster_cache_guidance" in compiled.code
    cached = compiled.report("faster_cache").last_generation()["step_cached"]
    assert cached == [False, True, True, False, True, True, False, True]  # step % 3 != 0 (t < 900 from step 1)
    plain, _ = denoise(_Plain(zm.model), kwargs)
    assert ((plain - out)[:, 0].abs().max() / plain.abs().max()).item() > 1e-4  # the approximated half differs


def test_pab_state_per_cache_context():
    """CFG's cond / uncond calls (cache contexts) each count their own calls and keep their own outputs (diffusers'
    PAB keeps one state per module, which the two contexts would share)."""
    zm = build("flux")
    pab = passes.PyramidAttentionBroadcast(spatial_attention_block_skip_range=2)
    _, cached, _ = ours(zm.model, zm.make_inputs(), pab, generations=1, contexts=("cond", "uncond"))
    expected = [False, False, False, True, False, True, False, True]  # t in (100, 800) from step 2; odd steps reuse
    assert cached[0::2] == expected and cached[1::2] == expected


@pytest.mark.parity("diffusers.FasterCacheConfig.attention_weight_callback",
                    "diffusers.FasterCacheConfig.low_frequency_weight_callback",
                    "diffusers.FasterCacheConfig.high_frequency_weight_callback", "diffusers.TextKVCacheConfig",
                    status="refused")
def test_frontend_and_refusals():
    import dit_passes as cache_dit
    zm = build("flux")
    wrapped = cache_dit.enable_cache(zm.model, cache_config=hooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=3))
    assert [p.name for p in wrapped.passes] == ["pab"]
    assert wrapped.passes[0].config.spatial_attention_block_skip_range == 3
    denoise(wrapped, zm.make_inputs(), generations=1)
    assert cache_dit.summary(wrapped, logging=False)[0].cached_steps == [2, 4, 5, 7]  # t in (100, 800), step % 3
    assert cache_dit.strify(wrapped).startswith("PAB_S3")
    cache_dit.disable_cache(wrapped)
    fc = cache_dit.enable_cache(zm.model, cache_config=cache_dit.FasterCacheConfig(is_guidance_distilled=True))
    assert [p.name for p in fc.passes] == ["faster_cache"]
    for callback in ("attention_weight_callback", "low_frequency_weight_callback", "high_frequency_weight_callback"):
        with pytest.raises(ValueError, match=f"{callback}.*callbacks called every step.*attention_weight="):
            cache_dit.enable_cache(zm.model, cache_config=hooks.FasterCacheConfig(**{callback: lambda _: 0.3}))
    with pytest.raises(ValueError, match="TextKVCacheConfig is not offered.*diffusers itself"):
        cache_dit.enable_cache(zm.model, cache_config=hooks.TextKVCacheConfig())
    with pytest.raises(ValueError, match="TextKVCacheConfig is not offered"):
        cache_dit.enable_cache(zm.model, cache_config=cache_dit.TextKVCacheConfig())
    with pytest.raises(PassError, match="batched CFG"):  # Flux's output is (B, S, C) tokens, batch 1
        compile_dit(zm.model, passes=[passes.FasterCache()], example_inputs=zm.make_inputs())
    with pytest.warns(UserWarning, match="timestep_scale=1000"):  # the zoo's Flux inputs carry t / 1000, as Flux's
        compile_dit(zm.model, passes=[passes.PyramidAttentionBroadcast()], example_inputs=zm.make_inputs())
    with pytest.raises(PassError, match="no attention module"):
        compile_dit(zm.model, example_inputs=zm.make_inputs(),
                    passes=[passes.PyramidAttentionBroadcast(spatial_attention_block_identifiers=("nothing",))])


@pytest.mark.parity("enable_cache", "diffusers.PyramidAttentionBroadcastConfig.current_timestep_callback",
                    "diffusers.FasterCacheConfig.current_timestep_callback")
@pytest.mark.parametrize("kind", ["pab", "faster"])
def test_pipeline_timestep_units_match_diffusers(kind):
    """A FluxPipeline passes t / 1000 to its transformer while the ranges are in the scheduler's units: diffusers'
    hooks read ``pipe.current_timestep`` through the callback; ``enable_cache(pipe, ...)`` takes the same units from
    the pipeline (the scale read at the first call), so the same steps reuse and the latents agree."""
    from test_frontend import rel_err, run, tiny_flux  # noqa: E402 - the tests folder is on sys.path
    from dit_passes.testing.pipelines import flux_pipeline
    import dit_passes as cache_dit

    fields = (dict(spatial_attention_block_skip_range=2) if kind == "pab" else
              dict(spatial_attention_block_skip_range=2, is_guidance_distilled=True,
                   spatial_attention_timestep_skip_range=(-1, 900)))
    make = hooks.PyramidAttentionBroadcastConfig if kind == "pab" else hooks.FasterCacheConfig
    tr = tiny_flux()
    plain = run(flux_pipeline(copy.deepcopy(tr)))
    ref_pipe = flux_pipeline(copy.deepcopy(tr))
    cfg = make(**fields, current_timestep_callback=lambda: ref_pipe.current_timestep)
    (hooks.apply_pyramid_attention_broadcast if kind == "pab" else hooks.apply_faster_cache)(ref_pipe.transformer, cfg)
    ref = run(ref_pipe)
    assert rel_err(ref, plain) > 1e-4, "diffusers' hooks reused nothing: the comparison would not exercise it"

    pipe = flux_pipeline(tr)
    cache_dit.enable_cache(pipe, cache_config=make(**fields))  # no callback: the pipeline's own timestep
    assert rel_err(run(pipe), ref) <= 1e-4
    assert cache_dit.summary(pipe, logging=False)[0].cached_steps
    cache_dit.disable_cache(pipe)
    if kind == "faster":
        return
    own = flux_pipeline(copy.deepcopy(tr))  # the user's callback, as diffusers' docs write it
    cache_dit.enable_cache(own, cache_config=make(**fields, current_timestep_callback=lambda: own.current_timestep))
    assert rel_err(run(own), ref) <= 1e-4
    with pytest.raises(ValueError, match="not both"):
        cache_dit.PyramidAttentionBroadcastConfig(current_timestep_callback=lambda: 1.0, timestep_scale=1000)
