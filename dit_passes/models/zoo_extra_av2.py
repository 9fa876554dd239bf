"""Tiny configs of diffusers' packed omni / world-model and flex-attention video classes (see ``zoo_extra_av``).

These classes' calls carry more than latents and text: a packed multi-modal sequence with its index tensors
(Cosmos 3), a KV cache of an earlier reference / context pass (AnyFlow-FAR, SANA-WM refiner, Wan-Animate 2),
camera tensors (SANA-WM). Their inputs are built here the way the pipelines build them; a KV cache holds random
keys / values of the shapes that pass writes.
"""
from __future__ import annotations

import torch

from dit_passes.models.zoo_common import (MAX_BATCH, cfg_rows, check_batch, inner_width, randn, text_mask, text_rows,
                                          timestep_rows)
from dit_passes.models.zoo_more import DIM, HEAD_DIM, HEADS, TEXT_DIM, _family


def _kv_rows(gen: torch.Generator, batch: int, *shape: int) -> torch.Tensor:
    """Cached keys and values ``(2, batch, *shape)``, one draw per row (the rows of a CFG pair saw different
    prompts); row 0 equals the batch-1 draw."""
    return text_rows(gen, batch, 2, *shape).movedim(1, 0).contiguous()


# ----------------------------------------------------------------------------- cosmos 3 (omni, packed)
def _cosmos3_inputs(config, batch, sizes, gen):
    """Cosmos3OmniPipeline's packed call: [text | vision | sound | action] rows in one sequence (no batch axis:
    the pipeline runs CFG as two calls; ``batch=2`` packs two vision items, as the list arguments allow), the first
    vision and action frames as conditions, 3-axis mRoPE positions with fps modulation (float positions)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (get_3d_mrope_ids_text_tokens,
                                                                  get_3d_mrope_ids_vae_tokens)
    check_batch(batch)
    f, h, w = sizes["grid"]
    text, sound_len, action_len = sizes["text"], 2 * f, f
    p, c = config["latent_patch_size"], config["latent_channel"]
    input_ids = torch.randint(config["vocab_size"], (MAX_BATCH, text), generator=gen)[0]
    text_ids, offset = get_3d_mrope_ids_text_tokens(text, 0, use_float_positions=True)
    offset += config["unified_3d_mrope_temporal_modality_margin"]
    latents = cfg_rows(gen, 1, c, f, h * p, w * p)
    curr, positions, vision_shapes, vision_seq, vision_mse, vision_noisy = text, [text_ids], [], [], [], []
    for _ in range(batch):
        noisy = torch.arange(1, f)  # frame 0 is the image condition
        ids, _ = get_3d_mrope_ids_vae_tokens(f, h, w, offset, fps=24.0, base_fps=float(config["base_fps"]),
                                             temporal_compression_factor=4)
        positions.append(ids)
        vision_shapes.append((f, h, w))
        vision_seq.append(torch.arange(curr, curr + f * h * w))
        vision_mse.append(torch.arange(curr + h * w, curr + f * h * w))
        vision_noisy.append(noisy)
        curr += f * h * w
    t = float(timestep_rows(gen, 1, 1000.0))
    # the sound / action rows only where the class has their heads (sound_gen / action_gen): without them it has
    # no audio_proj_in / action_proj_in, and the pipeline packs no such rows
    extra = {}
    if config.get("sound_gen"):
        sound_ids, _ = get_3d_mrope_ids_vae_tokens(sound_len, 1, 1, offset, fps=25.0,
                                                   base_fps=float(config["base_fps"]), temporal_compression_factor=1)
        sound_seq = torch.arange(curr, curr + sound_len)
        positions.append(sound_ids)
        curr += sound_len
        extra.update(sound_tokens=[randn(gen, config["sound_dim"], sound_len)], sound_token_shapes=[(sound_len, 1, 1)],
                     sound_sequence_indexes=sound_seq, sound_mse_loss_indexes=sound_seq.clone(),
                     sound_timesteps=torch.full((sound_len,), t), sound_noisy_frame_indexes=[torch.arange(sound_len)])
    if config.get("action_gen"):
        action_ids, _ = get_3d_mrope_ids_vae_tokens(action_len, 1, 1, offset, fps=24.0,
                                                    base_fps=float(config["base_fps"]), temporal_compression_factor=1,
                                                    base_temporal_compression_factor=4, start_frame_offset=1)
        action_seq = torch.arange(curr, curr + action_len)
        positions.append(action_ids)
        curr += action_len
        extra.update(action_tokens=[randn(gen, action_len, config["action_dim"])],
                     action_token_shapes=[(action_len, 1, 1)], action_sequence_indexes=action_seq,
                     action_mse_loss_indexes=action_seq[1:], action_timesteps=torch.full((action_len - 1,), t),
                     action_noisy_frame_indexes=[torch.arange(1, action_len)], action_domain_ids=[torch.tensor(1)])
    return {
        "input_ids": input_ids,
        "text_indexes": torch.arange(text),
        "position_ids": torch.cat(positions, dim=1),
        "und_len": text,
        "sequence_length": curr,
        "vision_tokens": [latents] * batch,
        "vision_token_shapes": vision_shapes,
        "vision_sequence_indexes": torch.cat(vision_seq),
        "vision_mse_loss_indexes": torch.cat(vision_mse),
        "vision_timesteps": torch.full((batch * (f - 1) * h * w,), t),
        "vision_noisy_frame_indexes": vision_noisy,
        **extra,
        "return_dict": False,
    }


# GQA (1 kv head), sound and action heads (domain-aware action projections), mRoPE sections (4, 2, 2) of 8
COSMOS3 = _family("cosmos3", "Cosmos3OmniTransformer",
                  dict(head_dim=HEAD_DIM, hidden_size=DIM, intermediate_size=64, latent_channel=4, latent_patch_size=2,
                       num_attention_heads=HEADS, num_hidden_layers=2, num_key_value_heads=1, patch_latent_dim=16,
                       rope_theta=10000.0, action_dim=4, action_gen=True, num_embodiment_domains=2, sound_dim=8,
                       sound_gen=True, vocab_size=64, rope_axes_dim=(4, 2, 2), base_fps=24, enable_fps_modulation=True,
                       unified_3d_mrope_temporal_modality_margin=15000),
                  _cosmos3_inputs, {"layers": "num_hidden_layers"}, 2, video=True, head_dim_key="head_dim",
                  pipeline_class="Cosmos3OmniPipeline",
                  width_keys=("hidden_size", "intermediate_size", "num_key_value_heads"))


# ------------------------------------------------------------------------------ anyflow FAR (causal chunks)
def _anyflow_far_inputs(config, batch, sizes, gen):
    """AnyFlowFARPipeline's denoising call for the third chunk of [f, f, f] frames: the chunk in (B, F, C, H, W),
    per-frame timesteps, and a KV cache from the two earlier chunks' cache steps (the first one already demoted to
    the FAR-compressed context, as ``full_chunk_limit=2`` makes it)."""
    f, h, w = sizes["grid"]
    _, ph, pw = config["patch_size"]
    _, ch, cw = config["compressed_patch_size"]
    partition = [f, f, f]
    full_tokens = config["full_chunk_limit"] * f * h * w
    compressed_tokens = (len(partition) - config["full_chunk_limit"] + 1) * f * (h * ph // ch) * (w * pw // cw)
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    t = timestep_rows(gen, batch, 1000.0)[:, None].expand(-1, f).contiguous()
    out = {
        "hidden_states": cfg_rows(gen, batch, f, config["in_channels"], h * ph, w * pw),
        "timestep": t,
        "r_timestep": t * 0.5,  # the flow-map target timestep (use_mean_velocity)
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_dim"]),
        "chunk_partition": partition,
    }
    out["kv_cache"] = {layer: {"full_cache": _kv_rows(gen, batch, heads, full_tokens, head_dim),
                               "compressed_cache": _kv_rows(gen, batch, heads, compressed_tokens, head_dim)}
                       for layer in range(config["num_layers"])}
    out["kv_cache_flag"] = {"num_cached_chunks": len(partition) - 1, "is_cache_step": False}
    out["return_dict"] = False
    return out


ANYFLOW_FAR = _family("anyflow_far", "AnyFlowFARTransformer3DModel",
                      dict(patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=2,
                           num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4,
                           text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
                           chunk_partition=(2, 2, 2)),
                      _anyflow_far_inputs, {"blocks": "num_layers"}, 1, video=True, warm_up=True,
                      pipeline_class="AnyFlowFARPipeline")


# ------------------------------------------------------------------------ kandinsky 6 SR (NABLA, flex)
def _kandinsky6_sr_inputs(config, batch, sizes, gen):
    f, h, w = sizes["grid"]
    latents = cfg_rows(gen, batch, f, h, w, config["in_visual_dim"])
    return {
        # Kandinsky6SRPipeline: [latent | anchor latent | anchor mask], anchor-free (zeros)
        "hidden_states": torch.cat([latents, torch.zeros_like(latents), torch.zeros(batch, f, h, w, 1)], dim=-1),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "return_dict": False,
    }


# NABLA attention groups 8x8 token tiles into blocks of 64 tokens: the grid must be 8-divisible (patch 1);
# a (3, 3, 3) sliding-tile window, a widened (pi-flow style) output
KANDINSKY6_SR = _family("kandinsky6_sr", "Kandinsky6SRTransformer3DModel",
                        dict(in_visual_dim=4, out_visual_dim=8, time_dim=DIM, patch_size=(1, 1, 1), model_dim=DIM,
                             ff_dim=64, num_visual_blocks=2, axes_dims=(4, 6, 6), nabla_window=(3, 3, 3)),
                        _kandinsky6_sr_inputs, {"visual_transformer_blocks": "num_visual_blocks"}, 1,
                        sizes_by_variant={"default": {"grid": (2, 8, 8), "text": 0},
                                          "alt_resolution": {"grid": (1, 8, 16), "text": 0}},
                        heads_of=lambda c: (c["model_dim"] // sum(c["axes_dims"]), sum(c["axes_dims"])),
                        pipeline_class="Kandinsky6SRPipeline",
                        width_keys=("model_dim", "ff_dim"))


# ---------------------------------------------------------------------- wan animate 2 (in-context, flex)
def _wan_animate2_inputs(config, batch, sizes, gen):
    """The generation pass (``kv_cache_mode="cached"``) after the reference pass: per-sample lists of latents /
    conditions / text, the f + 1 generation frames attending to the f reference frames of the cache at the same
    frame index (the flex block mask), the reference grid as a tensor (its width resolves ``refer_offset_w=-1``)."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
    f, h, w = sizes["grid"]
    _, ph, pw = config["patch_size"]
    heads = config["num_heads"]
    latents = cfg_rows(gen, batch, config["out_dim"], f + 1, h * ph, w * pw)
    conditions = cfg_rows(gen, batch, config["in_dim"] - config["out_dim"], f + 1, h * ph, w * pw)
    text = text_rows(gen, batch, sizes["text"], config["text_dim"])
    cache = WanAnimate2KVCache(config["num_layers"])
    for layer in range(config["num_layers"]):  # pre-RoPE reference keys / values, (B, f*h*w, heads, head_dim)
        cache.get(layer).store(*_kv_rows(gen, batch, f * h * w, heads, config["dim"] // heads).unbind(0))
    return {
        "hidden_states": list(latents.unbind(0)),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": list(text.unbind(0)),
        "condition_latents": list(conditions.unbind(0)),
        "kv_cache": cache,
        "kv_cache_mode": "cached",
        "seq_len": (f + 1) * h * w,
        "encoder_hidden_states_image": text_rows(gen, batch, 4, 1280),  # CLIP ViT-H tokens (MLPProj(1280, dim))
        "reference_grid_sizes": torch.tensor([[f, h, w]] * batch),
        "origin_len": 4 * (f - 1),  # pixel frames of the full video: f latent frames
        "origin_area": [16 * h, 16 * w],  # pixel size: h x w tokens after the VAE (8) and the patch (2)
        "return_dict": False,
    }


WAN_ANIMATE2 = _family("wan_animate2", "WanAnimate2Transformer3DModel",
                       dict(patch_size=(1, 2, 2), text_len=12, in_dim=12, dim=DIM, ffn_dim=64, freq_dim=32,
                            text_dim=TEXT_DIM, out_dim=4, num_heads=HEADS, num_layers=2, use_img_emb=True),
                       _wan_animate2_inputs, {"blocks": "num_layers"}, 1, video=True, warm_up=True,
                       heads_key="num_heads", head_dim_key=None, hidden_key="dim")


# ------------------------------------------------------------------------- sana-wm (camera-controlled)
_SANA_WM_VAE_STRIDE = (2, 8, 8)  # temporal / spatial VAE strides of the tiny camera packing (the VAE's: 8, 32, 32)


def _sana_wm_camera(f, h, w):
    """SanaWMPipeline's camera tensors for a forward-then-turn trajectory over the clip's pixel frames: the
    per-latent-frame raymap ``(f, 20)`` and the chunk Plucker map ``(6 * stride_t, f, h, w)``."""
    from diffusers.pipelines.sana_wm.cam_utils import action_string_to_c2w, prepare_camera
    stride_t, stride_s, _ = _SANA_WM_VAE_STRIDE
    steps = stride_t * (f - 1)  # pixel frames - 1
    c2w = action_string_to_c2w(f"w-{(steps + 1) // 2},jw-{steps // 2}")
    intrinsics = torch.tensor([[w * stride_s * 0.8, h * stride_s * 0.8, w * stride_s / 2, h * stride_s / 2]])
    cam = prepare_camera(c2w, intrinsics.expand(len(c2w), -1).numpy(), target_size=(h * stride_s, w * stride_s),
                         vae_stride=_SANA_WM_VAE_STRIDE)
    return cam["raymap"], cam["chunk_plucker"]


def _sana_wm_inputs(config, batch, sizes, gen):
    """SanaWMPipeline's stage-1 call: the first latent frame is the clean image anchor (per-frame timestep 0),
    text as (B, 1, L, D) with its mask, the raw camera conditions and the chunk Plucker map."""
    f, h, w = sizes["grid"]
    text = sizes["text"]
    raymap, plucker = _sana_wm_camera(f, h, w)
    timestep = timestep_rows(gen, batch, 1000.0)[:, None, None].expand(-1, 1, f).clone()
    timestep[:, :, 0] = 0.0
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], f, h, w),
        "timestep": timestep,
        "encoder_hidden_states": text_rows(gen, batch, text, config["caption_channels"])[:, None],
        "mask": text_mask(batch, text, torch.long),
        "camera_conditions": raymap[None].expand(batch, -1, -1).contiguous(),
        "chunk_plucker": plucker[None].expand(batch, -1, -1, -1, -1).contiguous(),
        "return_dict": False,
    }


# one GDN (gated delta-net, UCPE camera) block and one softmax block (softmax_every_n=2; the checkpoint: every
# 4th of 20), the chunk-Plucker post-attention branch in every block, GLUMBConvTemp feed-forward
SANA_WM = _family("sana_wm", "SanaWMTransformer3DModel",
                  dict(in_channels=4, num_layers=2, hidden_size=DIM, num_attention_heads=HEADS, patch_size=(1, 1, 1),
                       softmax_every_n=2, linear_head_dim=HEAD_DIM, chunk_plucker_channels=6 * _SANA_WM_VAE_STRIDE[0],
                       chunk_plucker_post_attn_blocks=2, caption_channels=TEXT_DIM, mlp_ratio=2.0),
                  _sana_wm_inputs, {"blocks": "num_layers"}, 1, video=True, head_dim_key="linear_head_dim",
                  pipeline_class="SanaWMPipeline",
                  # the blocks' cross-attention splits hidden_size over the heads, their self-attention over
                  # hidden_size // linear_head_dim heads (the checkpoint: 20 x 112 = 2240)
                  tied_config=inner_width("hidden_size", head_dim="linear_head_dim"))


# ------------------------------------------------------------------- sana-wm stage 2 (LTX-2 AR refiner)
def _refiner_rope(config):
    """The refiner's ``build_rotary_emb_for_absolute_positions`` on a rope built as the class builds it from
    ``config`` (the class defaults filling the fields the zoo does not set)."""
    import functools
    import inspect
    import types

    import diffusers
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2AudioVideoRotaryPosEmbed
    cls = diffusers.SanaWMLTX2RefinerTransformer3DModel
    c = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if p.default is not p.empty}
    c.update(config)
    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=c["num_attention_heads"] * c["attention_head_dim"], patch_size=c["patch_size"],
        patch_size_t=c["patch_size_t"], base_num_frames=c["pos_embed_max_pos"], base_height=c["base_height"],
        base_width=c["base_width"], scale_factors=c["vae_scale_factors"], theta=c["rope_theta"],
        causal_offset=c["causal_offset"], modality="video", double_precision=c["rope_double_precision"],
        rope_type=c["rope_type"], num_attention_heads=c["num_attention_heads"])
    return functools.partial(cls.build_rotary_emb_for_absolute_positions, types.SimpleNamespace(rope=rope))


def _sana_wm_refiner_inputs(config, batch, sizes, gen):
    """The refiner's denoising call (``kv_cache_mode="inject"``) for the AR block after a 1-frame attention sink
    and 1 refined history frame: the block's f frames at their absolute positions, the sink keys pre-RoPE (re-RoPE'd
    with the cache's ``sink_pe``), the history keys / values post-RoPE."""
    from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache
    f, h, w = sizes["grid"]
    text = sizes["text"]
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    rope = _refiner_rope(config)
    sink, history = 1, 1
    cache = SanaWMRefinerKVCache(config["num_layers"])
    cache.sink_pe = rope(batch_size=batch, frame_positions=list(range(sink)), height=h, width=w,
                         device=torch.device("cpu"), fps=24.0)
    for layer in range(config["num_layers"]):
        cache.get(layer).store_sink(*_kv_rows(gen, batch, sink * h * w, inner).unbind(0))
        cache.get(layer).store_history(*_kv_rows(gen, batch, history * h * w, inner).unbind(0))
    start = sink + history
    return {
        "hidden_states": cfg_rows(gen, batch, f * h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["caption_channels"]),
        "timestep": timestep_rows(gen, batch, 1000.0)[:, None].expand(-1, f * h * w).contiguous(),
        "video_rotary_emb": rope(batch_size=batch, frame_positions=list(range(start, start + f)), height=h, width=w,
                                 device=torch.device("cpu"), fps=24.0),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "kv_cache": cache,
        "kv_cache_mode": "inject",
        "return_dict": False,
    }


# the refiner runs the video stream of an LTX-2 checkpoint: gated attention on, the prompt modulation off (its
# forward takes the 6 base modulation parameters only)
SANA_WM_REFINER = _family("sana_wm_refiner", "SanaWMLTX2RefinerTransformer3DModel",
                          dict(in_channels=8, out_channels=8, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                               cross_attention_dim=DIM, gated_attn=True, audio_in_channels=8, audio_out_channels=8,
                               audio_num_attention_heads=HEADS, audio_attention_head_dim=HEAD_DIM,
                               audio_cross_attention_dim=DIM, num_layers=2, caption_channels=TEXT_DIM),
                          _sana_wm_refiner_inputs, {"transformer_blocks": "num_layers"}, 1, video=True,
                          pipeline_class="SanaWMPipeline",
                          tied_config=inner_width("cross_attention_dim"),  # the caption projection: heads x head_dim
                          width_keys=("audio_num_attention_heads", "audio_cross_attention_dim"))


EXTRA_AV2_FAMILIES = (COSMOS3, ANYFLOW_FAR, KANDINSKY6_SR, WAN_ANIMATE2, SANA_WM, SANA_WM_REFINER)
