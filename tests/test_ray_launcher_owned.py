"""RayLauncher starting (and stopping) Ray itself, with a runtime_env that makes a user module importable.

The other Ray tests share a cluster their fixture starts; here no Ray runs before the launch, so the
launcher's own ``ray.init`` path is used: its runtime_env is job-wide, the factory lives in a module
importable only through that PYTHONPATH, and ``shutdown()`` must stop Ray and leave no process behind.
"""
from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

ray = pytest.importorskip("ray")
from dit_passes.launch.ray_launcher import RayLauncher  # noqa: E402
from dit_passes.passes.context_parallel import Ulysses  # noqa: E402
from dit_passes.testing.ray_cluster import wait_gone  # noqa: E402

pytestmark = pytest.mark.ray

USER_MODULE = textwrap.dedent('''
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from dit_passes.models.zoo import build

    def make_pipeline():
        transformer = build("flux").model
        torch.manual_seed(1)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                            latent_channels=4, norm_num_groups=4, layers_per_block=1).eval()
        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                            tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call_kwargs():
        g = torch.Generator().manual_seed(0)
        return dict(prompt_embeds=torch.randn(1, 7, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                    height=16, width=16, num_inference_steps=2, guidance_scale=3.5, output_type="latent",
                    generator=torch.Generator().manual_seed(3))
''')


def test_launcher_owned_ray_runtime_env_and_clean_shutdown(tmp_path):
    if ray.is_initialized():
        pytest.skip("a Ray cluster from another test is still running in this process")
    user_dir = tmp_path / "user_code"
    user_dir.mkdir()
    (user_dir / "dp_user_pipeline.py").write_text(USER_MODULE)
    sys.path.insert(0, str(user_dir))  # the driver imports it too; the workers only through runtime_env
    try:
        import dp_user_pipeline as user
        with torch.inference_mode():
            reference = user.make_pipeline()(**user.call_kwargs()).images
        engine = RayLauncher(world_size=2, runtime_env={"env_vars": {"PYTHONPATH": str(user_dir)}},
                             timeout_s=120).launch(user.make_pipeline, passes=[Ulysses(2)])
        temp_dir = engine._ray_temp_dir
        try:
            assert engine._owns_ray and temp_dir and ray.is_initialized()
            latents = engine(**user.call_kwargs()).images
            files = engine.run_on_workers(lambda worker: __import__("dp_user_pipeline").__file__)
            assert all(f.startswith(str(user_dir)) for f in files), files
        finally:
            engine.shutdown()
        torch.testing.assert_close(latents, reference, rtol=0, atol=1e-5)
        assert not ray.is_initialized(), "the launcher started Ray, so shutdown() must stop it"
        assert not wait_gone(temp_dir), "Ray processes left behind"
        assert not os.path.exists(temp_dir), "the launcher's Ray temp dir was not removed"
    finally:
        sys.path.remove(str(user_dir))
        sys.modules.pop("dp_user_pipeline", None)
