"""Tiny diffusers pipelines for tests and CPU benchmarks: a FluxPipeline with no text encoders (embeddings
are passed in) around a given transformer and a small random AutoencoderKL (3 channels, 4 latent channels,
scale factor 2)."""
from __future__ import annotations

from typing import Any, Optional

import torch


def tiny_vae(seed: int = 1):
    from diffusers import AutoencoderKL
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                             norm_num_groups=4, layers_per_block=1, shift_factor=0.0).eval()


def flux_pipeline(transformer: torch.nn.Module, vae: Optional[Any] = None, text_encoder_2: Optional[Any] = None):
    """``FluxPipeline`` around ``transformer`` (a Flux transformer with in_channels=16: 4 latent channels packed
    2x2), the tiny VAE unless one is given, and no tokenizers; progress bar off."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae if vae is not None else tiny_vae(),
                        text_encoder=None, tokenizer=None, text_encoder_2=text_encoder_2, tokenizer_2=None,
                        transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


__all__ = ["tiny_vae", "flux_pipeline"]
