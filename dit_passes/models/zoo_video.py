"""Tiny video-transformer families of the zoo: wan, hunyuanvideo, cogvideox, ltxvideo.

Sizes are given as latent token grids ``(frames, rows, cols)`` after patchification; inputs are the
forward kwargs exactly as the matching diffusers pipeline builds them.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers.models.embeddings import get_3d_rotary_pos_embed

from dit_passes.models.zoo_common import (FamilySpec, cfg_rows, fp32_tables, image_text_tokens, inner_width, text_mask,
                                          text_rows, timestep_rows)

HEADS = 2
HEAD_DIM = 16
DIM = HEADS * HEAD_DIM  # 32
TEXT_DIM = 32

_VIDEO_SIZES = {
    "default": {"grid": (2, 4, 4), "text": 8},     # 32 video tokens
    "alt_resolution": {"grid": (3, 4, 4), "text": 8},  # another frame count: 48 tokens
    "alt_text_len": {"grid": (2, 4, 4), "text": 12},
}


def _video_tokens(config: Mapping[str, Any], sizes: Mapping[str, Any]) -> dict:
    f, h, w = sizes["grid"]
    return image_text_tokens(f * h * w, sizes["text"])


# ------------------------------------------------------------------------------------------------ wan
def _wan_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    pt, ph, pw = config["patch_size"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], f * pt, h * ph, w * pw),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_dim"]),
        "return_dict": False,
    }


WAN = FamilySpec(
    name="wan",
    class_name="WanTransformer3DModel",
    config=dict(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
                out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64),
    inputs=_wan_inputs,
    sizes_by_variant={
        **_VIDEO_SIZES,
        # 15 video tokens (1 frame of 5x3) and 7 text tokens: both odd, for context-parallel tests
        "odd_tokens": {"grid": (1, 5, 3), "text": 7},
    },
    tokens=_video_tokens,
    expected={
        "streams": 1,
        "streams_per_list": {"blocks": 1},
        "attention_per_block": {"blocks": 2},  # self (attn1) + cross (attn2)
        "joint_attention": False,
        "odd_variant": "odd_tokens",
    },
    block_list_keys={"blocks": "num_layers"},
    pipeline_class="WanPipeline",
)


# --------------------------------------------------------------------------------------- hunyuanvideo
def _hunyuan_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    p, pt = config["patch_size"], config["patch_size_t"]
    text = sizes["text"]
    out = {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], f * pt, h * p, w * p),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "pooled_projections": text_rows(gen, batch, config["pooled_projection_dim"]),
    }
    if config.get("guidance_embeds"):
        out["guidance"] = torch.full((batch,), 6.0 * 1000.0)  # HunyuanVideoPipeline scales by 1000
    out["return_dict"] = False
    return out


HUNYUANVIDEO = FamilySpec(
    name="hunyuanvideo",
    class_name="HunyuanVideoTransformer3DModel",
    config=dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                num_layers=2, num_single_layers=2, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
                patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=TEXT_DIM,
                pooled_projection_dim=TEXT_DIM, rope_axes_dim=(4, 6, 6)),
    inputs=_hunyuan_inputs,
    sizes_by_variant=_VIDEO_SIZES,
    tokens=_video_tokens,
    expected={
        "streams": 2,
        # the single blocks also take and return (image, text) and concatenate inside
        "streams_per_list": {"transformer_blocks": 2, "single_transformer_blocks": 2},
        "attention_per_block": {"transformer_blocks": 1, "single_transformer_blocks": 1},
        "joint_attention": True,
    },
    block_list_keys={"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    aux_list_keys={"context_embedder.token_refiner.refiner_blocks": "num_refiner_layers"},
    pipeline_class="HunyuanVideoPipeline",
)


# ------------------------------------------------------------------------------------------ cogvideox
def _cogvideox_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    p = config["patch_size"]
    # CogVideoX-5b style: rotary embeddings precomputed by the pipeline and passed in as (cos, sin)
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=config["attention_head_dim"], crops_coords=((0, 0), (h, w)), grid_size=(h, w),
        temporal_size=f, device=torch.device("cpu"),
    )
    return {
        "hidden_states": cfg_rows(gen, batch, f, config["in_channels"], h * p, w * p),  # (B, F, C, H, W)
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_embed_dim"]),
        "timestep": timestep_rows(gen, batch, 1000.0).round().to(torch.long),
        "image_rotary_emb": (cos.float(), sin.float()),
        "return_dict": False,
    }


COGVIDEOX = FamilySpec(
    name="cogvideox",
    class_name="CogVideoXTransformer3DModel",
    # rotary (not sincos) positions: the sincos table would pin the text length to max_text_seq_length
    config=dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
                time_embed_dim=DIM, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=8, sample_height=8,
                sample_frames=5, patch_size=2, max_text_seq_length=8, use_rotary_positional_embeddings=True),
    inputs=_cogvideox_inputs,
    sizes_by_variant=_VIDEO_SIZES,
    tokens=_video_tokens,
    expected={
        "streams": 2,
        "streams_per_list": {"transformer_blocks": 2},
        "attention_per_block": {"transformer_blocks": 1},
        "joint_attention": True,
    },
    block_list_keys={"transformer_blocks": "num_layers"},
    pipeline_class="CogVideoXPipeline",
    after_build=fp32_tables,  # a drawn use_learned_positional_embeddings keeps the sincos table, built in fp64
)


# ------------------------------------------------------------------------------------------- ltxvideo
def _ltx_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    text = sizes["text"]
    return {
        # LTXPipeline packs latents to (B, F*H*W, C) before the transformer
        "hidden_states": cfg_rows(gen, batch, f * h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["caption_channels"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "num_frames": f,
        "height": h,
        "width": w,
        # (vae temporal compression / frame rate, spatial compression, spatial compression)
        "rope_interpolation_scale": (8 / 25, 32.0, 32.0),
        "return_dict": False,
    }


LTXVIDEO = FamilySpec(
    name="ltxvideo",
    class_name="LTXVideoTransformer3DModel",
    config=dict(in_channels=16, out_channels=16, patch_size=1, patch_size_t=1, num_attention_heads=HEADS,
                attention_head_dim=HEAD_DIM, cross_attention_dim=DIM, num_layers=2, caption_channels=TEXT_DIM),
    inputs=_ltx_inputs,
    sizes_by_variant=_VIDEO_SIZES,
    tokens=_video_tokens,
    expected={
        "streams": 1,
        "streams_per_list": {"transformer_blocks": 1},
        "attention_per_block": {"transformer_blocks": 2},  # self (attn1) + cross (attn2)
        "joint_attention": False,
    },
    block_list_keys={"transformer_blocks": "num_layers"},
    pipeline_class="LTXPipeline",
    tied_config=inner_width("cross_attention_dim"),  # the caption projection is heads x head_dim wide
)

VIDEO_FAMILIES = (WAN, HUNYUANVIDEO, COGVIDEOX, LTXVIDEO)
