"""Tiny configs of diffusers' other video and audio DiT classes, for the coverage matrix (see ``zoo_more``)."""
from __future__ import annotations

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed

from dit_passes.models.zoo_common import (cfg_rows, fp32_tables, inner_width, randn, text_mask, text_rows,
                                          timestep_rows, with_flag_inputs)
from dit_passes.models.zoo_image import sana_cross_attention, sana_guidance
from dit_passes.models.zoo_more import (
    _DUAL_SINGLE,
    DIM,
    HEAD_DIM,
    HEADS,
    ROPE_3AXES,
    TEXT_DIM,
    _family,
    _latent_3d,
    _text_inputs,
)


# ------------------------------------------------------------------------------------ wan-like video
_wan_like_inputs = _text_inputs("text_dim", mask=None)


_WAN_LIKE = dict(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
                 out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
# SkyReels-V2-DF's fps condition as its pipelines pass it: one entry per row ([fps] * batch, each 0 for 16 fps, else
# 1), so a CFG pair gets one per row as one call does
_skyreels_v2_inputs = with_flag_inputs(_wan_like_inputs, {
    "inject_sample_info": lambda config, batch, out, gen: {"fps": [1] * batch}})
SKYREELS_V2 = _family("skyreels_v2", "SkyReelsV2Transformer3DModel", _WAN_LIKE, _skyreels_v2_inputs,
                      {"blocks": "num_layers"}, 1, video=True, pipeline_class="SkyReelsV2Pipeline")
CHRONOEDIT = _family("chronoedit", "ChronoEditTransformer3DModel", dict(_WAN_LIKE, rope_temporal_skip_len=2),
                     _wan_like_inputs, {"blocks": "num_layers"}, 1, video=True)


# --------------------------------------------------------------------------------------- latte (t/s)
# LattePipeline passes no text mask (the model would not repeat one over the frames)
_latte_inputs = _text_inputs("caption_channels", mask=None)


LATTE = _family("latte", "LatteTransformer3DModel",
                dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=8,
                     num_layers=2, cross_attention_dim=DIM, patch_size=2, sample_size=8,
                     activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
                     norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=TEXT_DIM, video_length=2),
                _latte_inputs, {"transformer_blocks": "num_layers", "temporal_transformer_blocks": "num_layers"}, 1,
                video=True, sizes_by_variant={"default": {"grid": (2, 4, 4), "text": 8},
                                              "alt_resolution": {"grid": (2, 6, 4), "text": 8}},
                pipeline_class="LattePipeline", tied_config=inner_width("cross_attention_dim"))


# ---------------------------------------------------------------------------------------- allegro
_allegro_inputs = _text_inputs("caption_channels")


ALLEGRO = _family("allegro", "AllegroTransformer3DModel",
                  dict(patch_size=2, patch_size_t=1, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                       in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=DIM, sample_height=8,
                       sample_width=8, sample_frames=2, caption_channels=TEXT_DIM),
                  _allegro_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                  pipeline_class="AllegroPipeline", tied_config=inner_width("cross_attention_dim"))


# ----------------------------------------------------------------------------------------- mochi
_mochi_inputs = _text_inputs("text_embed_dim")


MOCHI = _family("mochi", "MochiTransformer3DModel",
                dict(patch_size=2, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=2,
                     pooled_projection_dim=TEXT_DIM, in_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=DIM,
                     max_sequence_length=8),
                _mochi_inputs, {"transformer_blocks": "num_layers"}, 2, video=True, pipeline_class="MochiPipeline",
                width_keys=("pooled_projection_dim",))


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
                       pipeline_class="StableAudioPipeline",
                       width_keys=("cross_attention_dim", "num_key_value_attention_heads"))


# ---------------------------------------------------------------------------------------- sana video
# SANA-Video's class takes SANA-Sprint's guidance embedder too (no pipeline passes one): the same guidance per row
_sana_video_inputs = with_flag_inputs(_text_inputs("caption_channels"), {"guidance_embeds": sana_guidance})


SANA_VIDEO = _family("sana_video", "SanaVideoTransformer3DModel",
                     dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                          num_layers=2, num_cross_attention_heads=HEADS, cross_attention_head_dim=HEAD_DIM,
                          cross_attention_dim=DIM, caption_channels=TEXT_DIM, sample_size=8, patch_size=(1, 2, 2),
                          rope_max_seq_len=64),
                     _sana_video_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                     pipeline_class="SanaVideoPipeline", tied_config=sana_cross_attention)


# -------------------------------------------------------------------------------------------- cosmos
# concat_padding_mask=False: the padding mask goes through torchvision, which the zoo does not need
_cosmos_inputs = _text_inputs("text_embed_dim", t_scale=1.0, mask=None)


COSMOS = _family("cosmos", "CosmosTransformer3DModel",
                 dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                      num_layers=2, text_embed_dim=TEXT_DIM, adaln_lora_dim=8, max_size=(8, 16, 16),
                      patch_size=(1, 2, 2), rope_scale=(1.0, 1.0, 1.0), encoder_hidden_states_channels=TEXT_DIM,
                      crossattn_proj_in_channels=TEXT_DIM, concat_padding_mask=False),
                 _cosmos_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                 pipeline_class="CosmosTextToWorldPipeline",
                 width_keys=("text_embed_dim", "adaln_lora_dim"))


# --------------------------------------------------------------------------------- wan vace (control)
def _wan_vace_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    out = _wan_like_inputs(config, batch, sizes, gen)
    out["control_hidden_states"] = cfg_rows(gen, batch, config["vace_in_channels"], f, h * 2, w * 2)
    out["control_hidden_states_scale"] = torch.ones(len(config["vace_layers"]))
    return out


def _vace_layers(config):
    """The hinted blocks at the list's spacing, over the block count: the class refuses a list that names a block it
    does not have (the zoo's [0, 1] for a drawn 1 block), and a list fixed for 2 blocks leaves a third unhinted. The
    spacing is what a config chooses (the class's default every fifth of 40 blocks, the zoo every block, its
    every_other variant every other), so the variant's [0, 2] over its 4 blocks is kept."""
    layers = config["vace_layers"]
    step = layers[1] - layers[0] if len(layers) > 1 else 1
    return {"vace_layers": list(range(0, int(config["num_layers"]), step))}


WAN_VACE = _family("wan_vace", "WanVACETransformer3DModel", dict(_WAN_LIKE, vace_layers=[0, 1], vace_in_channels=8),
                   _wan_vace_inputs, {"blocks": "num_layers"}, 1, video=True, pipeline_class="WanVACEPipeline",
                   tied_config=_vace_layers)


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


# ------------------------------------------------------------------------------------------ consisid
_FACE_TOKENS = 5  # ViT tokens per face feature (EVA-CLIP's 577)


def _consisid_plain_inputs(config, batch, sizes, gen):
    from dit_passes.models.zoo_video import _cogvideox_inputs
    return _cogvideox_inputs(config, batch, sizes, gen)


def _consisid_face(config, batch, out, gen):
    """``is_train_face``: the face the identity is kept from, as ConsisIDPipeline passes it: the face embedding
    (antelopev2's and CLIP's, ``LFE_id_dim`` wide) and the CLIP ViT's hidden states at ``LFE_num_scale`` depths. One
    face for every row: the pipeline hands the same batch-1 tensors to both CFG rows (they broadcast in the
    perceiver cross-attention)."""
    return {"id_cond": randn(gen, 1, config["LFE_id_dim"]),
            "id_vit_hidden": [randn(gen, 1, _FACE_TOKENS, config["LFE_vit_dim"])
                              for _ in range(config["LFE_num_scale"])]}


_consisid_inputs = with_flag_inputs(_consisid_plain_inputs, {"is_train_face": _consisid_face})
# The face modules at the zoo's widths (used only where is_train_face is on). The class derives the perceiver
# cross-attention's key width as int(inner_dim / 3 * 2), 21 for 2 heads of 16, and the facial extractor's output
# must match it: _consisid_tied keeps it so for a drawn head count. cross_attn_interval 1: the class
# builds num_layers // interval cross-attentions but runs one at every block i % interval == 0, so with ConsisID's 2
# an odd block count (every drawn one: 1 or 3) indexes past the list (a diffusers bug; the real 42 blocks are even)
_CONSISID_FACE = dict(cross_attn_interval=1, cross_attn_dim_head=HEAD_DIM, cross_attn_num_heads=HEADS,
                      LFE_id_dim=TEXT_DIM, LFE_vit_dim=DIM, LFE_depth=2, LFE_dim_head=HEAD_DIM, LFE_num_heads=HEADS,
                      LFE_num_id_token=2, LFE_num_querie=4, LFE_output_dim=int(DIM / 3 * 2), LFE_ff_mult=2,
                      LFE_num_scale=2)


def _consisid_tied(config):
    """The facial extractor's output width: the perceiver cross-attention's keys, which the class sizes from the
    blocks' heads x head_dim (``cross_attn_kv_dim``; the checkpoint: int(3072 / 3 * 2) = 2048, its LFE_output_dim)."""
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return {"LFE_output_dim": int(inner / 3 * 2)}


CONSISID = _family("consisid", "ConsisIDTransformer3DModel",
                   dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
                        time_embed_dim=DIM, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=8, sample_height=8,
                        sample_frames=5, patch_size=2, max_text_seq_length=8, use_rotary_positional_embeddings=True,
                        **_CONSISID_FACE),
                   _consisid_inputs, {"transformer_blocks": "num_layers"}, 2, video=True,
                   pipeline_class="ConsisIDPipeline", after_build=fp32_tables,  # CogVideoX's patch embedder
                   tied_config=_consisid_tied)


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


def _kandinsky5_visual_cond(config, batch, out, gen):
    """Kandinsky 5 I2V (``visual_cond``): the class's visual embedder takes 2 C + 1 channels, the latents then the
    conditioning frames and their mask (``Kandinsky5I2VPipeline``)."""
    lat = out["hidden_states"]
    cond = torch.zeros_like(lat)
    cond[:, :1] = cfg_rows(gen, batch, *lat.shape[2:])[:, None]
    mask = torch.zeros(*lat.shape[:-1], 1)
    mask[:, :1] = 1.0
    return {"hidden_states": torch.cat([lat, cond, mask], dim=-1)}


KANDINSKY5 = _family("kandinsky5", "Kandinsky5Transformer3DModel",
                     dict(in_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=TEXT_DIM, time_dim=DIM, out_visual_dim=4,
                          patch_size=(1, 2, 2), model_dim=DIM, ff_dim=64, num_text_blocks=2, num_visual_blocks=2,
                          axes_dims=ROPE_3AXES),
                     with_flag_inputs(_kandinsky5_inputs, {"visual_cond": _kandinsky5_visual_cond}),
                     {"visual_transformer_blocks": "num_visual_blocks"}, 1, video=True,
                     # heads of sum(axes_dims) channels
                     heads_of=lambda c: (c["model_dim"] // sum(c["axes_dims"]), sum(c["axes_dims"])),
                     pipeline_class="Kandinsky5T2VPipeline",
                     width_keys=("model_dim", "ff_dim"))


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
_motif_video_inputs = _text_inputs("text_embed_dim")


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


# ----------------------------------------------------------------------------------------- easyanimate
_easyanimate_inputs = _text_inputs("text_embed_dim", mask=None)


EASYANIMATE = _family("easyanimate", "EasyAnimateTransformer3DModel",
                      dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
                           patch_size=2, sample_width=8, sample_height=8, num_layers=2, mmdit_layers=2,
                           time_embed_dim=DIM, text_embed_dim=TEXT_DIM),
                      _easyanimate_inputs, {"transformer_blocks": "num_layers"}, 2, video=True,
                      pipeline_class="EasyAnimatePipeline")


MORE_AV_FAMILIES = (SKYREELS_V2, CHRONOEDIT, LATTE, ALLEGRO, MOCHI, STABLE_AUDIO, SANA_VIDEO, COSMOS, WAN_VACE,
                    HUNYUANVIDEO15, CONSISID, KANDINSKY5, HELIOS, ANYFLOW, MOTIF_VIDEO, LONGCAT_AUDIO, STABLE_AUDIO3,
                    EASYANIMATE)
