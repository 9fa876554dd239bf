"""Tiny image-transformer families of the zoo: flux, flux2, sd3, qwenimage, chroma, sana, pixart,
zimage, lumina2.

Each ``_<family>_inputs`` writes the exact keyword arguments of the model"s ``forward`` the way the
matching diffusers pipeline calls it (packed latents and 2-D ids for Flux, ``img_shapes`` lists for
QwenImage, lists of per-sample tensors for Z-Image, ...). Configs keep 2 heads of 16 channels (hidden
size 32) and 2 blocks per list so that a forward takes milliseconds on one CPU core.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from dit_passes.models.zoo_common import (
    FamilySpec,
    cfg_rows,
    grid_ids,
    image_text_tokens,
    inner_width,
    text_mask,
    text_rows,
    timestep_rows,
    with_flag_inputs,
)

HEADS = 2
HEAD_DIM = 16
DIM = HEADS * HEAD_DIM  # 32
TEXT_DIM = 32
ROPE_3AXES = (4, 6, 6)  # sums to HEAD_DIM; every axis even, as the rotary helpers require

# Variant size tables. "grid" is the token grid (rows, cols) after patchification.
_PACKED_SIZES = {
    "default": {"grid": (4, 4), "text": 8},
    "alt_resolution": {"grid": (6, 8), "text": 8},
    "alt_text_len": {"grid": (4, 4), "text": 12},
    # 25 image tokens, 8 text tokens: image and joint (33) lengths are odd, for context-parallel tests
    "odd_tokens": {"grid": (5, 5), "text": 8},
}
_PATCH2_SIZES = {
    "default": {"grid": (4, 4), "text": 8},
    "alt_resolution": {"grid": (6, 4), "text": 8},
    "alt_text_len": {"grid": (4, 4), "text": 12},
}


def _grid_tokens(config: Mapping[str, Any], sizes: Mapping[str, Any]) -> dict:
    h, w = sizes["grid"]
    return image_text_tokens(h * w, sizes["text"])


# ----------------------------------------------------------------------------------------------- flux
def _flux_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    out = {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        "pooled_projections": text_rows(gen, batch, config["pooled_projection_dim"]),
        # FluxPipeline passes t / 1000 (the model multiplies by 1000) and 2-D ids (3-D is deprecated)
        "timestep": timestep_rows(gen, batch, 1.0),
        "img_ids": grid_ids(1, h, w),
        "txt_ids": torch.zeros(text, 3),
    }
    if config.get("guidance_embeds"):
        out["guidance"] = torch.full((batch,), 3.5)
    out["return_dict"] = False
    return out


FLUX = FamilySpec(
    name="flux",
    class_name="FluxTransformer2DModel",
    config=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
                guidance_embeds=True, axes_dims_rope=ROPE_3AXES),
    inputs=_flux_inputs,
    sizes_by_variant=_PACKED_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 2,
        # FluxSingleTransformerBlock takes and returns (encoder, image) and concatenates inside
        "streams_per_list": {"transformer_blocks": 2, "single_transformer_blocks": 2},
        "attention_per_block": {"transformer_blocks": 1, "single_transformer_blocks": 1},
        "joint_attention": True,
        "odd_variant": "odd_tokens",
    },
    block_list_keys={"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    pipeline_class="FluxPipeline",
)


# ---------------------------------------------------------------------------------------------- flux2
def _flux2_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text, dtype=torch.float32)
    out = {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        "timestep": timestep_rows(gen, batch, 1.0),
        # Flux2Pipeline passes batched (B, S, 4) ids laid out as (t, h, w, l)
        "img_ids": grid_ids(1, h, w, extra_axes=1).unsqueeze(0).expand(batch, -1, -1).contiguous(),
        "txt_ids": txt_ids.unsqueeze(0).expand(batch, -1, -1).contiguous(),
    }
    if config.get("guidance_embeds"):
        out["guidance"] = torch.full((batch,), 4.0)
    out["return_dict"] = False
    return out


FLUX2 = FamilySpec(
    name="flux2",
    class_name="Flux2Transformer2DModel",
    config=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, timestep_guidance_channels=32,
                mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True),
    inputs=_flux2_inputs,
    sizes_by_variant=_PACKED_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 2,
        # Flux2 concatenates text+image once before the single blocks, which take one stream
        "streams_per_list": {"transformer_blocks": 2, "single_transformer_blocks": 1},
        "attention_per_block": {"transformer_blocks": 1, "single_transformer_blocks": 1},
        "joint_attention": True,
        "odd_variant": "odd_tokens",
    },
    block_list_keys={"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    pipeline_class="Flux2Pipeline",
)


# ------------------------------------------------------------------------------------------------ sd3
def _sd3_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    p = config["patch_size"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], h * p, w * p),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["joint_attention_dim"]),
        "pooled_projections": text_rows(gen, batch, config["pooled_projection_dim"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "return_dict": False,
    }


SD3 = FamilySpec(
    name="sd3",
    class_name="SD3Transformer2DModel",
    # pos_embed_max_size=16 allows token grids up to 16x16; qk_norm as in SD3.5
    config=dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, caption_projection_dim=DIM,
                pooled_projection_dim=TEXT_DIM, out_channels=4, pos_embed_max_size=16, qk_norm="rms_norm"),
    inputs=_sd3_inputs,
    sizes_by_variant=_PATCH2_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 2,
        "streams_per_list": {"transformer_blocks": 2},
        "attention_per_block": {"transformer_blocks": 1},
        "joint_attention": True,
        # the last JointTransformerBlock is context_pre_only: its text stream output is None
        "context_pre_only_last": True,
    },
    block_list_keys={"transformer_blocks": "num_layers"},
    pipeline_class="StableDiffusion3Pipeline",
    tied_config=inner_width("caption_projection_dim"),  # the text stream joins the image one at heads x head_dim
)


# ------------------------------------------------------------------------------------------ qwenimage
def _qwenimage_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    return {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        "encoder_hidden_states_mask": text_mask(batch, text, torch.long),
        "timestep": timestep_rows(gen, batch, 1.0),
        # QwenImagePipeline: one list of (frames, rows, cols) per sample
        "img_shapes": [[(1, h, w)] for _ in range(batch)],
        "return_dict": False,
    }


QWENIMAGE = FamilySpec(
    name="qwenimage",
    class_name="QwenImageTransformer2DModel",
    # in_channels = 4 latent channels * 2x2 packing; out_channels * patch^2 == in_channels
    config=dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, axes_dims_rope=ROPE_3AXES),
    # Qwen-Image-Layered's flag (the layered variant): an is-RGB condition per sample
    inputs=with_flag_inputs(_qwenimage_inputs, {"use_additional_t_cond": lambda config, batch, out, gen: {
        "additional_t_cond": torch.zeros(batch, dtype=torch.long)}}),
    sizes_by_variant=_PACKED_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 2,
        "streams_per_list": {"transformer_blocks": 2},
        "attention_per_block": {"transformer_blocks": 1},
        "joint_attention": True,
        "odd_variant": "odd_tokens",
    },
    block_list_keys={"transformer_blocks": "num_layers"},
    pipeline_class="QwenImagePipeline",
)


# --------------------------------------------------------------------------------------------- chroma
def _chroma_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    # ChromaPipeline: text mask extended with ones for the image tokens, order [text, image]
    mask = torch.cat([text_mask(batch, text), torch.ones(batch, h * w, dtype=torch.bool)], dim=1)
    return {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        "timestep": timestep_rows(gen, batch, 1.0),
        "img_ids": grid_ids(1, h, w),
        "txt_ids": torch.zeros(text, 3),
        "attention_mask": mask,
        "return_dict": False,
    }


CHROMA = FamilySpec(
    name="chroma",
    class_name="ChromaTransformer2DModel",
    config=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, axes_dims_rope=ROPE_3AXES,
                approximator_num_channels=32, approximator_hidden_dim=32, approximator_layers=2),
    inputs=_chroma_inputs,
    sizes_by_variant=_PACKED_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 2,
        "streams_per_list": {"transformer_blocks": 2, "single_transformer_blocks": 2},
        "attention_per_block": {"transformer_blocks": 1, "single_transformer_blocks": 1},
        "joint_attention": True,
        "odd_variant": "odd_tokens",
    },
    block_list_keys={"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    # repeated lists outside the main stack: the modulation approximator's residual MLP
    aux_list_keys={"distilled_guidance_layer.layers": "approximator_layers",
                   "distilled_guidance_layer.norms": "approximator_layers"},
    pipeline_class="ChromaPipeline",
    width_keys=("approximator_hidden_dim",),
)


# ----------------------------------------------------------------------------------------------- sana
def _sana_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    p = config["patch_size"]
    text = sizes["text"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], h * p, w * p),
        "encoder_hidden_states": text_rows(gen, batch, text, config["caption_channels"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


def sana_cross_attention(config) -> dict:
    """Sana's caption projection is heads x head_dim wide, and its cross-attention reads it as cross_attention_dim
    (a drawn head count was a shape mismatch); its heads follow too, so that both attentions have the same heads,
    as in the checkpoints (2240 = 70 x 32 = 20 x 112)."""
    heads = config["num_attention_heads"]
    return {"cross_attention_dim": heads * config["attention_head_dim"], "num_cross_attention_heads": heads}


def sana_guidance(config, batch, out, gen):
    """``guidance_embeds`` (SANA-Sprint): the class then embeds a guidance per row and calls its embedder without
    one when none is given (a TypeError). SanaSprintPipeline passes its guidance_scale (4.5 by default) times
    ``guidance_embeds_scale``, the same for every row."""
    return {"guidance": torch.full((batch,), 4.5 * config.get("guidance_embeds_scale", 0.1))}


SANA = FamilySpec(
    name="sana",
    class_name="SanaTransformer2DModel",
    config=dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                num_layers=2, num_cross_attention_heads=HEADS, cross_attention_head_dim=HEAD_DIM,
                cross_attention_dim=DIM, caption_channels=TEXT_DIM, mlp_ratio=2.5, sample_size=8, patch_size=1),
    inputs=with_flag_inputs(_sana_inputs, {"guidance_embeds": sana_guidance}),
    sizes_by_variant={
        "default": {"grid": (4, 8), "text": 8},
        "alt_resolution": {"grid": (6, 8), "text": 8},
        "alt_text_len": {"grid": (4, 8), "text": 12},
    },
    tokens=_grid_tokens,
    expected={
        "streams": 1,
        "streams_per_list": {"transformer_blocks": 1},
        # self-attention is Sana"s linear attention (no sdpa); only the cross-attention calls sdpa
        "attention_per_block": {"transformer_blocks": 1},
        "linear_attention_per_block": {"transformer_blocks": 1},
        "joint_attention": False,
    },
    block_list_keys={"transformer_blocks": "num_layers"},
    pipeline_class="SanaPipeline",
    tied_config=sana_cross_attention,
)


# ---------------------------------------------------------------------------------------------- pixart
def _pixart_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    p = config["patch_size"]
    text = sizes["text"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], h * p, w * p),
        "encoder_hidden_states": text_rows(gen, batch, text, config["caption_channels"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        # sample_size != 128 -> no resolution/aspect-ratio conditions; None selects the same default
        "added_cond_kwargs": None,
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


PIXART = FamilySpec(
    name="pixart",
    class_name="PixArtTransformer2DModel",
    config=dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=8,
                num_layers=2, cross_attention_dim=DIM, sample_size=8, patch_size=2, caption_channels=TEXT_DIM,
                interpolation_scale=1),
    inputs=_pixart_inputs,
    sizes_by_variant=_PATCH2_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 1,
        "streams_per_list": {"transformer_blocks": 1},
        "attention_per_block": {"transformer_blocks": 2},  # self + cross
        "joint_attention": False,
    },
    block_list_keys={"transformer_blocks": "num_layers"},
    pipeline_class="PixArtSigmaPipeline",
    tied_config=inner_width("cross_attention_dim"),  # the caption projection is heads x head_dim wide
)


# ---------------------------------------------------------------------------------------------- zimage
def _zimage_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    p = config["all_patch_size"][0]
    latent = cfg_rows(gen, batch, config["in_channels"], 1, h * p, w * p)
    caps = text_rows(gen, batch, sizes["text"], config["cap_feat_dim"])
    t = timestep_rows(gen, batch, 1.0)
    return {
        # ZImagePipeline passes lists of per-sample (C, F, H, W) latents and (L, D) caption features
        "x": list(latent.unbind(0)),
        "t": t,
        "cap_feats": list(caps.unbind(0)),
        "return_dict": False,
    }


ZIMAGE = FamilySpec(
    name="zimage",
    class_name="ZImageTransformer2DModel",
    config=dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=DIM, n_layers=2,
                n_refiner_layers=2, n_heads=HEADS, n_kv_heads=HEADS, cap_feat_dim=TEXT_DIM,
                axes_dims=list(ROPE_3AXES), axes_lens=[128, 64, 64]),
    inputs=_zimage_inputs,
    sizes_by_variant={
        "default": {"grid": (4, 8), "text": 8},
        "alt_resolution": {"grid": (8, 8), "text": 8},
        "alt_text_len": {"grid": (4, 8), "text": 12},
    },
    tokens=_grid_tokens,
    expected={
        "streams": 1,
        "streams_per_list": {"layers": 1},
        "attention_per_block": {"layers": 1},
        "joint_attention": True,
        # image and caption sequences are each zero-padded to a multiple of 32 tokens inside the model
        "seq_multiple": 32,
    },
    block_list_keys={"layers": "n_layers"},
    aux_list_keys={"noise_refiner": "n_refiner_layers", "context_refiner": "n_refiner_layers"},
    heads_key="n_heads",
    head_dim_key=None,
    hidden_key="dim",
    warm_up=True,  # RopeEmbedder (a plain object) computes freqs_cis lazily on the first forward
    pipeline_class="ZImagePipeline",
    width_keys=("n_kv_heads",),
)


# --------------------------------------------------------------------------------------------- lumina2
def _lumina2_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    p = config["patch_size"]
    text = sizes["text"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], h * p, w * p),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["cap_feat_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.bool),
        "return_dict": False,
    }


LUMINA2 = FamilySpec(
    name="lumina2",
    class_name="Lumina2Transformer2DModel",
    config=dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=DIM, num_layers=2, num_refiner_layers=2,
                num_attention_heads=HEADS, num_kv_heads=HEADS, multiple_of=16, axes_dim_rope=ROPE_3AXES,
                axes_lens=(64, 32, 32), cap_feat_dim=TEXT_DIM),
    inputs=_lumina2_inputs,
    sizes_by_variant=_PATCH2_SIZES,
    tokens=_grid_tokens,
    expected={
        "streams": 1,
        "streams_per_list": {"layers": 1},
        "attention_per_block": {"layers": 1},
        "joint_attention": True,
    },
    block_list_keys={"layers": "num_layers"},
    aux_list_keys={"noise_refiner": "num_refiner_layers", "context_refiner": "num_refiner_layers"},
    head_dim_key=None,
    hidden_key="hidden_size",
    pipeline_class="Lumina2Pipeline",
)

IMAGE_FAMILIES = (FLUX, FLUX2, SD3, QWENIMAGE, CHROMA, SANA, PIXART, ZIMAGE, LUMINA2)
