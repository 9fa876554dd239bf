"""``disable_cache`` restores the original exactly, with use_ray=True: an instance-level ``forward``
that existed before ``enable_cache`` (here diffusers' own HookRegistry hook, which installs ``module.forward`` on
the instance, as accelerate's offload hooks do) must still be there after ``disable_cache``: popping ``forward`` /
``to`` / ``cuda`` / ``cpu`` from the transformer's ``__dict__`` for every Ray engine, or routing to the proxy without
saving what was there, would lose it. No Ray: ``RayLauncher.launch`` returns a stand-in engine. The front end
restores exactly what it set."""
from __future__ import annotations

import pytest
import torch

import dit_passes as cache_dit
from dit_passes.launch.ray_launcher import RayLauncher
from dit_passes.launch.wrappers import RayTransformerProxy
from dit_passes.models.zoo import build
from dit_passes.testing.pipelines import flux_pipeline


class _Engine:
    world_size = 2

    def as_transformer(self, index=0):
        return RayTransformerProxy(self, {"in_channels": 16}, torch.float32, index=index)

    def shutdown(self):
        pass


@pytest.mark.parametrize("target", ["pipeline", "bare_transformer"])
def test_disable_cache_keeps_a_preexisting_instance_forward(monkeypatch, target):
    from diffusers.hooks import HookRegistry, ModelHook

    monkeypatch.setattr(RayLauncher, "launch", lambda self, obj, passes=(), **kw: _Engine())
    pipe = flux_pipeline(build("flux").model)
    tr = pipe.transformer
    HookRegistry.check_if_exists_or_initialize(tr).register_hook(ModelHook(), "user_hook")
    hooked = tr.__dict__["forward"]
    obj = pipe if target == "pipeline" else tr
    cache_dit.enable_cache(obj, parallelism_config=cache_dit.ParallelismConfig(ulysses_size=2, use_ray=True))
    cache_dit.disable_cache(obj)
    assert pipe.transformer is tr
    assert tr.__dict__.get("forward") is hooked
