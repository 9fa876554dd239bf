"""Tiny variants of the zoo's families with the structural flags of real checkpoints (``family[tag]``).

The zoo's base configs pick one setting per class; the checkpoints people run set others (FLUX.1-schnell has no
guidance embedder, Wan 2.1 I2V adds an image cross-attention, HunyuanVideo I2V replaces the first frame's
modulation, CogVideoX 1.5 patches time, Wan 2.2 TI2V and LTX I2V give every token its own timestep, ...). Each
variant keeps every such flag of the real ``config.json`` (and the inputs its pipeline passes), shrunk to the
zoo's sizes (2 heads x 16 channels, 2 blocks per list, few tokens). ``zoo.build("flux[schnell]")`` builds one;
``dit-passes coverage`` lists them as rows of their class.

A variant is a :class:`FamilySpec` derived from its base family: ``overrides`` replace config fields and
``inputs`` (when given) wraps the base family's input builder as ``inputs(base, config, batch, sizes, gen)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from diffusers.models.embeddings import get_3d_rotary_pos_embed

from dit_passes.models.zoo_common import FamilySpec, cfg_rows, text_rows


@dataclasses.dataclass(frozen=True)
class Variant:
    family: str                     # the base family
    tag: str                        # the name in brackets: "flux[schnell]"
    checkpoints: str                # which real checkpoints set these flags
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inputs: Callable | None = None  # (base_inputs, config, batch, sizes, gen) -> kwargs
    sizes_by_variant: Mapping[str, Mapping[str, Any]] | None = None
    after_build: Callable[[torch.nn.Module], None] | None = None

    @property
    def name(self) -> str:
        return f"{self.family}[{self.tag}]"


# ------------------------------------------------------------------------------------------ input edits
def _seq_concat_reference(base, config, batch, sizes, gen, id_axis0=1.0, ref_grid=None):
    """Kontext / Flux2 edit: the reference image's packed latents follow the noisy ones along the sequence,
    with ids whose first axis marks the reference (the pipeline's ``image_ids[..., 0] = 1``). ``ref_grid``: the
    reference at its own size (Kontext resizes the input image to a preferred resolution, not the output's)."""
    out = base(config, batch, sizes, gen)
    h, w = ref_grid or sizes["grid"]
    ref = cfg_rows(gen, batch, h * w, config["in_channels"])
    out["hidden_states"] = torch.cat([out["hidden_states"], ref], dim=1)
    ids = out["img_ids"]
    ref_ids = _grid_ids_like(ids, h, w)
    ref_ids[..., 0] = id_axis0
    out["img_ids"] = torch.cat([ids, ref_ids], dim=-2)
    return out


def _grid_ids_like(ids, h, w):
    """(row, col) ids of an h x w grid with the other axes zero, shaped as ``ids`` (batched or not)."""
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    out = torch.zeros(*ids.shape[:-2], h * w, ids.shape[-1])
    out[..., 1], out[..., 2] = hh.reshape(-1).float(), ww.reshape(-1).float()
    return out


def _wan_image_tokens(n, images=1):
    """Wan 2.1 I2V / FLF2V: CLIP image tokens for the added cross-attention (257 an image in the real model);
    FLF2V passes the first and last frame's as two rows per sample, which the model joins (``pos_embed_seq_len``)."""
    def inputs(base, config, batch, sizes, gen):
        out = base(config, batch, sizes, gen)
        emb = text_rows(gen, batch, images * n, config["image_dim"])
        out["encoder_hidden_states_image"] = emb.reshape(batch * images, n, config["image_dim"])
        return out
    return inputs


def _per_token_timestep(layout):
    """Wan 2.2 TI2V (``expand_timesteps``) and LTX I2V: a timestep per token, 0 on the conditioning (first)
    frame. ``layout(config, sizes) -> (frames, tokens_per_frame)`` in model tokens."""
    def inputs(base, config, batch, sizes, gen):
        out = base(config, batch, sizes, gen)
        frames, per_frame = layout(config, sizes)
        t = out["timestep"][:, None].expand(batch, frames * per_frame).clone()
        t[:, :per_frame] = 0.0
        out["timestep"] = t.contiguous()
        return out
    return inputs


def _video_layout(config, sizes):
    f, h, w = sizes["grid"]
    return f, h * w


def _qwen_edit(refs=None):
    """QwenImage-Edit: the reference images' packed latents follow the noisy ones, ``img_shapes`` lists them all
    (``refs``: their grids; default one of the output's size; Edit-2509 takes up to 3 of their own sizes)."""
    def inputs(base, config, batch, sizes, gen):
        out = base(config, batch, sizes, gen)
        grids = list(refs or [sizes["grid"]])
        extra = [cfg_rows(gen, batch, h * w, config["in_channels"]) for h, w in grids]
        out["hidden_states"] = torch.cat([out["hidden_states"], *extra], dim=1)
        out["img_shapes"] = [[(1, *sizes["grid"])] + [(1, h, w) for h, w in grids] for _ in range(batch)]
        return out
    return inputs


def _cogvideox_sincos(base, config, batch, sizes, gen):
    """CogVideoX-2b: sincos positions in the patch embedder, no rotary table passed."""
    out = base(config, batch, sizes, gen)
    out["image_rotary_emb"] = None
    return out


def _cogvideox15(ofs):
    """CogVideoX 1.5: ``patch_size_t`` frames a token, the pipeline's "slice" rotary table; I2V adds ``ofs``."""
    def inputs(base, config, batch, sizes, gen):
        out = base(config, batch, sizes, gen)
        f, h, w = sizes["grid"]
        p, pt = config["patch_size"], config["patch_size_t"]
        lat = out["hidden_states"]
        out["hidden_states"] = cfg_rows(gen, batch, f * pt, lat.shape[2], h * p, w * p)
        cos, sin = get_3d_rotary_pos_embed(
            embed_dim=config["attention_head_dim"], crops_coords=None, grid_size=(h, w), temporal_size=f,
            grid_type="slice", max_size=(config["sample_height"] // p, config["sample_width"] // p),
            device=torch.device("cpu"))
        out["image_rotary_emb"] = (cos.float(), sin.float())
        if ofs:
            out["ofs"] = torch.full((1,), 2.0)
        return out
    return inputs


def _pixart_alpha(base, config, batch, sizes, gen):
    """PixArt-alpha 1024: resolution / aspect-ratio conditions (``use_additional_conditions``)."""
    out = base(config, batch, sizes, gen)
    h, w = sizes["grid"]
    out["added_cond_kwargs"] = {"resolution": torch.tensor([[8.0 * h, 8.0 * w]]).expand(batch, 2).contiguous(),
                                "aspect_ratio": torch.tensor([[h / w]]).expand(batch, 1).contiguous()}
    return out


def _sana_guidance(base, config, batch, sizes, gen):
    out = base(config, batch, sizes, gen)
    out["guidance"] = torch.full((batch,), 4.5)
    return out


def _skyreels_df(base, config, batch, sizes, gen):
    """SkyReels-V2 diffusion forcing: one timestep per latent frame (later frames noisier), fps injected. The
    pipeline calls the two CFG branches apart (batch 1): the class's fps injection does not take a larger batch."""
    if batch != 1:
        raise ValueError("skyreels_v2 diffusion forcing runs batch 1 (SkyReelsV2DiffusionForcingPipeline calls each "
                         "CFG branch apart; the model's fps injection repeats a batch-1 projection)")
    out = base(config, batch, sizes, gen)
    frames = out["hidden_states"].shape[2] // config["patch_size"][0]
    t = out["timestep"][:, None] * torch.linspace(0.5, 1.0, frames)[None]
    out["timestep"] = t.contiguous()
    out["enable_diffusion_forcing"] = True
    return out  # fps: the family's builder follows inject_sample_info


def _cosmos_v2w(base, config, batch, sizes, gen):
    """Cosmos-Predict2 Video2World: a condition-mask channel and a timestep per latent frame, (B, 1, T, 1, 1),
    0 on the conditioning frame."""
    out = base(config, batch, sizes, gen)
    lat = out["hidden_states"]
    b, _, f, h, w = lat.shape
    out["hidden_states"] = lat[:, : config["in_channels"] - 1].contiguous()
    mask = torch.zeros(b, 1, f, h, w)
    mask[:, :, :1] = 1.0
    out["condition_mask"] = mask
    t = out["timestep"][:, None].expand(b, f).clone()
    t[:, :1] = 0.0
    out["timestep"] = t[:, None, :, None, None].contiguous()
    return out


def _cosmos_crossattn_proj(base, config, batch, sizes, gen):
    """Cosmos-Predict2.5: the text encoder's stacked hidden states (100352 wide) projected in the model."""
    out = base(config, batch, sizes, gen)
    out["encoder_hidden_states"] = text_rows(gen, batch, sizes["text"], config["crossattn_proj_in_channels"])
    return out


def _padded_text(*keys, pad=3, stop=None):
    """The pipelines pad every prompt to a fixed length (Mochi 256, HunyuanVideo 256, Sana 300, PixArt 300, LTX 128,
    QwenImage's per-batch longest): the conditional row has masked-out tokens too, not only a CFG negative row.
    Masks ``keys`` out on the last ``pad`` text positions of every row (``stop``: where the text part ends, for a
    mask of text then image tokens)."""
    def inputs(base, config, batch, sizes, gen):
        out = base(config, batch, sizes, gen)
        end = sizes["text"] if stop is None else stop(sizes)
        for key in keys:
            mask = out[key].clone()
            mask[:, end - pad:end] = 0
            out[key] = mask
        return out
    return inputs


def _hunyuanvideo15_i2v(base, config, batch, sizes, gen):
    """HunyuanVideo-1.5 I2V: SigLIP image tokens (non-zero: the model's t2v test ``all(image_embeds == 0)`` fails)."""
    out = base(config, batch, sizes, gen)
    out["image_embeds"] = text_rows(gen, batch, 4, config["image_embed_dim"])
    return out


def _hunyuanvideo15_meanflow(base, config, batch, sizes, gen):
    """HunyuanVideo-1.5 step-distilled (``use_meanflow``): a second timestep ``timestep_r``."""
    out = base(config, batch, sizes, gen)
    out["timestep_r"] = out["timestep"] * 0.5
    return out


def _qwen_layered(layers=1):
    """Qwen-Image-Layered: ``layers + 1`` output layers and the input image in one sequence, ``use_layer3d_rope``
    over them and ``additional_t_cond`` (``is_rgb``)."""
    def inputs(base, config, batch, sizes, gen):
        out = base(config, batch, sizes, gen)
        h, w = sizes["grid"]
        extra = cfg_rows(gen, batch, (layers + 1) * h * w, config["in_channels"])
        out["hidden_states"] = torch.cat([out["hidden_states"], extra], dim=1)
        out["img_shapes"] = [[(1, h, w)] * (layers + 2) for _ in range(batch)]
        return out  # additional_t_cond: the family's builder follows use_additional_t_cond
    return inputs


def _ltx_condition(base, config, batch, sizes, gen):
    """LTXConditionPipeline (LTX-Video 0.9.5+): pixel-space ``video_coords`` (B, 3, S) instead of the grid size,
    frames shifted by the VAE's causal first frame and divided by the frame rate; a timestep per token."""
    out = _per_token_timestep(_video_layout)(base, config, batch, sizes, gen)
    f, h, w = sizes["grid"]
    tt, hh, ww = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
    coords = torch.stack([tt.reshape(-1) * 8.0, hh.reshape(-1) * 32.0, ww.reshape(-1) * 32.0]).float()
    coords[0] = (coords[0] + 1 - 8).clamp(min=0) / 25.0
    out["video_coords"] = coords[None].expand(batch, -1, -1).contiguous()
    for key in ("num_frames", "height", "width", "rope_interpolation_scale"):
        out.pop(key, None)
    return out


def _wan_vace_sparse(base, config, batch, sizes, gen):
    out = base(config, batch, sizes, gen)
    out["control_hidden_states_scale"] = torch.ones(len(config["vace_layers"]))
    return out


def _sd3_slg(base, config, batch, sizes, gen):
    """StableDiffusion3Pipeline's skip-layer guidance call: ``skip_layers`` blocks left out of the stack."""
    out = base(config, batch, sizes, gen)
    out["skip_layers"] = [1]
    return out


_VIDEO4 = {"default": {"grid": (4, 2, 2), "text": 8}, "alt_resolution": {"grid": (4, 3, 2), "text": 8}}

VARIANTS: tuple[Variant, ...] = (
    # FLUX.1
    Variant("flux", "schnell", "FLUX.1-schnell", dict(guidance_embeds=False)),
    Variant("flux", "fill", "FLUX.1-Fill-dev (in 384 = latent + masked image + mask, out 64)",
            dict(in_channels=384, out_channels=64)),
    Variant("flux", "control", "FLUX.1-Canny-dev / FLUX.1-Depth-dev (in 128, out 64)",
            dict(in_channels=128, out_channels=64)),
    Variant("flux", "kontext", "FLUX.1-Kontext-dev (reference tokens after the noisy ones, ids axis 0 = 1)",
            inputs=_seq_concat_reference),
    Variant("flux", "kontext_ref", "FLUX.1-Kontext-dev with the reference at its own size (odd joint length)",
            inputs=lambda base, c, b, s, g: _seq_concat_reference(base, c, b, s, g, ref_grid=(5, 3))),
    # SD3 / SD3.5
    Variant("sd3", "3.0", "stable-diffusion-3-medium (no qk norm)", dict(qk_norm=None)),
    Variant("sd3", "3.5m", "stable-diffusion-3.5-medium (dual attention in the first layers, rms qk norm)",
            dict(dual_attention_layers=(0,), qk_norm="rms_norm", pos_embed_max_size=32)),
    # Wan 2.1 / 2.2
    Variant("wan", "i2v", "Wan2.1-I2V-14B (image_dim 1280, added_kv_proj_dim 5120, in 36)",
            dict(in_channels=12, image_dim=32, added_kv_proj_dim=32), _wan_image_tokens(5)),
    Variant("wan", "flf2v", "Wan2.1-FLF2V-14B (pos_embed_seq_len 514: first + last frame images)",
            dict(in_channels=12, image_dim=32, added_kv_proj_dim=32, pos_embed_seq_len=10), _wan_image_tokens(5, 2)),
    Variant("wan", "ti2v", "Wan2.2-TI2V-5B (in / out 48, expand_timesteps: a timestep per token)",
            dict(in_channels=48, out_channels=48), _per_token_timestep(_video_layout)),
    # QwenImage
    Variant("qwenimage", "edit", "Qwen-Image-Edit / -2509 (reference latents in the sequence)",
            inputs=_qwen_edit()),
    Variant("qwenimage", "edit2509", "Qwen-Image-Edit-2509 (two reference images of their own sizes)",
            inputs=_qwen_edit([(3, 5), (2, 2)])),
    Variant("qwenimage", "edit2511", "Qwen-Image-Edit-2511 (zero_cond_t: t = 0 for the reference tokens)",
            dict(zero_cond_t=True), _qwen_edit()),
    # HunyuanVideo
    Variant("hunyuanvideo", "i2v", "HunyuanVideo-I2V-33ch (latent_concat: in 33 = 2 x 16 + 1, no guidance embedder)",
            dict(in_channels=9, image_condition_type="latent_concat", guidance_embeds=False)),
    Variant("hunyuanvideo", "i2v_tr", "HunyuanVideo-I2V (token_replace: the first frame modulated with t = 0)",
            dict(image_condition_type="token_replace")),
    # CogVideoX 1.0 / 1.5
    Variant("cogvideox", "2b", "CogVideoX-2b (sincos positions, no rotary)",
            dict(use_rotary_positional_embeddings=False), _cogvideox_sincos),
    Variant("cogvideox", "5b_i2v", "CogVideoX-5b-I2V (in 32, learned positional embeddings + rotary)",
            dict(in_channels=8, use_learned_positional_embeddings=True, sample_height=8, sample_width=8,
                 sample_frames=5), after_build=lambda m: m.float()),  # the class builds its table in fp64
    Variant("cogvideox", "1.5", "CogVideoX1.5-5B (patch_size_t 2, no patch bias)",
            dict(patch_size_t=2, patch_bias=False, sample_frames=9), _cogvideox15(False)),
    Variant("cogvideox", "1.5_i2v", "CogVideoX1.5-5B-I2V (ofs_embed_dim 512, in 32)",
            dict(patch_size_t=2, patch_bias=False, ofs_embed_dim=32, in_channels=8, sample_frames=9),
            _cogvideox15(True)),
    # LTX-Video
    Variant("ltxvideo", "i2v", "LTX-Video image-to-video (a timestep per token, 0 on the first frame)",
            inputs=_per_token_timestep(_video_layout)),
    # PixArt
    # 2 heads of 24: the size / aspect-ratio embedders take a third of the width each (1152 = 16 x 72 for real)
    Variant("pixart", "alpha", "PixArt-XL-2-1024-MS (resolution / aspect-ratio conditions, interpolation default)",
            dict(use_additional_conditions=True, interpolation_scale=None, attention_head_dim=24,
                 cross_attention_dim=48), _pixart_alpha),
    Variant("pixart", "sigma", "PixArt-Sigma-XL-2-1024-MS (interpolation_scale 2)",
            dict(interpolation_scale=2, use_additional_conditions=False)),
    # Sana
    Variant("sana", "1.5", "Sana 1.5 (qk_norm rms_norm_across_heads)", dict(qk_norm="rms_norm_across_heads")),
    Variant("sana", "sprint", "Sana-Sprint (guidance embedder, rms qk norm)",
            dict(qk_norm="rms_norm_across_heads", guidance_embeds=True), _sana_guidance),
    Variant("sana", "pe", "Sana 4K (sincos positional embedding: interpolation_scale set)",
            dict(interpolation_scale=1)),
    # Lumina2: grouped-query attention (24 heads, 8 kv heads)
    Variant("lumina2", "gqa", "Lumina-Image-2.0 (24 heads over 8 kv heads: 3 query heads a kv head)",
            dict(num_attention_heads=6, num_kv_heads=2, hidden_size=96)),
    # HiDream
    Variant("hidream", "i1", "HiDream-I1 (4 routed experts, 2 active)",
            dict(num_routed_experts=4, num_activated_experts=2)),
    Variant("hidream", "nonsquare", "HiDream-I1 at a non-square size (tokens padded to max_seq, keys masked)",
            dict(num_routed_experts=4, num_activated_experts=2),
            sizes_by_variant={"default": {"grid": (4, 6), "text": 8}, "alt_resolution": {"grid": (6, 4), "text": 8}}),
    # Flux2
    Variant("flux2", "klein", "FLUX.2-klein (no guidance embedder)", dict(guidance_embeds=False)),
    Variant("flux2", "edit", "FLUX.2-dev with a reference image (reference tokens after the noisy ones)",
            inputs=lambda base, c, b, s, g: _seq_concat_reference(base, c, b, s, g, id_axis0=10.0)),
    # Kandinsky 5
    Variant("kandinsky5", "i2v", "Kandinsky-5.0-I2V (visual_cond: 2 C + 1 input channels)",
            dict(visual_cond=True)),  # the family's builder adds the conditioning channels where the flag is on
    # SkyReels-V2
    Variant("skyreels_v2", "df", "SkyReels-V2-DF (diffusion forcing: a timestep per frame, fps injected)",
            dict(inject_sample_info=True), _skyreels_df),
    Variant("skyreels_v2", "df_causal", "SkyReels-V2-DF async (causal_block_size 2: block-causal attention)",
            dict(inject_sample_info=True, num_frame_per_block=2), _skyreels_df, sizes_by_variant=_VIDEO4),
    # Cosmos (every real config sets concat_padding_mask, which runs torchvision's resize: not installed here)
    Variant("cosmos", "predict2", "Cosmos-Predict2-Video2World (no extra pos embed, rope_scale (1, 4, 4), in 17)",
            dict(extra_pos_embed_type=None, rope_scale=(1.0, 4.0, 4.0), in_channels=5), _cosmos_v2w),
    Variant("cosmos", "predict2.5", "Cosmos-Predict2.5 (crossattn_proj: 100352 -> 1024 inside the model)",
            dict(use_crossattn_projection=True, crossattn_proj_in_channels=64, encoder_hidden_states_channels=32),
            _cosmos_crossattn_proj),
    Variant("ltxvideo", "condition", "LTX-Video 0.9.5+ through LTXConditionPipeline (video_coords, per-token t)",
            inputs=_ltx_condition),
    Variant("wan_vace", "every_other", "Wan2.1-VACE (vace_layers every other block: blocks with and without hints)",
            dict(num_layers=4, vace_layers=[0, 2]), _wan_vace_sparse),
    Variant("sd3", "slg", "SD3.5-medium's skip-layer guidance call (skip_layers=[7, 8, 9]: a block left out)",
            dict(num_layers=3, dual_attention_layers=(0,)), _sd3_slg),
    # HunyuanVideo 1.5
    Variant("hunyuanvideo15", "i2v", "HunyuanVideo-1.5 I2V (in 65 = 2 x 32 + 1, image tokens, task_type i2v)",
            dict(in_channels=9, task_type="i2v"), _hunyuanvideo15_i2v),
    Variant("hunyuanvideo15", "meanflow", "HunyuanVideo-1.5 step-distilled (use_meanflow: timestep_r)",
            dict(use_meanflow=True), _hunyuanvideo15_meanflow),
    Variant("qwenimage", "layered", "Qwen-Image-Layered (use_layer3d_rope, use_additional_t_cond)",
            dict(use_layer3d_rope=True, use_additional_t_cond=True), _qwen_layered()),
    # the prompt padded in the conditional row too, as every pipeline pads to its max_sequence_length
    Variant("mochi", "padded", "Mochi-1-preview (prompt padded to 256 tokens)", inputs=_padded_text(
        "encoder_attention_mask")),
    Variant("hunyuanvideo", "padded", "HunyuanVideo (prompt padded to 256 tokens)", inputs=_padded_text(
        "encoder_attention_mask")),
    Variant("hunyuanvideo15", "padded", "HunyuanVideo-1.5 (prompts padded)", inputs=_padded_text(
        "encoder_attention_mask", "encoder_attention_mask_2")),
    Variant("sana", "padded", "Sana (prompt padded to 300 tokens)", inputs=_padded_text("encoder_attention_mask")),
    Variant("pixart", "padded", "PixArt-Sigma (prompt padded to 300 tokens)", inputs=_padded_text(
        "encoder_attention_mask")),
    Variant("ltxvideo", "padded", "LTX-Video (prompt padded to 128 tokens)", inputs=_padded_text(
        "encoder_attention_mask")),
    Variant("qwenimage", "padded", "QwenImage (a batch's shorter prompt padded)", inputs=_padded_text(
        "encoder_hidden_states_mask")),
    Variant("lumina2", "padded", "Lumina-Image-2.0 (prompt padded)", inputs=_padded_text("encoder_attention_mask")),
    Variant("chroma", "padded", "Chroma (prompt padded to 512 tokens; mask of text then image)",
            inputs=_padded_text("attention_mask")),
    Variant("allegro", "padded", "Allegro (prompt padded to 512 tokens)", inputs=_padded_text(
        "encoder_attention_mask")),
    # head counts the ranks do not divide: SD3.5-large 38, CogVideoX-2b 30, Sana 70 (cross 20), Kandinsky 5 Lite 14,
    # HiDream 20 heads on 4 or 8 ranks; on the coverage's 2 ranks, 3 heads of 16 stand for them
    Variant("flux", "heads3", "a head count the ranks do not divide", dict(num_attention_heads=3)),
    Variant("sd3", "heads3", "SD3.5-large: 38 heads (rms qk norm) over 4 ranks",
            dict(num_attention_heads=3, caption_projection_dim=48)),
    Variant("wan", "heads3", "a head count the ranks do not divide", dict(num_attention_heads=3)),
    Variant("cogvideox", "heads3", "CogVideoX-2b: 30 heads over 4 ranks, sincos positions",
            dict(num_attention_heads=3, use_rotary_positional_embeddings=False), _cogvideox_sincos),
    Variant("sana", "heads3", "Sana 1600M: 70 heads, 20 cross heads over 4 ranks",
            dict(num_attention_heads=3, num_cross_attention_heads=3, cross_attention_dim=48)),
    Variant("kandinsky5", "heads3", "Kandinsky-5.0 Lite: 14 heads over 4 ranks", dict(model_dim=48)),
    Variant("hunyuanvideo", "heads3", "a head count the ranks do not divide", dict(num_attention_heads=3)),
    Variant("qwenimage", "heads3", "a head count the ranks do not divide", dict(num_attention_heads=3)),
    Variant("ltxvideo", "heads3", "a head count the ranks do not divide",
            dict(num_attention_heads=3, cross_attention_dim=48)),
    Variant("skyreels_v2", "i2v", "SkyReels-V2-I2V (image_dim 1280, added_kv_proj_dim, in 36)",
            dict(in_channels=12, image_dim=32, added_kv_proj_dim=32), _wan_image_tokens(5)),
)


def variant_spec(base: FamilySpec, v: Variant) -> FamilySpec:
    """The FamilySpec of variant ``v`` of ``base``."""
    def edited(config, batch, sizes, gen, _base=base.inputs, _edit=v.inputs):
        return _edit(_base, config, batch, sizes, gen)
    inputs = base.inputs if v.inputs is None else edited
    return dataclasses.replace(base, name=v.name, config={**base.config, **v.overrides}, inputs=inputs,
                               sizes_by_variant=v.sizes_by_variant or base.sizes_by_variant,
                               after_build=v.after_build or base.after_build)


__all__ = ["VARIANTS", "Variant", "variant_spec"]
