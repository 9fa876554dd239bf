"""Tiny configs of diffusers' newer image DiT classes, for the coverage matrix (see ``zoo_more``).

Same sizes as the rest of the zoo (2 heads x 16 channels, >= 2 blocks per list); the options that change the
graph are on: rotary embeddings, text masks, GQA, guidance, refiner / perceiver / text-fusion stacks, condition
images of the edit models. Each ``_<family>_inputs`` builds the call the matching pipeline makes (packed
sequences with their position / segment ids for Ideogram 4, the processor's causal mask for OmniGen, the
vision-language slot mask for Qwen-Image 2.1, padded patches with a shape list for JoyImage-Edit-Plus).
"""
from __future__ import annotations

import torch

from dit_passes.models.zoo_common import cfg_rows, grid_ids, text_mask, text_rows, timestep_rows
from dit_passes.models.zoo_more import _DUAL_SINGLE, DIM, HEAD_DIM, HEADS, ROPE_3AXES, TEXT_DIM, _family, _latent_2d

# a condition (reference) image of the edit models: 2 x 2 tokens
_COND_GRID = (2, 2)


def _padded_rows(batch: int, text: int) -> list[int]:
    """Valid text tokens per row: row 0 full, the negative row shorter (as ``zoo_common.text_mask``)."""
    mask = text_mask(batch, text)
    return [int(n) for n in mask.sum(1)]


# ------------------------------------------------------------------------------------------ bria fibo
def _bria_fibo_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    layers = config["num_layers"] + config["num_single_layers"]
    mask = torch.cat([text_mask(batch, text), torch.ones(batch, h * w, dtype=torch.bool)], dim=1)
    out = {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["joint_attention_dim"]),
        # BriaFiboPipeline: one text-encoder hidden state per block (the last ones of the encoder)
        "text_encoder_layers": [text_rows(gen, batch, text, config["text_encoder_dim"]) for _ in range(layers)],
        "timestep": timestep_rows(gen, batch, 1000.0),
        "img_ids": grid_ids(1, h, w),
        "txt_ids": torch.zeros(text, 3),
        # the pipeline's key-padding mask over [text, image], (B, 1, 1, S) bool
        "joint_attention_kwargs": {"attention_mask": mask[:, None, None, :]},
        "return_dict": False,
    }
    if config.get("guidance_embeds"):  # the class adds any guidance it gets, and has no embedder without the flag
        out["guidance"] = torch.full((batch,), 3.5)
    return out


BRIA_FIBO = _family("bria_fibo", "BriaFiboTransformer2DModel",
                    dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=HEAD_DIM,
                         num_attention_heads=HEADS, joint_attention_dim=TEXT_DIM, guidance_embeds=True,
                         axes_dims_rope=list(ROPE_3AXES), text_encoder_dim=TEXT_DIM),
                    _bria_fibo_inputs, _DUAL_SINGLE, 2, pipeline_class="BriaFiboPipeline")


# ----------------------------------------------------------------------------------------- bria fibo 2
def _bria_fibo2_inputs(config, batch, sizes, gen):
    text = sizes["text"]
    p = config["patch_size"]
    bundles = 1 + len(config["injection_layer_ids"])
    ch, cw = _COND_GRID
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1.0),
        # the Perceiver's bundle, then one per injection block
        "encoder_hidden_states": text_rows(gen, batch, bundles, text, config["cap_feat_dim"]),
        "encoder_attention_mask": text_mask(batch, text),
        # BriaFibo2Pipeline's edit call: the image to edit, its own size
        "context_latents": [cfg_rows(gen, batch, config["in_channels"], ch * p, cw * p)],
        "return_dict": False,
    }


BRIA_FIBO2 = _family("bria_fibo2", "BriaFibo2Transformer2DModel",
                     # 3 layers, the middle one an injection (cross-attention) block, as the real model mixes them;
                     # gist counts 2..6 over text lengths 4..8: a CFG pair's rows get 6 and 4 gist tokens, so the
                     # batch pads the gist and masks it
                     dict(in_channels=4, patch_size=2, dim=DIM, n_layers=3, n_refiner_layers=2, n_heads=HEADS,
                          cap_feat_dim=TEXT_DIM, injection_layer_ids=(1,), perceiver_num_layers=2,
                          min_num_gist_tokens=2, max_num_gist_tokens=6, gist_step=2, gist_min_text_len=4,
                          gist_max_text_len=8, axes_dims=ROPE_3AXES, axes_lens=(16, 16, 16)),
                     _bria_fibo2_inputs, {"layers": "n_layers"}, 1,
                     aux_list_keys={"noise_refiner": "n_refiner_layers", "perceiver.layers": "perceiver_num_layers"},
                     heads_key="n_heads", head_dim_key=None, hidden_key="dim", pipeline_class="BriaFibo2Pipeline",
                     width_keys=("cap_feat_dim",))


# ------------------------------------------------------------------------------------------- dreamlite
def _dreamlite_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    # DreamLiteUNet2DConditionModel's call of its transformer: the feature map and the text (mask as given)
    return {
        "hidden_states": cfg_rows(gen, batch, config["in_channels"], h, w),
        "encoder_hidden_states": text_rows(gen, batch, text, config["cross_attention_dim"]),
        "encoder_attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


def _dreamlite_processors(model: torch.nn.Module) -> None:
    """The GQA-aware processor the DreamLite UNet installs on every attention of its transformers (the default
    processor cannot split K/V into fewer heads)."""
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0
    for module in model.modules():
        if hasattr(module, "set_processor"):
            module.set_processor(DreamLiteAttnProcessor2_0())


DREAMLITE = _family("dreamlite", "DreamLiteTransformer2DModel",
                    # the DreamLite UNet's options: RMS q/k norm, one K/V head, FF x6, 1x1-conv projections
                    dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=DIM, num_layers=2,
                         norm_num_groups=8, cross_attention_dim=TEXT_DIM, qk_norm="rms_norm", num_kv_heads=1,
                         ff_mult=6),
                    _dreamlite_inputs, {"transformer_blocks": "num_layers"}, 1, after_build=_dreamlite_processors,
                    pipeline_class="DreamLitePipeline",
                    width_keys=("cross_attention_dim", "num_kv_heads"))


# ------------------------------------------------------------------------------------------- glm image
def _glm_image_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    p = config["patch_size"]
    prior = torch.randint(0, config["prior_vq_quantizer_codebook_size"], (1, h * w), generator=gen)
    drop = torch.zeros(batch, h * w, dtype=torch.bool)
    drop[1:] = True  # GlmImagePipeline's unconditional call drops the prior tokens
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_embed_dim"]),
        "prior_token_id": prior.expand(batch, -1).contiguous(),
        "prior_token_drop": drop,
        "timestep": timestep_rows(gen, batch, 1000.0),
        "target_size": torch.tensor([[8.0 * h * p, 8.0 * w * p]]).expand(batch, 2).contiguous(),
        "crop_coords": torch.zeros(batch, 2),
        "attention_mask": text_mask(batch, text, torch.long),
        "return_dict": False,
    }


GLM_IMAGE = _family("glm_image", "GlmImageTransformer2DModel",
                    dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
                         num_attention_heads=HEADS, text_embed_dim=TEXT_DIM, time_embed_dim=DIM, condition_dim=8,
                         prior_vq_quantizer_codebook_size=64),
                    _glm_image_inputs, {"transformer_blocks": "num_layers"}, 2, pipeline_class="GlmImagePipeline")


# -------------------------------------------------------------------------------------------- ideogram 4
_IMAGE_POSITION_OFFSET = 65536  # the pipeline's image coordinates start here, apart from text positions
_LLM_TOKEN, _OUTPUT_IMAGE, _PADDING_SEGMENT = 3, 2, -1


def _ideogram4_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    n_img = h * w
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    image_pos = torch.stack([torch.zeros(n_img, dtype=torch.long), hh.reshape(-1), ww.reshape(-1)], 1)
    position_ids = torch.zeros(batch, text + n_img, 3, dtype=torch.long)
    segment_ids = torch.full((batch, text + n_img), _PADDING_SEGMENT, dtype=torch.long)
    indicator = torch.zeros(batch, text + n_img, dtype=torch.long)
    features = text_rows(gen, batch, text, config["llm_features_dim"])
    # Ideogram4Pipeline._prepare_ids: [left padding][text][image] per row, one segment per sample
    for b, n in enumerate(_padded_rows(batch, text)):
        start = text - n
        position_ids[b, start:text] = torch.arange(n)[:, None]
        position_ids[b, text:] = image_pos + _IMAGE_POSITION_OFFSET
        indicator[b, start:text] = _LLM_TOKEN
        indicator[b, text:] = _OUTPUT_IMAGE
        segment_ids[b, start:] = 1
        features[b, :start] = 0.0
    latents = cfg_rows(gen, batch, n_img, config["in_channels"])
    return {
        "hidden_states": torch.cat([torch.zeros(batch, text, config["in_channels"]), latents], dim=1),
        "timestep": timestep_rows(gen, batch, 1.0),
        "encoder_hidden_states": torch.cat([features, torch.zeros(batch, n_img, config["llm_features_dim"])], 1),
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "indicator": indicator,
        "return_dict": False,
    }


IDEOGRAM4 = _family("ideogram4", "Ideogram4Transformer2DModel",
                    dict(in_channels=16, num_layers=2, attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                         intermediate_size=64, adaln_dim=DIM, llm_features_dim=TEXT_DIM, mrope_section=(4, 2, 2)),
                    _ideogram4_inputs, {"layers": "num_layers"}, 1, pipeline_class="Ideogram4Pipeline",
                    width_keys=("adaln_dim", "intermediate_size"))


# ---------------------------------------------------------------------------------------------- krea 2
def _krea2_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    # Krea2Pipeline.prepare_position_ids: text at the origin, image tokens at (0, row, col)
    position_ids = torch.cat([torch.zeros(text, 3), grid_ids(1, h, w)], dim=0)
    return {
        "hidden_states": cfg_rows(gen, batch, h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, text, config["num_text_layers"], config["text_hidden_dim"]),
        "timestep": timestep_rows(gen, batch, 1.0),
        "position_ids": position_ids,
        "encoder_attention_mask": text_mask(batch, text),
        "return_dict": False,
    }


KREA2 = _family("krea2", "Krea2Transformer2DModel",
                dict(in_channels=16, num_layers=2, attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                     num_key_value_heads=1, intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=TEXT_DIM,
                     num_text_layers=3, text_num_attention_heads=HEADS, text_num_key_value_heads=1,
                     text_intermediate_size=64, num_layerwise_text_blocks=2, num_refiner_text_blocks=2,
                     axes_dims_rope=ROPE_3AXES),
                _krea2_inputs, {"transformer_blocks": "num_layers"}, 1,
                aux_list_keys={"text_fusion.layerwise_blocks": "num_layerwise_text_blocks",
                               "text_fusion.refiner_blocks": "num_refiner_text_blocks"},
                pipeline_class="Krea2Pipeline",
                width_keys=("num_key_value_heads", "intermediate_size", "text_hidden_dim", "text_num_attention_heads",
                            "text_num_key_value_heads", "text_intermediate_size"))


# -------------------------------------------------------------------------------------------- omnigen
_OMNIGEN_IMAGE_AT = 2  # the input image's placeholder tokens start here in the prompt


def _omnigen_mask(valid: int, text: int, n_img: int, image_span: tuple[int, int] | None) -> torch.Tensor:
    """OmniGenMultiModalProcessor.create_mask for one row: causal over [pad][text][time], the output image
    bidirectional and seeing everything, padding keys hidden, an input image's placeholders bidirectional."""
    seq = text + 1 + n_img
    pad = text - valid
    mask = torch.zeros(seq, seq)
    mask[pad:pad + valid + 1, pad:pad + valid + 1] = torch.tril(torch.ones(valid + 1, valid + 1))
    mask[pad + valid + 1:, pad:] = 1.0
    mask[:pad] = 1.0
    if image_span is not None:
        start, end = image_span
        mask[start:end, start:end] = 1.0
    return mask


def _omnigen_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    p = config["patch_size"]
    ch, cw = _COND_GRID
    n_img = h * w
    image_span = (_OMNIGEN_IMAGE_AT, _OMNIGEN_IMAGE_AT + ch * cw)
    ids = torch.randint(0, config["vocab_size"] - 1, (1, text), generator=gen).expand(batch, -1).clone()
    masks, positions = [], []
    for b, valid in enumerate(_padded_rows(batch, text)):
        pad = text - valid
        ids[b, :pad] = config["pad_token_id"]
        positions.append(torch.tensor([0] * pad + list(range(valid + n_img + 1))))
        # the conditional row holds the input image (CFG's negative row has none)
        masks.append(_omnigen_mask(valid, text, n_img, image_span if b == 0 else None))
    ids[0, image_span[0]:image_span[1]] = 0  # the processor's placeholder ids
    return {
        "hidden_states": _latent_2d(config, batch, sizes, gen),
        "timestep": timestep_rows(gen, batch, 1.0),
        "input_ids": ids,
        "input_img_latents": [cfg_rows(gen, 1, config["in_channels"], ch * p, cw * p)],
        "input_image_sizes": {0: [list(image_span)]},
        "attention_mask": torch.stack(masks),
        "position_ids": torch.stack(positions),
        "return_dict": False,
    }


_OMNIGEN_ROPE = {"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [2.0] * (HEAD_DIM // 2)}
OMNIGEN = _family("omnigen", "OmniGenTransformer2DModel",
                  dict(in_channels=4, patch_size=2, hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=1,
                       intermediate_size=64, num_layers=2, pad_token_id=63, vocab_size=64, rope_scaling=_OMNIGEN_ROPE,
                       pos_embed_max_size=16, time_step_dim=32),
                  _omnigen_inputs, {"layers": "num_layers"}, 1, head_dim_key=None, hidden_key="hidden_size",
                  pipeline_class="OmniGenPipeline")


# ------------------------------------------------------------------------------------- qwen-image 2.1
_SLOT = 4  # one vision-language image slot stands for 2 x 2 latent tokens
_QWEN21_SLOT_AT = 3  # the condition image's slot sits after 3 prompt tokens


def _qwenimage21_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    ch, cw = _COND_GRID
    cond_slots = ch * cw // _SLOT
    # the vision-language sequence: prompt tokens with the condition image's slot inside, then the target's slots
    vlm = text + cond_slots
    img_mask = torch.zeros(batch, vlm + h * w // _SLOT, dtype=torch.bool)
    img_mask[:, _QWEN21_SLOT_AT:_QWEN21_SLOT_AT + cond_slots] = True
    img_mask[:, vlm:] = True
    text_valid = torch.ones(batch, vlm, dtype=torch.bool)
    text_valid[1:, vlm - 2:] = False  # the negative row: right-padded prompt
    return {
        # packed latents: condition image first, the target last
        "hidden_states": cfg_rows(gen, batch, ch * cw + h * w, config["in_channels"]),
        "encoder_hidden_states": text_rows(gen, batch, vlm, config["context_in_dim"]),
        "timestep": timestep_rows(gen, batch, 1.0),
        "img_shapes": [[(1, ch, cw), (1, h, w)]] * batch,
        "img_mask": img_mask,
        "encoder_hidden_states_mask": text_valid,
        "return_dict": False,
    }


QWENIMAGE21 = _family("qwenimage21", "QwenImage21Transformer2DModel",
                      dict(patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=HEAD_DIM,
                           num_attention_heads=HEADS, context_in_dim=TEXT_DIM, axes_dims_rope=ROPE_3AXES,
                           causal_condition=True),
                      _qwenimage21_inputs, {"transformer_blocks": "num_layers"}, 1,
                      pipeline_class="QwenImage21Pipeline")


# ------------------------------------------------------------------------------------ joyimage edit
def _joyimage_edit_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    _, ph, pw = config["patch_size"]
    # JoyImageEditPipeline: (B, items, C, T, H, W), the reference image first, the noise last
    return {
        "hidden_states": cfg_rows(gen, batch, 2, config["in_channels"], 1, h * ph, w * pw),
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, sizes["text"], config["text_dim"]),
        "return_dict": False,
    }


_JOYIMAGE = dict(patch_size=[1, 2, 2], in_channels=4, hidden_size=DIM, num_attention_heads=HEADS, text_dim=TEXT_DIM,
                 num_layers=2, rope_dim_list=list(ROPE_3AXES))
JOYIMAGE_EDIT = _family("joyimage_edit", "JoyImageEditTransformer3DModel",
                        dict(_JOYIMAGE, rope_type="mrope"),  # mrope: the text stream gets rotary positions too
                        _joyimage_edit_inputs, {"double_blocks": "num_layers"}, 2, head_dim_key=None,
                        hidden_key="hidden_size", pipeline_class="JoyImageEditPipeline")


def _joyimage_edit_plus_inputs(config, batch, sizes, gen):
    h, w = sizes["grid"]
    text = sizes["text"]
    pt, ph, pw = config["patch_size"]
    ch, cw = _COND_GRID
    # JoyImageEditPlusPipeline.prepare_latents: the target's patches, then the reference image's, zero-padded to
    # the batch's longest sample (2 patches of padding, as when another prompt's reference image is larger)
    n = h * w + ch * cw
    patches = cfg_rows(gen, batch, n + 2, config["in_channels"], pt, ph, pw)
    patches[:, n:] = 0.0
    return {
        "hidden_states": patches,
        "timestep": timestep_rows(gen, batch, 1000.0),
        "encoder_hidden_states": text_rows(gen, batch, text, config["text_dim"]),
        "encoder_hidden_states_mask": text_mask(batch, text, torch.long),
        "shape_list": [[(1, h, w), (1, ch, cw)]] * batch,
        "return_dict": False,
    }


JOYIMAGE_EDIT_PLUS = _family("joyimage_edit_plus", "JoyImageEditPlusTransformer3DModel", dict(_JOYIMAGE),
                             _joyimage_edit_plus_inputs, {"double_blocks": "num_layers"}, 2, head_dim_key=None,
                             hidden_key="hidden_size", pipeline_class="JoyImageEditPlusPipeline")


EXTRA_IMAGE_FAMILIES = (BRIA_FIBO, BRIA_FIBO2, DREAMLITE, GLM_IMAGE, IDEOGRAM4, KREA2, OMNIGEN, QWENIMAGE21,
                        JOYIMAGE_EDIT, JOYIMAGE_EDIT_PLUS)
