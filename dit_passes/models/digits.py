"""A small, really trained Flux DiT on scikit-learn's digits, sampled through diffusers' ``FluxPipeline``.

Why it exists: the residual-cache passes skip middle blocks on steps where the first blocks' residual
barely changed. Whether that hurts can only be judged on real denoising trajectories, i.e. with a model
that was trained, not a randomly initialised one. This module holds everything needed to rebuild and
sample that model; ``bench/train_digits_dit.py`` trains it and writes the asset.

What is stored (``dit_passes/assets/digits_flux.safetensors`` + ``digits_flux.json``):

* ``transformer.*``: a diffusers ``FluxTransformer2DModel`` (4 double-stream + 8 single-stream blocks).
* ``vae.*``: a tiny diffusers ``AutoencoderKL`` (16x16x1 image <-> 8x8x4 latent), trained first. A real
  VAE lets ``FluxPipeline`` run unchanged, decode included (``output_type="pt"``); its
  ``scaling_factor`` / ``shift_factor`` are the latent statistics measured on the data set.
* ``cond.prompt_table`` [11, T, D] / ``cond.pooled_table`` [11, D]: a fixed random class-embedding
  table. Row ``c`` (0..9) is digit ``c``; row 10 is the "null" class used for label dropout during
  training, hence usable as the negative prompt of true classifier-free guidance.

Images: the 8x8 digits (values 0..16) are scaled to [0, 1] and bilinearly upsampled to 16x16.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets"
WEIGHTS_NAME = "digits_flux.safetensors"
CONFIG_NAME = "digits_flux.json"

IMAGE_SIZE = 16          # pixel side of the generated images
NUM_CLASSES = 10
NULL_LABEL = 10          # class-table row of the unconditional ("null") embedding
TEXT_TOKENS = 4          # prompt_embeds sequence length
TEXT_DIM = 32            # joint_attention_dim == pooled_projection_dim

TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=16,          # 4 latent channels x the pipeline's 2x2 packing
    out_channels=None,
    num_layers=4,            # double-stream blocks
    num_single_layers=8,     # single-stream blocks
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=TEXT_DIM,
    pooled_projection_dim=TEXT_DIM,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)

VAE_CONFIG = dict(
    in_channels=1,
    out_channels=1,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(16, 32),   # 2 levels -> FluxPipeline's vae_scale_factor = 2
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=IMAGE_SIZE,
    mid_block_add_attention=False,
    # scaling_factor / shift_factor are measured on the data by the training script
)

# Flux's own schedule: dynamic (resolution-dependent) shifting. The model is trained on t ~ U(0, 1), so
# any schedule inside [0, 1] is in distribution; this one is what FluxPipeline users get by default.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def load_digit_images(size: int = IMAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's bundled digits as ``(images [N,1,size,size] float32 in [0,1], labels [N] int64)``."""
    from sklearn.datasets import load_digits

    if size < 8:
        raise ValueError(f"size must be >= 8 (the digits are 8x8), got {size}")
    data = load_digits()
    images = torch.from_numpy(data.images.astype(np.float32) / 16.0).unsqueeze(1)
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return images.clamp(0.0, 1.0), torch.from_numpy(data.target.astype(np.int64))


def to_digit_features(images: torch.Tensor) -> np.ndarray:
    """Map [B,1,H,W] images in [0,1] to sklearn-digits features [B,64] (8x8 area average, 0..16 scale)."""
    if images.dim() != 4 or images.shape[1] != 1:
        raise ValueError(f"expected images [B,1,H,W], got shape {tuple(images.shape)}")
    small = F.adaptive_avg_pool2d(images.detach().float().cpu(), (8, 8))
    return (small.reshape(small.shape[0], 64) * 16.0).numpy()


def fit_digit_classifier():
    """A logistic regression on the digits, seen through the same 16x16 -> 8x8 round trip as samples.

    Fitting on the round-tripped images (not the raw 8x8 ones) makes a real digit and a perfect sample
    look alike to the classifier. Deterministic (lbfgs), about a second on one core.
    """
    from sklearn.linear_model import LogisticRegression

    images, labels = load_digit_images()
    clf = LogisticRegression(max_iter=3000)
    clf.fit(to_digit_features(images), labels.numpy())
    return clf


def classify(clf, images: torch.Tensor) -> np.ndarray:
    """Predicted digit for each of the [B,1,H,W] images."""
    return clf.predict(to_digit_features(images))


def make_class_table(seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed random class-embedding tables ``(prompt [11,T,D], pooled [11,D])`` (unit Gaussian)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randn(NUM_CLASSES + 1, TEXT_TOKENS, TEXT_DIM, generator=gen)
    pooled = torch.randn(NUM_CLASSES + 1, TEXT_DIM, generator=gen)
    return prompt, pooled


@dataclasses.dataclass(frozen=True)
class ClassConditioner:
    """Builds FluxPipeline's ``prompt_embeds`` / ``pooled_prompt_embeds`` for digit labels."""

    prompt_table: torch.Tensor   # [11, T, D]
    pooled_table: torch.Tensor   # [11, D]

    def __call__(self, labels: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds [B,T,D], pooled_prompt_embeds [B,D])`` for labels in 0..9 (10 = null class)."""
        idx = torch.as_tensor(list(labels) if not isinstance(labels, torch.Tensor) else labels, dtype=torch.long)
        if idx.dim() != 1 or idx.numel() == 0:
            raise ValueError(f"labels must be a non-empty 1-D list of ints, got shape {tuple(idx.shape)}")
        if int(idx.min()) < 0 or int(idx.max()) > NULL_LABEL:
            raise ValueError(f"labels must lie in 0..{NUM_CLASSES - 1} (or {NULL_LABEL} for the null class), "
                             f"got {idx.tolist()}")
        idx = idx.to(self.prompt_table.device)
        return self.prompt_table[idx], self.pooled_table[idx]

    def null(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Unconditional embeddings for ``batch`` samples (the negative prompt of true CFG)."""
        return self([NULL_LABEL] * batch)

    def to(self, device=None, dtype=None) -> "ClassConditioner":
        return ClassConditioner(self.prompt_table.to(device=device, dtype=dtype),
                                self.pooled_table.to(device=device, dtype=dtype))


def build_transformer(config: dict | None = None):
    """A freshly initialised FluxTransformer2DModel (the caller's global RNG is left untouched)."""
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        return FluxTransformer2DModel(**dict(config or TRANSFORMER_CONFIG))


def build_vae(config: dict | None = None):
    """A freshly initialised tiny AutoencoderKL (the caller's global RNG is left untouched)."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        return AutoencoderKL(**dict(config or VAE_CONFIG))


def save_asset(out_dir: Path | str, transformer, vae, cond: ClassConditioner, metadata: dict) -> tuple[Path, Path]:
    """Write the weights (safetensors, fp32, no pickle) and the JSON config/metadata; return both paths."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    tensors.update({f"vae.{k}": v for k, v in vae.state_dict().items()})
    tensors["cond.prompt_table"] = cond.prompt_table
    tensors["cond.pooled_table"] = cond.pooled_table
    tensors = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()}
    weights = out / WEIGHTS_NAME
    save_file(tensors, str(weights))
    config = {
        "transformer_config": _jsonable(dict(transformer.config)),
        "vae_config": _jsonable(dict(vae.config)),
        "scheduler_config": dict(SCHEDULER_CONFIG),
        "image_size": IMAGE_SIZE,
        "text_tokens": TEXT_TOKENS,
        "null_label": NULL_LABEL,
        **metadata,
    }
    cfg_path = out / CONFIG_NAME
    cfg_path.write_text(json.dumps(config, indent=1) + "\n")
    return weights, cfg_path


def _jsonable(config: dict) -> dict:
    # diffusers configs carry private bookkeeping keys ("_class_name", "_diffusers_version", ...)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if not k.startswith("_")}


def load_asset(asset_dir: Path | str = ASSET_DIR):
    """``(transformer, vae, cond, config_dict)`` from the stored asset, fp32 on CPU, in eval mode."""
    from safetensors.torch import load_file

    asset_dir = Path(asset_dir)
    weights, cfg_path = asset_dir / WEIGHTS_NAME, asset_dir / CONFIG_NAME
    for p in (weights, cfg_path):
        if not p.is_file():
            raise FileNotFoundError(f"digits DiT asset missing: {p}. Train it with "
                                    f"`python bench/train_digits_dit.py --out {asset_dir}`")
    config = json.loads(cfg_path.read_text())
    tensors = load_file(str(weights))
    transformer = build_transformer(config["transformer_config"])
    vae = build_vae(config["vae_config"])
    for prefix, module in (("transformer.", transformer), ("vae.", vae)):
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        module.load_state_dict(state, strict=True)  # strict: a stale asset fails loudly, never half-loads
        module.eval().requires_grad_(False)
    cond = ClassConditioner(tensors["cond.prompt_table"], tensors["cond.pooled_table"])
    return transformer, vae, cond, config


def build_pipeline(transformer, vae, scheduler_config: dict | None = None):
    """A diffusers FluxPipeline from parts: no text encoders / tokenizers (embeddings are passed in)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(**dict(scheduler_config or SCHEDULER_CONFIG))
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_digits_pipeline(device="cpu", dtype: torch.dtype = torch.float32, asset_dir: Path | str = ASSET_DIR):
    """``(pipe, cond)``: the trained digits FluxPipeline on ``device``/``dtype`` and its ClassConditioner.

    ``cond(labels)`` returns ``(prompt_embeds, pooled_prompt_embeds)``. The conditioner is also kept on
    the pipeline instance as ``pipe.digits_cond`` so that :func:`sample` needs only the pipeline.
    """
    transformer, vae, cond, config = load_asset(asset_dir)
    for module in (transformer, vae):
        module.to(device)
        if dtype != torch.float32:  # the asset is fp32; casting to fp32 again would only warn
            module.to(dtype)
    cond = cond.to(device=device, dtype=dtype)
    pipe = build_pipeline(transformer, vae, config["scheduler_config"])
    pipe.digits_cond = cond
    pipe.digits_image_size = int(config["image_size"])
    return pipe, cond


def pipeline_with(pipe, transformer=None):
    """``pipe`` with ``transformer`` denoising instead (a fresh pipeline of the same class sharing every other
    component, so ``pipe`` is never modified; ``None``: ``pipe`` itself), its cache state reset for a new
    generation when it has one (``new_generation()``, CompiledDiT)."""
    runner = pipe
    if transformer is not None:
        runner = type(pipe)(**{**pipe.components, "transformer": transformer})
        runner.set_progress_bar_config(disable=True)
    reset = getattr(runner.transformer, "new_generation", None)
    if callable(reset):
        reset()
    return runner


@torch.no_grad()
def sample(pipe, labels: Sequence[int], seed: int, steps: int = 28, transformer=None, *,
           true_cfg_scale: float = 1.0, cond: ClassConditioner | None = None) -> torch.Tensor:
    """Generate one image per label through ``FluxPipeline``; returns [B,1,H,W] float32 in [0,1] (CPU).

    ``transformer=None`` uses ``pipe.transformer``. Otherwise the given drop-in module (same keyword
    interface, ``.config``, ``.dtype``, ``.device``, ``cache_context``) denoises instead, through a fresh
    FluxPipeline sharing every other component, so ``pipe`` itself is never modified. If the denoiser
    has a ``new_generation()`` method (CompiledDiT), it is called first so no cache state leaks in from
    an earlier generation. The initial noise comes from ``torch.Generator("cpu").manual_seed(seed)``,
    so a seed gives the same noise on every device. ``true_cfg_scale > 1`` enables true classifier-free
    guidance with the null class as the negative prompt (two transformer calls per step, in the
    pipeline's "cond" / "uncond" cache contexts).
    """
    labels = [int(x) for x in labels]
    if any(not 0 <= x < NUM_CLASSES for x in labels) or not labels:
        raise ValueError(f"labels must be a non-empty list of digits 0..9, got {labels}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    cond = cond if cond is not None else getattr(pipe, "digits_cond", None)
    if cond is None:
        raise ValueError("pipe has no digits_cond: build it with load_digits_pipeline(), or pass cond=")
    size = int(getattr(pipe, "digits_image_size", IMAGE_SIZE))
    runner = pipeline_with(pipe, transformer)
    prompt_embeds, pooled = cond(labels)
    kwargs = dict(prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled, height=size, width=size,
                  num_inference_steps=steps, guidance_scale=1.0,  # no guidance embedding: ignored
                  generator=torch.Generator("cpu").manual_seed(int(seed)), output_type="pt",
                  return_dict=False)
    if true_cfg_scale != 1.0:
        neg, neg_pooled = cond.null(len(labels))
        kwargs.update(true_cfg_scale=float(true_cfg_scale), negative_prompt_embeds=neg,
                      negative_pooled_prompt_embeds=neg_pooled)
    images = runner(**kwargs)[0]
    return images.float().cpu().clamp(0.0, 1.0)
