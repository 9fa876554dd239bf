"""Tiny configs of the other DiT classes of diffusers, for the coverage matrix (``dit-passes coverage``).

The curated families (``zoo_image`` / ``zoo_video``) are what the test suite builds; the ones here widen the
zoo to the rest of diffusers' transformer classes, each at the same size (2 heads x 16 channels, 2 blocks
per list) with the options that change the graph turned on where they are cheap (rotary embeddings, masks,
GQA, guidance / style / size conditioning, temporal blocks). Their inputs follow the matching pipeline's call.
Image families here, video and audio ones in ``zoo_more_av``. ``dit_passes.models.diffusers_zoo`` lists every
transformer class of the installed diffusers and maps each to the families here, so a class without one shows as
"no config".
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
from diffusers.models.embeddings import get_2d_rotary_pos_embed

from dit_passes.models.zoo_common import (FamilySpec, cfg_rows, grid_ids, image_text_tokens, inner_width, text_mask,
                                          text_rows, timestep_rows, with_flag_inputs)
from dit_passes.models.zoo_image import DIM, HEAD_DIM, HEADS, ROPE_3AXES, TEXT_DIM  # the curated zoo's sizes

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


def _text_inputs(text_key, t_scale=1000.0, mask=torch.long, latent=_latent_3d, mask_key="encoder_attention_mask"):
    """The common call: latents, a timestep, text embeddings (``config[text_key]`` wide) and, unless ``mask`` is
    None, a text mask of that dtype as ``mask_key``."""
    def inputs(config, batch, sizes, gen):
        text = sizes["text"]
        out = {
            "hidden_states": latent(config, batch, sizes, gen),
            "timestep": timestep_rows(gen, batch, t_scale),
            "encoder_hidden_states": text_rows(gen, batch, text, config[text_key]),
        }
        if mask is not None:
            out[mask_key] = text_mask(batch, text, mask)
        out["return_dict"] = False
        return out
    return inputs


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
                   {"joint_transformer_blocks": "num_mmdit_layers",
                    "single_transformer_blocks": "num_single_dit_layers"}, 2, pipeline_class="AuraFlowPipeline",
                   tied_config=inner_width("caption_projection_dim"))  # text tokens join the image ones


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
                     _hunyuandit_inputs, {"blocks": "num_layers"}, 1, pipeline_class="HunyuanDiTPipeline",
                     # the patch / time embedders are hidden_size wide, the blocks heads x head_dim: one width
                     tied_config=lambda c: {"hidden_size": c["num_attention_heads"] * c["attention_head_dim"]},
                     width_keys=("cross_attention_dim",))


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


# ------------------------------------------------------------------------------------ hunyuan image
# the step-distilled (meanflow) model takes the interval's other end, r = t for plain sampling; a guidance-distilled
# one the guidance scale (x 1000, as HunyuanImagePipeline passes it)
_hunyuanimage_inputs = with_flag_inputs(_text_inputs("text_embed_dim", latent=functools.partial(_latent_2d, p=1)), {
    "use_meanflow": lambda config, batch, out, gen: {"timestep_r": out["timestep"].clone()},
    "guidance_embeds": lambda config, batch, out, gen: {"guidance": torch.full((batch,), 3500.0)}})


HUNYUANIMAGE = _family("hunyuanimage", "HunyuanImageTransformer2DModel",
                       dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                            num_layers=2, num_single_layers=2, num_refiner_layers=2, patch_size=(1, 1),
                            text_embed_dim=TEXT_DIM, rope_axes_dim=(8, 8)),
                       _hunyuanimage_inputs, _DUAL_SINGLE, 2,
                       aux_list_keys={"context_embedder.token_refiner.refiner_blocks": "num_refiner_layers"},
                       pipeline_class="HunyuanImagePipeline")


# ----------------------------------------------------------------------------------------------- prx
_prx_inputs = _text_inputs("context_in_dim", t_scale=1.0, mask=torch.bool, latent=_latent_2d,
                           mask_key="attention_mask")


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
                dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2,
                     attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM,
                     timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)),
                # a flow map (step-distilled) embeds the timestep each step jumps to as well
                with_flag_inputs(_flux3_inputs, {"flow_map": lambda config, batch, out, gen: {
                    "target_timestep": out["timestep"] * 0.5}}),
                {"mode_blocks.image": "num_layers", "txt_mode_blocks": "num_layers",
                                "single_transformer_blocks": "num_single_layers"}, 2)


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
                     _nucleusmoe_inputs, {"transformer_blocks": "num_layers"}, 2,
                     pipeline_class="NucleusMoEImagePipeline",
                     # a list holds one capacity factor per block and the class indexes it by block, so a drawn
                     # block count needs a list of that length (a scalar would hide the per-block form)
                     tied_config=lambda c: {"capacity_factors": [2.0] * c["num_layers"]},
                     width_keys=("joint_attention_dim", "moe_intermediate_dim", "num_key_value_heads"))


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
                      pipeline_class="LuminaPipeline",
                      width_keys=("cross_attention_dim", "num_kv_heads", "multiple_of"))


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
                       num_routed_experts=2, num_activated_experts=1, axes_dims_rope=ROPE_3AXES,
                       max_resolution=(16, 16), llama_layers=[0, 1, 2, 3]),
                  _hidream_inputs, {"double_stream_blocks": "num_layers", "single_stream_blocks": "num_single_layers"},
                  2, pipeline_class="HiDreamImagePipeline",
                  # one llama layer per block (HiDream-I1: 48 for 16 + 32): the class builds a caption projection per
                  # block and indexes them by llama_layers, so a drawn block count needs a list of that length
                  tied_config=lambda c: {"llama_layers": list(range(c["num_layers"] + c["num_single_layers"]))})




MORE_IMAGE_FAMILIES = (BRIA, LONGCAT_IMAGE, OVIS_IMAGE, AURAFLOW, DIT, HUNYUANDIT, COGVIEW3PLUS, COGVIEW4,
                       HUNYUANIMAGE, PRX, FLUX3, ERNIE_IMAGE, NUCLEUSMOE, LUMINA_NEXT, HIDREAM)
