"""Tiny configs of the other DiT classes of diffusers, for the coverage matrix (``dit-passes coverage``).

The curated families (``zoo_image`` / ``zoo_video``) are what the test suite builds; the ones here widen the
zoo to the rest of diffusers' transformer classes, each at the same size (2 heads x 16 channels, 2 blocks
per list) with the options that change the graph turned on where they are cheap (rotary embeddings, masks,
GQA, guidance / style / size conditioning, temporal blocks). Their inputs follow the matching pipeline's call.
``dit_passes.models.diffusers_zoo`` lists every transformer class of the installed diffusers and maps each
to the families here, so a class without one shows as "no config".
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed, get_2d_rotary_pos_embed

from dit_passes.models.zoo_common import (
    FamilySpec,
    cfg_rows,
    grid_ids,
    image_text_tokens,
    text_mask,
    text_rows,
    timestep_rows,
)

HEADS = 2
HEAD_DIM = 16
DIM = HEADS * HEAD_DIM  # 32
TEXT_DIM = 32
ROPE_3AXES = (4, 6, 6)

_IMAGE_SIZES = {"default": {"grid": (4, 4), "text": 8}, "alt_resolution": {"grid": (6, 4), "text": 8}}
_VIDEO_SIZES = {"default": {"grid": (2, 4, 4), "text": 8}, "alt_resolution": {"grid": (3, 4, 4), "text": 8}}


def _grid_tokens(config: Mapping[str, Any], sizes: Mapping[str, Any]) -> dict:
    n = 1
    for d in sizes["grid"]:
        n *= d
    return image_text_tokens(n, sizes["text"])


def _family(name, class_name, config, inputs, block_list_keys, streams, video=False, **extra) -> FamilySpec:
    """A FamilySpec with the shared size tables; ``extra`` passes the rarer fields through."""
    return FamilySpec(
        name=name, class_name=class_name, config=config, inputs=inputs,
        sizes_by_variant=extra.pop("sizes_by_variant", _VIDEO_SIZES if video else _IMAGE_SIZES),
        tokens=_grid_tokens, expected={"streams": streams}, pipeline_class=extra.pop("pipeline_class", None),
        block_list_keys=block_list_keys, **extra)


def _latent_2d(config, batch, sizes, gen, p=None):
    h, w = sizes["grid"]
    p = config["patch_size"] if p is None else p
    return cfg_rows(gen, batch, config["in_channels"], h * p, w * p)


def _latent_3d(config, batch, sizes, gen, pt=1, p=2, channels_first=True):
    f, h, w = sizes["grid"]
    if channels_first:
        return cfg_rows(gen, batch, config["in_channels"], f * pt, h * p, w * p)
    return cfg_rows(gen, batch, f * pt, config["in_channels"], h * p, w * p)


# ------------------------------------------------------------------------------------ flux-like (ids)
def _packed_ids_inputs(text_key="joint_attention_dim", pooled=False, guidance=None):
    def inputs(config, batch, sizes, gen):
        h, w = sizes["grid"]
        text = sizes["text"]
        out = {
            "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
            "encoder_hidden_states": text_rows(gen, batch, text, config[text_key]),
            "timestep": timestep_rows(gen, batch, 1.0),
            "img_ids": grid_ids(1, h, w),
            "txt_ids": torch.zeros(text, 3),
            "return_dict": False,
        }
        if pooled:
            out["pooled_projections"] = text_rows(gen, batch, config["pooled_projection_dim"])
        if guidance is not None:
            out["guidance"] = torch.full((batch,), guidance)
        return out
    return inputs


_DUAL_SINGLE = {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}

BRIA = _family("bria", "BriaTransformer2DModel",
               dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                    num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, axes_dims_rope=list(ROPE_3AXES)),
               _packed_ids_inputs(), _DUAL_SINGLE, 2, pipeline_class="BriaPipeline")

LONGCAT_IMAGE = _family("longcat_image", "LongCatImageTransformer2DModel",
                        dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                             attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM,
                             pooled_projection_dim=TEXT_DIM, axes_dims_rope=list(ROPE_3AXES)),
                        _packed_ids_inputs(), _DUAL_SINGLE, 2)

OVIS_IMAGE = _family("ovis_image", "OvisImageTransformer2DModel",
                     dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, num_single_layers=2,
                          attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM,
                          axes_dims_rope=ROPE_3AXES),
                     _packed_ids_inputs(), _DUAL_SINGLE, 2)


# ------------------------------------------------------------------------------------------ auraflow
def _auraflow_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["joint_attention_dim"]),
        "timestep": timestep_rows(gen, batch, 1.0),
        "return_dict": False,
    }


AURAFLOW = _family("auraflow", "AuraFlowTransformer2DModel",
                   dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
                        attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM,
                        caption_projection_dim=DIM, out_channels=4, pos_embed_max_size=64),
                   _auraflow_inputs,
                   {"joint_transformer_blocks": "num_mmdit_layers", "single_transformer_blocks": "num_single_dit_layers"},
                   2, pipeline_class="AuraFlowPipeline")


# ----------------------------------------------------------------------------------------------- dit
def _dit_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0).round().long(),
        "class_labels": torch.arange(batch, dtype=torch.long) % config["num_embeds_ada_norm"],
        "return_dict": False,
    }


DIT = _family("dit", "DiTTransformer2DModel",
              dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=8, num_layers=2,
                   sample_size=8, patch_size=2, num_embeds_ada_norm=10),
              _dit_inputs, {"transformer_blocks": "num_layers"}, 1, pipeline_class="DiTPipeline",
              # the model unpatchifies a square token grid
              sizes_by_variant={"default": {"grid": (4, 4), "text": 0}, "alt_resolution": {"grid": (6, 6), "text": 0}})


# ---------------------------------------------------------------------------------------- hunyuandit
def _hunyuandit_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text, text_t5 = config["text_len"], config["text_len_t5"]
    cos, sin = get_2d_rotary_pos_embed(config["attention_head_dim"], ((0, 0), (h, w)), (h, w), use_real=True)
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["cross_attention_dim"]),
        "text_embedding_mask": text_mask(batch, text, torch.long),
        "encoder_hidden_states_t5": text_rows(gen, batch, text_t5, config["cross_attention_dim_t5"]),
        "text_embedding_mask_t5": text_mask(batch, text_t5, torch.long),
        "image_meta_size": torch.tensor([[16.0, 16.0, 16.0, 16.0, 0.0, 0.0]]).expand(batch, 6).contiguous(),
        "style": torch.zeros(batch, dtype=torch.long),
        "image_rotary_emb": (cos.float(), sin.float()),
        "return_dict": False,
    }


HUNYUANDIT = _family("hunyuandit", "HunyuanDiT2DModel",
                     dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, patch_size=2,
                          sample_size=8, hidden_size=DIM, num_layers=4, cross_attention_dim=TEXT_DIM,
                          cross_attention_dim_t5=TEXT_DIM, pooled_projection_dim=TEXT_DIM, text_len=8, text_len_t5=8,
                          use_style_cond_and_image_meta_size=True),
                     _hunyuandit_inputs, {"blocks": "num_layers"}, 1, pipeline_class="HunyuanDiTPipeline")


# --------------------------------------------------------------------------------------- cogview 3/4
def _cogview_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_embed_dim"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "original_size": torch.tensor([[64.0, 64.0]]).expand(batch, 2).contiguous(),
        "target_size": torch.tensor([[64.0, 64.0]]).expand(batch, 2).contiguous(),
        "crop_coords": torch.zeros(batch, 2),
        "return_dict": False,
    }


_COGVIEW = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                num_attention_heads=HEADS, text_embed_dim=TEXT_DIM, time_embed_dim=DIM, condition_dim=8,
                pos_embed_max_size=16, sample_size=8)
COGVIEW3PLUS = _family("cogview3plus", "CogView3PlusTransformer2DModel", _COGVIEW, _cogview_inputs,
                       {"transformer_blocks": "num_layers"}, 2, pipeline_class="CogView3PlusPipeline")
COGVIEW4 = _family("cogview4", "CogView4Transformer2DModel", dict(_COGVIEW, rope_axes_dim=(16, 16)), _cogview_inputs,
                   {"transformer_blocks": "num_layers"}, 2, pipeline_class="CogView4Pipeline")


# ------------------------------------------------------------------------------------ wan-like video
def _wan_like_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_dim"]),
        "return_dict": False,
    }


_WAN_LIKE = dict(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
                 out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
SKYREELS_V2 = _family("skyreels_v2", "SkyReelsV2Transformer3DModel", _WAN_LIKE, _wan_like_inputs,
                      {"blocks": "num_layers"}, 1, video=True, pipeline_class="SkyReelsV2Pipeline")
CHRONOEDIT = _family("chronoedit", "ChronoEditTransformer3DModel", dict(_WAN_LIKE, rope_temporal_skip_len=2),
                     _wan_like_inputs, {"blocks": "num_layers"}, 1, video=True)


# --------------------------------------------------------------------------------------- latte (t/s)
def _latte_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0),
        # LattePipeline passes no text mask (the model would not repeat one over the frames)
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["caption_channels"]),
        "return_dict": False,
    }


LATTE = _family("latte", "LatteTransformer3DModel",
                dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=8,
                     num_layers=2, cross_attention_dim=DIM, patch_size=2, sample_size=8,
                     activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                     norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=TEXT_DIM, video_length=2),
                _latte_inputs, {"transformer_blocks": "num_layers", "temporal_transformer_blocks": "num_layers"}, 1,
                video=True, sizes_by_variant={"default": {"grid": (2, 4, 4), "text": 8},
                                              "alt_resolution": {"grid": (2, 6, 4), "text": 8}},
                pipeline_class="LattePipeline")


# ---------------------------------------------------------------------------------------- allegro
def _allegro_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["caption_channels"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_attention_mask": text_mask(batch, sizes["text"], torch.long),
        "return_dict": False,
    }


ALLEGRO = _family("allegro", "AllegroTransformer3DModel",
                  dict(patch_size=2, patch_size_t=1, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                       in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=DIM, sample_height=8,
                       sample_width=8, sample_frames=2, caption_channels=TEXT_DIM),
                  _allegro_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                  pipeline_class="AllegroPipeline")


# ----------------------------------------------------------------------------------------- mochi
def _mochi_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


MOCHI = _family("mochi", "MochiTransformer3DModel",
                dict(patch_size=2, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=2,
                     pooled_projection_dim=TEXT_DIM, in_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=DIM,
                     max_sequence_length=8),
                _mochi_inputs, {"transformer_blocks": "num_layers"}, 2, video=True, pipeline_class="MochiPipeline")


# ------------------------------------------------------------------------------------- stable audio
def _stable_audio_inputs(config, batch, sizes, gen):
    (length,) = sizes["grid"]
    # StableAudioPipeline: half-dim rotary table over the latent frames plus the global token
    rotary = get_1d_rotary_pos_embed(config["attention_head_dim"] // 2, length + 1, use_real=True,
                                     repeat_interleave_real=False)
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], length),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["cross_attention_dim"]),
        "global_hidden_states": text_rows(gen, batch, 1, config["global_states_input_dim"]),
        "rotary_embedding": rotary,
        "return_dict": False,
    }


STABLE_AUDIO = _family("stable_audio", "StableAudioDiTModel",
                       dict(sample_size=16, in_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                            num_attention_heads=HEADS, num_key_value_attention_heads=1, out_channels=4,
                            cross_attention_dim=DIM, time_proj_dim=DIM, global_states_input_dim=DIM,
                            cross_attention_input_dim=DIM),
                       _stable_audio_inputs, {"transformer_blocks": "num_layers"}, 1,
                       sizes_by_variant={"default": {"grid": (16,), "text": 8},
                                         "alt_resolution": {"grid": (24,), "text": 8}},
                       pipeline_class="StableAudioPipeline")


# ---------------------------------------------------------------------------------------- sana video
def _sana_video_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "encoder_hidden_states": text_rows(gen, batch, text, config["caption_channels"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


SANA_VIDEO = _family("sana_video", "SanaVideoTransformer3DModel",
                     dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                          num_layers=2, num_cross_attention_heads=HEADS, cross_attention_head_dim=HEAD_DIM,
                          cross_attention_dim=DIM, caption_channels=TEXT_DIM, sample_size=8, patch_size=(1, 2, 2),
                          rope_max_seq_len=64),
                     _sana_video_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                     pipeline_class="SanaVideoPipeline")


# ------------------------------------------------------------------------------------ hunyuan image
def _hunyuanimage_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen, p=1),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


HUNYUANIMAGE = _family("hunyuanimage", "HunyuanImageTransformer2DModel",
                       dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                            num_layers=2, num_single_layers=2, num_refiner_layers=2, patch_size=(1, 1),
                            text_embed_dim=TEXT_DIM, rope_axes_dim=(8, 8)),
                       _hunyuanimage_inputs, _DUAL_SINGLE, 2,
                       aux_list_keys={"context_embedder.token_refiner.refiner_blocks": "num_refiner_layers"},
                       pipeline_class="HunyuanImagePipeline")


# -------------------------------------------------------------------------------------------- cosmos
def _cosmos_inputs(config, batch, sizes, gen):
    # concat_padding_mask=False: the padding mask goes through torchvision, which the zoo does not need
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_embed_dim"]),
        "return_dict": False,
    }


COSMOS = _family("cosmos", "CosmosTransformer3DModel",
                 dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                      num_layers=2, text_embed_dim=TEXT_DIM, adaln_lora_dim=8, max_size=(8, 16, 16),
                      patch_size=(1, 2, 2), rope_scale=(1.0, 1.0, 1.0), encoder_hidden_states_channels=TEXT_DIM,
                      crossattn_proj_in_channels=TEXT_DIM, concat_padding_mask=False),
                 _cosmos_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                 pipeline_class="CosmosTextToWorldPipeline")


# --------------------------------------------------------------------------------- wan vace (control)
def _wan_vace_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    out = _wan_like_inputs(config, batch, sizes, gen)
    out["control_hidden_states"] = cfg_rows(gen, batch, config["vace_in_channels"], f, h * 2, w * 2)
    out["control_hidden_states_scale"] = torch.ones(len(config["vace_layers"]))
    return out


WAN_VACE = _family("wan_vace", "WanVACETransformer3DModel", dict(_WAN_LIKE, vace_layers=[0, 1], vace_in_channels=8),
                   _wan_vace_inputs, {"blocks": "num_layers"}, 1, video=True, pipeline_class="WanVACEPipeline")


# ----------------------------------------------------------------------------------------------- prx
def _prx_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["context_in_dim"]),
        "attention_mask": text_mask(batch, text, torch.bool),
        "return_dict": False,
    }


PRX = _family("prx", "PRXTransformer2DModel",
              dict(in_channels=4, patch_size=2, context_in_dim=TEXT_DIM, hidden_size=DIM, mlp_ratio=2.0,
                   num_heads=HEADS, depth=2, axes_dim=[8, 8]),
              _prx_inputs, {"blocks": "depth"}, 1, heads_key="num_heads", head_dim_key=None, hidden_key="hidden_size",
              pipeline_class="PRXPipeline")


# --------------------------------------------------------------------------------------------- flux3
def _flux3_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    txt_ids = torch.zeros(text, 4)
    txt_ids[:, 3] = torch.arange(text, dtype=torch.float32)
    return {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        "timestep": timestep_rows(gen, batch, 1.0),
        "img_ids": grid_ids(1, h, w, extra_axes=1),
        "txt_ids": txt_ids,
        "return_dict": False,
    }


FLUX3 = _family("flux3", "Flux3Transformer2DModel",
                dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                     num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, timestep_channels=32,
                     axes_dims_rope=(4, 4, 4, 4)),
                _flux3_inputs, {"mode_blocks.image": "num_layers", "txt_mode_blocks": "num_layers",
                                "single_transformer_blocks": "num_single_layers"}, 2)


# ------------------------------------------------------------------------------------ hunyuanvideo 1.5
def _hunyuanvideo15_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen, p=1),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "encoder_hidden_states_2": text_rows(gen, batch, text, config["text_embed_2_dim"]),
        "encoder_attention_mask_2": text_mask(batch, text, torch.long),
        # the text-to-video pipeline passes zero image embeddings
        "image_embeds": torch.zeros(batch, 4, config["image_embed_dim"]),
        "return_dict": False,
    }


HUNYUANVIDEO15 = _family("hunyuanvideo15", "HunyuanVideo15Transformer3DModel",
                         dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                              num_layers=2, num_refiner_layers=2, patch_size=1, text_embed_dim=TEXT_DIM,
                              text_embed_2_dim=TEXT_DIM, image_embed_dim=TEXT_DIM, rope_axes_dim=ROPE_3AXES,
                              task_type="t2v"),
                         _hunyuanvideo15_inputs, {"transformer_blocks": "num_layers"}, 2, video=True,
                         aux_list_keys={"context_embedder.token_refiner.refiner_blocks": "num_refiner_layers"},
                         pipeline_class="HunyuanVideo15Pipeline")


# ---------------------------------------------------------------------------------------- ernie image
def _ernie_image_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "text_bth": text_rows(gen, batch, text, config["text_in_dim"]),
        "text_lens": torch.tensor([text, text - 2][:batch]),
        "return_dict": False,
    }


ERNIE_IMAGE = _family("ernie_image", "ErnieImageTransformer2DModel",
                      dict(hidden_size=DIM, num_attention_heads=HEADS, num_layers=2, ffn_hidden_size=64, in_channels=4,
                           out_channels=4, patch_size=1, text_in_dim=TEXT_DIM, rope_axes_dim=ROPE_3AXES),
                      _ernie_image_inputs, {"layers": "num_layers"}, 1, head_dim_key=None, hidden_key="hidden_size")


# ------------------------------------------------------------------------------------- nucleus (MoE)
def _nucleusmoe_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    return {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "img_shapes": [(1, h, w)] * batch,
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        "encoder_hidden_states_mask": text_mask(batch, text, torch.long),
        "timestep": timestep_rows(gen, batch, 1.0),
        "return_dict": False,
    }


NUCLEUSMOE = _family("nucleusmoe", "NucleusMoEImageTransformer2DModel",
                     dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                          num_attention_heads=HEADS, num_key_value_heads=1, joint_attention_dim=TEXT_DIM,
                          axes_dims_rope=ROPE_3AXES, dense_moe_strategy="leave_first_block_dense", num_experts=4,
                          moe_intermediate_dim=32, capacity_factors=[2.0, 2.0]),
                     _nucleusmoe_inputs, {"transformer_blocks": "num_layers"}, 2, pipeline_class="NucleusMoEImagePipeline")


# ------------------------------------------------------------------------------------------ consisid
def _consisid_inputs(config, batch, sizes, gen):
    from dit_passes.models.zoo_video import _cogvideox_inputs
    return _cogvideox_inputs(config, batch, sizes, gen)


CONSISID = _family("consisid", "ConsisIDTransformer3DModel",
                   dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
                        time_embed_dim=DIM, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=8, sample_height=8,
                        sample_frames=5, patch_size=2, max_text_seq_length=8, use_rotary_positional_embeddings=True),
                   _consisid_inputs, {"transformer_blocks": "num_layers"}, 2, video=True,
                   pipeline_class="ConsisIDPipeline")


# -------------------------------------------------------------------------------------- kandinsky 5
def _kandinsky5_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    text = sizes["text"]
    return {
        # Kandinsky5T2VPipeline: channels-last (B, F, H, W, C) latents
        "hidden_states": cfg_rows(gen, batch, f, h * 2, w * 2, config["in_visual_dim"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["in_text_dim"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "pooled_projections": text_rows(gen, batch, config["in_text_dim2"]),
        "visual_rope_pos": [torch.arange(f), torch.arange(h), torch.arange(w)],
        "text_rope_pos": torch.arange(text),
        "return_dict": False,
    }


KANDINSKY5 = _family("kandinsky5", "Kandinsky5Transformer3DModel",
                     dict(in_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=TEXT_DIM, time_dim=DIM, out_visual_dim=4,
                          patch_size=(1, 2, 2), model_dim=DIM, ff_dim=64, num_text_blocks=2, num_visual_blocks=2,
                          axes_dims=ROPE_3AXES),
                     _kandinsky5_inputs, {"visual_transformer_blocks": "num_visual_blocks"}, 1, video=True,
                     # heads of sum(axes_dims) channels
                     heads_of=lambda c: (c["model_dim"] // sum(c["axes_dims"]), sum(c["axes_dims"])),
                     pipeline_class="Kandinsky5T2VPipeline")


# ----------------------------------------------------------------- helios / anyflow (wan-like video)
def _anyflow_inputs(config, batch, sizes, gen):
    out = _wan_like_inputs(config, batch, sizes, gen)
    # AnyFlow's pipeline hands frames first, (B, F, C, H, W), with one timestep per frame, (B, F)
    out["hidden_states"] = out["hidden_states"].transpose(1, 2).contiguous()
    frames = out["hidden_states"].shape[1]
    out["timestep"] = out["timestep"][:, None].expand(-1, frames).contiguous()
    out["r_timestep"] = out["timestep"] * 0.5
    return out


HELIOS = _family("helios", "HeliosTransformer3DModel",
                 dict({k: v for k, v in _WAN_LIKE.items() if k != "rope_max_seq_len"}, rope_dim=ROPE_3AXES),
                 _wan_like_inputs, {"blocks": "num_layers"}, 1, video=True, pipeline_class="HeliosPipeline")
ANYFLOW = _family("anyflow", "AnyFlowTransformer3DModel", _WAN_LIKE, _anyflow_inputs, {"blocks": "num_layers"}, 1,
                  video=True)


# -------------------------------------------------------------------------------------- motif video
def _motif_video_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


MOTIF_VIDEO = _family("motif_video", "MotifVideoTransformer3DModel",
                      dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                           num_layers=2, num_single_layers=2, patch_size=2, text_embed_dim=TEXT_DIM,
                           rope_axes_dim=ROPE_3AXES),
                      _motif_video_inputs, _DUAL_SINGLE, 2, video=True)


# ------------------------------------------------------------------------------------- audio (1-D)
_AUDIO_SIZES = {"default": {"grid": (16,), "text": 8}, "alt_resolution": {"grid": (24,), "text": 8}}


def _longcat_audio_inputs(config, batch, sizes, gen):
    (length,) = sizes["grid"]
    text = sizes["text"]
    return {
        "hidden_states": cfg_rows(gen, batch, length, config["latent_dim"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["dit_text_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.bool),
        "timestep": timestep_rows(gen, batch, 1.0),
        "return_dict": False,
    }


LONGCAT_AUDIO = _family("longcat_audio", "LongCatAudioDiTTransformer",
                        dict(dit_dim=DIM, dit_depth=4, dit_heads=HEADS, dit_text_dim=TEXT_DIM, latent_dim=8,
                             use_latent_condition=False),
                        _longcat_audio_inputs, {"blocks": "dit_depth"}, 1, sizes_by_variant=_AUDIO_SIZES,
                        heads_key="dit_heads", head_dim_key=None, hidden_key="dit_dim")


def _stable_audio3_inputs(config, batch, sizes, gen):
    (length,) = sizes["grid"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["io_channels"], length),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["cond_token_dim"]),
        "global_hidden_states": text_rows(gen, batch, config["global_cond_dim"]),
        "return_dict": False,
    }


STABLE_AUDIO3 = _family("stable_audio3", "StableAudio3DiTModel",
                        dict(io_channels=8, embed_dim=DIM, depth=2, num_heads=HEADS, cond_token_dim=TEXT_DIM,
                             global_cond_dim=TEXT_DIM, timestep_features_dim=DIM, num_memory_tokens=4),
                        _stable_audio3_inputs, {"transformer_blocks": "depth"}, 1, sizes_by_variant=_AUDIO_SIZES,
                        heads_key="num_heads", head_dim_key=None, hidden_key="embed_dim")


# ------------------------------------------------------------------------------------- lumina-next
def _lumina_next_inputs(config, batch, sizes, gen):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina
    text = sizes["text"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["cross_attention_dim"]),
        "encoder_mask": text_mask(batch, text, torch.long),
        # LuminaPipeline: a (384, 384) complex table; 16 x 16 covers the zoo's grids
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(head_dim, 16, 16),
        "cross_attention_kwargs": {},  # the blocks unpack it with **
        "return_dict": False,
    }


LUMINA_NEXT = _family("lumina_next", "LuminaNextDiT2DModel",
                      dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=DIM, num_layers=2,
                           num_attention_heads=HEADS, num_kv_heads=1, multiple_of=16, learn_sigma=True, qk_norm=True,
                           cross_attention_dim=TEXT_DIM),
                      _lumina_next_inputs, {"layers": "num_layers"}, 1, head_dim_key=None, hidden_key="hidden_size",
                      pipeline_class="LuminaPipeline")


# --------------------------------------------------------------------------------------- hidream (MoE)
def _hidream_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    n_llama = len(config["llama_layers"])
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timesteps": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states_t5": text_rows(gen, batch, text, config["caption_channels"][0]),
        # HiDreamImagePipeline: the llama hidden states of every layer, (layers, B, T, D)
        "encoder_hidden_states_llama3": text_rows(gen, batch, n_llama, text, config["caption_channels"][1])
        .transpose(0, 1).contiguous(),
        "pooled_embeds": text_rows(gen, batch, config["text_emb_dim"]),
        "return_dict": False,
    }


HIDREAM = _family("hidream", "HiDreamImageTransformer2DModel",
                  dict(patch_size=2, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                       num_attention_heads=HEADS, caption_channels=[TEXT_DIM, TEXT_DIM], text_emb_dim=TEXT_DIM,
                       num_routed_experts=2, num_activated_experts=1, axes_dims_rope=ROPE_3AXES, max_resolution=(16, 16),
                       llama_layers=[0, 1, 2, 3]),
                  _hidream_inputs, {"double_stream_blocks": "num_layers", "single_stream_blocks": "num_single_layers"},
                  2, pipeline_class="HiDreamImagePipeline")


# ----------------------------------------------------------------------------------------- easyanimate
def _easyanimate_inputs(config, batch, sizes, gen):
    return {
        "hidden_states": _latent_3d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_embed_dim"]),
        "return_dict": False,
    }


EASYANIMATE = _family("easyanimate", "EasyAnimateTransformer3DModel",
                      dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
                           patch_size=2, sample_width=8, sample_height=8, num_layers=2, mmdit_layers=2,
                           time_embed_dim=DIM, text_embed_dim=TEXT_DIM),
                      _easyanimate_inputs, {"transformer_blocks": "num_layers"}, 2, video=True,
                      pipeline_class="EasyAnimatePipeline")


MORE_FAMILIES = (BRIA, LONGCAT_IMAGE, OVIS_IMAGE, AURAFLOW, DIT, HUNYUANDIT, COGVIEW3PLUS, COGVIEW4, SKYREELS_V2,
                 CHRONOEDIT, LATTE, ALLEGRO, MOCHI, STABLE_AUDIO, SANA_VIDEO, HUNYUANIMAGE, COSMOS, WAN_VACE, PRX, FLUX3,
                 HUNYUANVIDEO15, ERNIE_IMAGE, NUCLEUSMOE, CONSISID, KANDINSKY5, HELIOS, ANYFLOW, MOTIF_VIDEO,
                 LONGCAT_AUDIO, STABLE_AUDIO3, LUMINA_NEXT, HIDREAM, EASYANIMATE)
