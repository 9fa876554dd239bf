"""Tiny configs of diffusers' newer video and audio DiT classes, for the coverage matrix (see ``zoo_more``).

Same sizes and rules as ``zoo_more_av``: 2 heads x 16 channels, >= 2 blocks per list, the options that change
the graph turned on (rotary embeddings, masks, GQA, refiner / text stacks, conditioning branches), inputs as the
matching pipeline builds them. Classes whose call carries a KV cache, a packed multi-modal sequence or camera
tensors build those here from the config (the cache holds random keys / values of the shapes a reference pass
writes). The heavier ones (packed omni / world models, flex-attention classes) are in ``zoo_extra_av2``.
"""
from __future__ import annotations

import torch

from dit_passes.models.zoo_common import cfg_rows, inner_width, text_mask, text_rows, timestep_rows
from dit_passes.models.zoo_extra_av2 import EXTRA_AV2_FAMILIES
from dit_passes.models.zoo_more import DIM, HEAD_DIM, HEADS, ROPE_3AXES, TEXT_DIM, _family

_AUDIO_SIZES = {"default": {"grid": (16,), "text": 8}, "alt_resolution": {"grid": (24,), "text": 8}}


# ------------------------------------------------------------------------------------ ace-step (music)
def _ace_step_inputs(config, batch, sizes, gen):
    (length,) = sizes["grid"]
    t = timestep_rows(gen, batch, 1.0)
    acoustic = config["audio_acoustic_hidden_dim"]
    return {
        "hidden_states": cfg_rows(gen, batch, length, acoustic),
        "timestep": t,
        "timestep_r": t.clone(),  # AceStepPipeline: r = t for plain inference
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["encoder_hidden_size"]),
        # source latents and the chunk mask, concatenated on channels (AceStepPipeline)
        "context_latents": cfg_rows(gen, batch, length, config["in_channels"] - acoustic),
        "return_dict": False,
    }


# layer_types default: sliding-window then full attention; GQA (1 kv head); the window is shorter than the
# 8 / 12 tokens after the stride-2 patch conv, so the sliding mask masks
ACE_STEP = _family("ace_step", "AceStepTransformer1DModel",
                   dict(hidden_size=DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
                        num_key_value_heads=1, head_dim=HEAD_DIM, in_channels=24, audio_acoustic_hidden_dim=8,
                        patch_size=2, sliding_window=2, encoder_hidden_size=TEXT_DIM),
                   _ace_step_inputs, {"layers": "num_hidden_layers"}, 1, sizes_by_variant=_AUDIO_SIZES,
                   head_dim_key="head_dim", pipeline_class="AceStepPipeline",
                   width_keys=("hidden_size", "intermediate_size", "encoder_hidden_size", "num_key_value_heads"))


# ------------------------------------------------------------------------------- minimax music 3 (1-D)
def _minimax_music3_inputs(config, batch, sizes, gen):
    (length,) = sizes["grid"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], length),
        "timestep": timestep_rows(gen, batch, 1.0),
        # frame-aligned conditioning from the language-model stage
        "encoder_hidden_states": text_rows(gen, batch, length, config["condition_dim"]),
        "return_dict": False,
    }


# rotary_dim < head_dim: the partial rotary path (the rest of each head passes through)
MINIMAX_MUSIC3 = _family("minimax_music3", "MiniMaxMusic3Transformer1DModel",
                         dict(in_channels=8, condition_dim=TEXT_DIM, num_layers=2, num_attention_heads=HEADS,
                              attention_head_dim=HEAD_DIM, ff_inner_dim=64, rotary_dim=8, fourier_embedding_dim=32),
                         _minimax_music3_inputs, {"transformer_blocks": "num_layers"}, 1,
                         sizes_by_variant=_AUDIO_SIZES)


# ------------------------------------------------------------------------- minimax h3 (packed video+audio)
_H3_TEXT, _H3_VIDEO, _H3_AUDIO = 1, 0, 2  # modality tags of the packed rows


def _minimax_h3_inputs(config, batch, sizes, gen):
    """The packed layout the model docstring describes: [text | conditioning frame | audio | target frames], the
    conditioning rows at timestep 0 (index 1 of ``timestep``), the rest at the step's timestep (index 0)."""
    f, h, w = sizes["grid"]
    text, audio = sizes["text"], 2 * f
    pt, ph, pw = config["patch_size"]
    patch_dim = config["in_channels"] * pt * ph * pw
    video = (f + 1) * h * w  # one clean conditioning frame ahead of the f target frames
    seq = text + video + audio
    text_idx = torch.arange(text)
    cond_idx = torch.arange(text, text + h * w)
    audio_idx = torch.arange(text + h * w, text + h * w + audio)
    target_idx = torch.arange(text + h * w + audio, seq)
    tags = torch.full((seq,), _H3_VIDEO, dtype=torch.long)
    tags[text_idx], tags[audio_idx] = _H3_TEXT, _H3_AUDIO
    t_index = torch.zeros(seq, dtype=torch.long)
    t_index[cond_idx] = 1
    grid = torch.stack(torch.meshgrid(torch.arange(f + 1), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos = torch.zeros(seq, 3, dtype=torch.long)
    pos[text_idx] = text_idx[:, None]  # text on the diagonal ahead of the grid
    pos[torch.cat([cond_idx, target_idx])] = grid.reshape(-1, 3) + text
    pos[audio_idx, 0] = torch.arange(audio) // 2 + 1 + text
    return {
        "hidden_states": cfg_rows(gen, batch, video, patch_dim),
        "audio_hidden_states": cfg_rows(gen, batch, audio, config["audio_in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_dim"]),
        "timestep": torch.cat([timestep_rows(gen, 1, 1.0), torch.zeros(1)]),
        "timestep_indices": t_index,
        "token_tags": tags,
        "position_ids": pos,
        "video_indices": torch.cat([cond_idx, target_idx]),
        "audio_indices": audio_idx,
        "text_indices": text_idx,
        "return_dict": False,
    }


# rope_freq_dim=2: 12 of the 16 head channels rotate, 4 pass through
MINIMAX_H3 = _family("minimax_h3", "MiniMaxH3Transformer3DModel",
                     dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, hidden_size=DIM, num_layers=2,
                          num_refiner_layers=2, ffn_dim=64, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2),
                          text_dim=TEXT_DIM, freq_dim=32, time_embed_hidden_dim=DIM, time_embed_dim=16,
                          rope_freq_dim=2),
                     _minimax_h3_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                     aux_list_keys={"token_refiner.refiner_blocks": "num_refiner_layers"},
                     width_keys=("hidden_size", "ffn_dim", "text_dim"))


# ------------------------------------------------------------------------- kandinsky 6 (video + audio)
def _kandinsky6_inputs(config, batch, sizes, gen):
    """Kandinsky6TI2VAPipeline with a reference image: the clean first frame is appended as a masked tail frame
    that reuses rotary position 0 and carries token type 1; channels are [latent | conditioning latent | mask].
    Without ``visual_cond`` the class takes the latent channels alone and the pipeline refuses an image: its
    text-to-video call (no tail frame, default rotary positions, no token types)."""
    f, h, w = sizes["grid"]
    text = sizes["text"]
    pt, ph, pw = config["patch_size"]
    c = config["in_visual_dim"]
    if not config.get("visual_cond", True):  # the class's default is True
        return {
            "hidden_states": cfg_rows(gen, batch, f, h * ph, w * pw, c),
            "audio_hidden_states": cfg_rows(gen, batch, 2 * f, config["in_audio_dim"]),
            "encoder_hidden_states": text_rows(gen, batch, text, config["in_text_dim"]),
            "pooled_projections": text_rows(gen, batch, config["in_text_dim2"]),
            "timestep": timestep_rows(gen, batch, 1000.0),
            "encoder_attention_mask": text_mask(batch, text, torch.bool),
            "return_dict": False,
        }
    latents = cfg_rows(gen, batch, f + 1, h * ph, w * pw, c)
    cond_mask = torch.zeros(batch, f + 1, h * ph, w * pw, 1)
    cond_mask[:, -1] = 1.0
    token_types = torch.zeros(batch, f + 1, dtype=torch.long)
    token_types[:, -1] = 1
    return {
        "hidden_states": torch.cat([latents, torch.zeros_like(latents), cond_mask], dim=-1),
        "audio_hidden_states": cfg_rows(gen, batch, 2 * f, config["in_audio_dim"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["in_text_dim"]),
        "pooled_projections": text_rows(gen, batch, config["in_text_dim2"]),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "visual_rope_pos": (torch.cat([torch.arange(f), torch.zeros(1, dtype=torch.long)]), torch.arange(h),
                            torch.arange(w)),
        "encoder_attention_mask": text_mask(batch, text, torch.bool),
        "visual_token_type_ids": token_types,
        "return_dict": False,
    }


# the released checkpoints' options: cross-modal rope and gates, fixed modulation, token types
KANDINSKY6 = _family("kandinsky6", "Kandinsky6Transformer3DModel",
                     dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=TEXT_DIM, time_dim=DIM,
                          patch_size=(1, 2, 2), model_dim=DIM, ff_dim=64, num_text_blocks=2, num_visual_blocks=2,
                          axes_dims=ROPE_3AXES, visual_cond=True, in_audio_dim=8, out_audio_dim=8,
                          text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
                          visual_token_type_num_embeddings=2),
                     _kandinsky6_inputs, {"visual_transformer_blocks": "num_visual_blocks"}, 2, video=True,
                     aux_list_keys={"video_text_transformer_blocks": "num_text_blocks",
                                    "audio_text_transformer_blocks": "num_text_blocks"},
                     heads_of=lambda c: (c["model_dim"] // sum(c["axes_dims"]), sum(c["axes_dims"])),
                     pipeline_class="Kandinsky6TI2VAPipeline",
                     width_keys=("model_dim", "ff_dim"))


# -------------------------------------------------------------------------------- ltx 2 (video + audio)
def _ltx2_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    text = sizes["text"]
    audio = 2 * f
    t = timestep_rows(gen, batch, 1000.0)
    mask = text_mask(batch, text, torch.long)
    # LTX-2.0 projects the captions inside the model; without use_prompt_embeddings (LTX-2.3) the pipeline's
    # connector hands each modality its text already at the cross-attention's width
    inside = config.get("use_prompt_embeddings", True)
    video_text = config["caption_channels"] if inside else config["cross_attention_dim"]
    audio_text = config["caption_channels"] if inside else config["audio_cross_attention_dim"]
    return {
        # LTX2Pipeline packs the latents to (B, F*H*W, C) and (B, audio frames, C)
        "hidden_states": cfg_rows(gen, batch, f * h * w, config["in_channels"]),
        "audio_hidden_states": cfg_rows(gen, batch, audio, config["audio_in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, video_text),
        "audio_encoder_hidden_states": text_rows(gen, batch, text, audio_text),
        "timestep": t,
        "sigma": t.clone(),  # LTX2Pipeline passes sigma=timestep (LTX-2.3 prompt modulation)
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask.clone(),
        # the coordinates the pipeline precomputes with the model's own rope are what forward builds from these
        "num_frames": f,
        "height": h,
        "width": w,
        "fps": 24.0,
        "audio_num_frames": audio,
        "use_cross_timestep": True,
        "return_dict": False,
    }


# LTX-2.3 options: gated attention, prompt cross-attention modulation (with its adaln), split rope
LTX2 = _family("ltx2", "LTX2VideoTransformer3DModel",
               dict(in_channels=8, out_channels=8, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                    cross_attention_dim=DIM, gated_attn=True, cross_attn_mod=True, audio_in_channels=8,
                    audio_out_channels=8, audio_num_attention_heads=HEADS, audio_attention_head_dim=HEAD_DIM,
                    audio_cross_attention_dim=DIM, audio_gated_attn=True, audio_cross_attn_mod=True, num_layers=2,
                    caption_channels=TEXT_DIM, rope_type="split", use_prompt_adaln_single=True),
               _ltx2_inputs, {"transformer_blocks": "num_layers"}, 2, video=True, pipeline_class="LTX2Pipeline",
               tied_config=inner_width("cross_attention_dim"),  # the video caption projection: heads x head_dim
               width_keys=("audio_num_attention_heads", "audio_cross_attention_dim"))



# -------------------------------------------------------------------------- hunyuanvideo framepack
# history latent frames of the inverted anti-drifting sampler: 4x, 2x, 1x (the pipeline's [16, 2, 1], scaled down)
_FRAMEPACK_HISTORY = (4, 2, 1)


def _framepack_inputs(config, batch, sizes, gen):
    """HunyuanVideoFramepackPipeline (inverted anti-drifting, first section): frame indices laid out as
    [prefix | padding | window | 1x | 2x | 4x] history, the clean latents = prefix image + 1x history."""
    f, h, w = sizes["grid"]
    text = sizes["text"]
    p = config["patch_size"]
    c = config["in_channels"]
    h4, h2, h1 = _FRAMEPACK_HISTORY
    pad = f  # latent_paddings[0] * latent_window_size with one padding section
    idx = torch.arange(1 + pad + f + h1 + h2 + h4)
    prefix, _, window, hist1, hist2, hist4 = idx.split([1, pad, f, h1, h2, h4])
    return {
        "hidden_states": cfg_rows(gen, batch, c, f, h * p, w * p),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "pooled_projections": text_rows(gen, batch, config["pooled_projection_dim"]),
        "image_embeds": text_rows(gen, batch, 4, config["image_proj_dim"]),
        "indices_latents": window,
        "guidance": torch.full((batch,), 10.0 * 1000.0),  # the pipeline scales the distilled guidance by 1000
        "latents_clean": cfg_rows(gen, batch, c, 1 + h1, h * p, w * p),
        "indices_latents_clean": torch.cat([prefix, hist1]),
        "latents_history_2x": cfg_rows(gen, batch, c, h2, h * p, w * p),
        "indices_latents_history_2x": hist2,
        "latents_history_4x": cfg_rows(gen, batch, c, h4, h * p, w * p),
        "indices_latents_history_4x": hist4,
        "return_dict": False,
    }


# the released checkpoint's options: SigLIP image projection, clean / 2x / 4x history embedders, guidance embedding
FRAMEPACK = _family("framepack", "HunyuanVideoFramepackTransformer3DModel",
                    dict(in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                         num_layers=2, num_single_layers=2, num_refiner_layers=2, patch_size=2, patch_size_t=1,
                         guidance_embeds=True, text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
                         rope_axes_dim=ROPE_3AXES, has_image_proj=True, image_proj_dim=TEXT_DIM,
                         has_clean_x_embedder=True),
                    _framepack_inputs, {"transformer_blocks": "num_layers",
                                        "single_transformer_blocks": "num_single_layers"}, 2, video=True,
                    aux_list_keys={"context_embedder.token_refiner.refiner_blocks": "num_refiner_layers"},
                    pipeline_class="HunyuanVideoFramepackPipeline")


# ------------------------------------------------------------------------------------- wan animate
def _wan_animate_inputs(config, batch, sizes, gen):
    """WanAnimatePipeline: [noisy | mask + reference latents] channels over the reference frame + f frames, pose
    latents for the f frames, the face video in pixels (5 frames: 2 motion frames after the face encoder's
    two stride-2 convs, plus its padding frame = the f + 1 latent frames)."""
    f, h, w = sizes["grid"]
    _, ph, pw = config["patch_size"]
    face = config["motion_encoder_size"]
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], f + 1, h * ph, w * pw),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_dim"]),
        "encoder_hidden_states_image": text_rows(gen, batch, 4, config["image_dim"]),
        "pose_hidden_states": cfg_rows(gen, batch, config["latent_channels"], f, h * ph, w * pw),
        "face_pixel_values": cfg_rows(gen, batch, 3, 4 * f - 3, face, face).clamp(-1, 1),
        "return_dict": False,
    }


# 4 blocks with a face adapter after every second (the checkpoint: every fifth of 40); the motion encoder on
# 8x8 faces in batches of 4 frames (two batches: the split loop)
WAN_ANIMATE = _family("wan_animate", "WanAnimateTransformer3DModel",
                      dict(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                           in_channels=12, latent_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32,
                           ffn_dim=64, num_layers=4, image_dim=TEXT_DIM, rope_max_seq_len=64,
                           motion_encoder_channel_sizes={"8": 8, "4": 8}, motion_encoder_size=8,
                           motion_style_dim=16, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
                           face_encoder_num_heads=2, inject_face_latents_blocks=2, motion_encoder_batch_size=4),
                      _wan_animate_inputs, {"blocks": "num_layers"}, 1, video=True,
                      pipeline_class="WanAnimatePipeline",
                      # the class builds num_layers // interval face adapters but runs one at every block
                      # i % interval == 0, so a block count the interval does not divide (every drawn one: 1 or 3)
                      # indexes past the list (diffusers' bug; the checkpoint's 40 / 5 divides): then an adapter
                      # after every block
                      tied_config=lambda c: {"inject_face_latents_blocks": 2 if c["num_layers"] % 2 == 0 else 1})


EXTRA_AV_FAMILIES = (ACE_STEP, MINIMAX_MUSIC3, MINIMAX_H3, KANDINSKY6, LTX2, FRAMEPACK,
                     WAN_ANIMATE) + EXTRA_AV2_FAMILIES
