"""``models/flux_plain.FluxDiT`` (the diffusers-free FLUX the GPU benchmark builds) is diffusers' FLUX: the same
state dict keys, the same output bit for bit on the zoo's tiny Flux (with and without guidance, odd token counts,
batch 2), and the same graph structure for the passes (block lists, linear roles)."""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.models.flux_plain import FLUX_DEV, FluxDiT
from dit_passes.models.zoo import build, config_for
from dit_passes.passes.quantize import Fp8Linear

torch.set_num_threads(1)


def _pair(**overrides):
    zm = build("flux", **overrides)
    plain = FluxDiT(**{**config_for("flux"), **overrides}).eval()
    missing, unexpected = plain.load_state_dict(zm.model.state_dict(), strict=True)
    assert not missing and not unexpected
    return zm, plain


@pytest.mark.parametrize("guidance,variant,batch", [(True, "default", 1), (False, "odd_tokens", 2)])
def test_same_function_as_diffusers(guidance, variant, batch):
    zm, plain = _pair(guidance_embeds=guidance)
    assert set(plain.state_dict()) == set(zm.model.state_dict())
    kw = zm.make_inputs(batch=batch, variant=variant)
    with torch.no_grad():
        want = zm.model(**kw)[0]
        got = plain(**kw)[0]
    assert torch.equal(got, want)


def test_passes_see_the_same_structure():
    zm, plain = _pair()
    kw = zm.make_inputs()
    counts, outs = [], []
    for model in (zm.model, plain):
        c = compile_dit(model, passes=[Fp8Linear(exclude=())], example_inputs=kw)
        counts.append(c._current().manager.records[-1].result.counts)
        with torch.no_grad():
            outs.append(c(**kw)[0])
    assert counts[0] == counts[1] and counts[0]["replaced"] == 40  # every linear of every role replaced alike
    assert torch.equal(outs[0], outs[1])


def test_flux_dev_size_on_meta():
    with torch.device("meta"):
        model = FluxDiT(**FLUX_DEV)
    assert sum(p.numel() for p in model.parameters()) == 11_901_408_320  # FLUX.1-dev (bench/results/capture_flux_full)
