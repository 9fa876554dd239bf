"""``dit-passes fuzz`` (``dit_passes.coverage_fuzz``): configs drawn around a family's tiny one, probed, and the
coverage matrix's cells run on the valid ones."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

from dit_passes import coverage_fuzz as fz
from dit_passes.models.zoo import build, config_for, family_spec, model_class


def test_draws_are_deterministic_and_change_known_fields():
    for family in ("flux", "wan", "sd3"):
        spec, base = family_spec(family), config_for(family)
        params = inspect.signature(model_class(family).__init__).parameters
        draws = [fz.draw_overrides(family, s) for s in range(4)]
        assert draws == [fz.draw_overrides(family, s) for s in range(4)]
        for d in draws:
            assert d and set(d) <= set(params)
            assert all(base.get(k, params[k].default) != v for k, v in d.items())  # every field changed
            for key in spec.block_list_keys.values():
                assert d.get(key, base[key]) in fz.MAIN_BLOCKS + (base[key],)
            assert all(isinstance(v, bool) for k, v in d.items() if isinstance(base.get(k, params[k].default), bool))


def test_fuzz_runs_cells_on_valid_draws_and_drops_a_rejected_head_count(tmp_path, capsys, monkeypatch):
    """SD3's seed-0 draw changes its head count; where the class rejects that (stood in for here: the zoo's widths
    now follow the heads, so the real class runs it) the draw is kept without it. FLUX's draw runs as drawn. Every
    cell exact; the CLI writes the table and the JSON."""
    assert "num_attention_heads" in fz.draw_overrides("sd3", 0)
    real_probe = fz.probe

    def probe(family, overrides, timeout, batch=1):
        if family == "sd3" and "num_attention_heads" in overrides:
            return "ValueError: a width the class ties to the head count (stand-in)"
        return real_probe(family, overrides, timeout, batch)
    monkeypatch.setattr(fz, "probe", probe)
    rc = fz.main(["--families", "flux,sd3", "--columns", "capture,fp8", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "fuzz.json").read_text())
    rows = {r["family"]: r for r in result["rows"]}
    assert rows["flux"]["overrides"] == fz.draw_overrides("flux", 0) and rows["flux"]["invalid"] is None
    assert "num_attention_heads" not in rows["sd3"]["overrides"] and rows["sd3"]["invalid"] is None
    assert result["valid"] == 2 and result["summary"] == {c: {"exact": 2, "nothing to do": 0, "refused": 0, "error": 0}
                                                          for c in ("capture", "fp8")}
    assert "| exact | 2 | 2 |" in (tmp_path / "fuzz.md").read_text()
    assert fz.main(["--columns", "nope"]) == 2 and "unknown column" in capsys.readouterr().err


def test_a_draw_the_class_rejects_is_invalid_not_an_error():
    why = fz.probe("flux", {"axes_dims_rope": (4, 4, 4)}, timeout=60)  # rope width 12 for heads of 16
    assert why is not None and "Error" in why
    assert fz.probe("flux", {"num_layers": 1}, timeout=60) is None


@pytest.mark.parametrize("family,flags,batch", [
    ("qwenimage", {"use_additional_t_cond": True}, 1), ("flux3", {"flow_map": True}, 1),
    ("hunyuanimage", {"use_meanflow": True, "guidance_embeds": True}, 1),
    ("consisid", {"is_train_face": True, "num_layers": 3}, 2),
    ("skyreels_v2", {"inject_sample_info": True}, 1), ("skyreels_v2", {"inject_sample_info": True}, 2),
    ("sana", {"guidance_embeds": True}, 2), ("sana_video", {"guidance_embeds": True}, 1),
    ("kandinsky6", {"visual_cond": False}, 1), ("kandinsky6", {"visual_cond": False, "num_visual_blocks": 3}, 2),
    ("cosmos3", {"sound_gen": False}, 1), ("cosmos3", {"sound_gen": False, "action_gen": False}, 2),
    ("bria_fibo", {"guidance_embeds": False}, 1), ("kandinsky5", {"visual_cond": True}, 1),
    ("kandinsky5", {"visual_cond": True, "num_visual_blocks": 1}, 2)])
def test_inputs_follow_the_flags_a_draw_turns_on(family, flags, batch):
    """The classes refuse a call without the inputs these flags ask for (additional_t_cond, target_timestep,
    timestep_r / guidance, ConsisID's face id_cond / id_vit_hidden, SkyReels' fps per row, Sana's guidance) or with
    inputs a flag turns off (Kandinsky 6 without visual_cond takes the latent channels alone; Cosmos 3 without
    sound_gen / action_gen has no sound / action projections, so it packs no such rows): the zoo's builders
    follow them, so such draws are probed, not listed as the class's. A CFG pair too, where the input is per row.
    Fuzz seed 3000: Bria FIBO without guidance_embeds has no guidance embedder but adds any guidance it is given (an
    AttributeError); Kandinsky 5 with visual_cond embeds 2 C + 1 channels (a matmul shape error on C)."""
    assert fz.probe(family, flags, timeout=60, batch=batch) is None


def test_the_i2v_variant_keeps_its_inputs_now_its_family_builds_them():
    """kandinsky5[i2v] lost its own builder when the family's took over the visual_cond channels: the inputs are
    the ones its builder made, value for value (the latents, then one conditioning frame drawn after them, its
    mask), rebuilt here as that builder did."""
    from dit_passes.models.zoo import _make_inputs
    from dit_passes.models.zoo_common import cfg_rows
    from dit_passes.models.zoo_more_av import _kandinsky5_inputs
    spec = family_spec("kandinsky5[i2v]")
    config = dict(build("kandinsky5[i2v]").model.config)
    got = _make_inputs(spec, config, batch=2)
    gen = torch.Generator(device="cpu").manual_seed(0)
    old = _kandinsky5_inputs(config, 2, spec.sizes_by_variant["default"], gen)
    lat = old["hidden_states"]
    cond = torch.zeros_like(lat)
    cond[:, :1] = cfg_rows(gen, 2, *lat.shape[2:])[:, None]
    mask = torch.zeros(*lat.shape[:-1], 1)
    mask[:, :1] = 1.0
    assert torch.equal(got.pop("hidden_states"), torch.cat([lat, cond, mask], dim=-1))
    old.pop("hidden_states")
    assert got.keys() == old.keys()
    assert all(torch.equal(got[k], v) for k, v in old.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("family,flags,field,value", [
    ("wan_animate", {"num_layers": 1}, "inject_face_latents_blocks", 1),
    ("wan_animate", {"num_layers": 3}, "inject_face_latents_blocks", 1),
    ("hunyuandit", {"num_attention_heads": 3}, "hidden_size", 48),
    ("hunyuandit", {"num_attention_heads": 1, "learn_sigma": False}, "hidden_size", 16),
    ("sana", {"num_attention_heads": 3, "guidance_embeds": True}, "cross_attention_dim", 48),
    ("sana_video", {"num_attention_heads": 1}, "num_cross_attention_heads", 1),
    ("sana_wm", {"num_attention_heads": 3}, "hidden_size", 48),
    ("sd3", {"num_attention_heads": 1}, "caption_projection_dim", 16),
    ("auraflow", {"num_attention_heads": 1}, "caption_projection_dim", 16),
    ("pixart", {"num_attention_heads": 1}, "cross_attention_dim", 16),
    ("latte", {"num_attention_heads": 3}, "cross_attention_dim", 48),
    ("allegro", {"num_attention_heads": 1}, "cross_attention_dim", 16),
    ("ltxvideo", {"num_attention_heads": 3}, "cross_attention_dim", 48),
    ("ltx2", {"num_attention_heads": 1, "use_prompt_embeddings": False}, "cross_attention_dim", 16),
    ("consisid", {"num_attention_heads": 1, "is_train_face": True, "num_layers": 1}, "LFE_output_dim", 10),
    ("consisid", {"num_attention_heads": 3, "is_train_face": True}, "LFE_output_dim", 32),
    ("sana_wm_refiner", {"num_attention_heads": 3, "gated_attn": False}, "cross_attention_dim", 48),
    ("sana_wm_refiner", {"num_attention_heads": 1, "num_layers": 1}, "cross_attention_dim", 16),
    ("nucleusmoe", {"num_layers": 3, "num_attention_heads": 1}, "capacity_factors", [2.0, 2.0, 2.0]),
    ("nucleusmoe", {"num_layers": 1}, "capacity_factors", [2.0]),
    ("wan_vace", {"num_layers": 1, "num_attention_heads": 3}, "vace_layers", [0]),
    ("wan_vace", {"num_layers": 3}, "vace_layers", [0, 1, 2]),
    ("wan_vace[every_other]", {}, "vace_layers", [0, 2]),
    ("wan_vace[every_other]", {"num_layers": 5}, "vace_layers", [0, 2, 4])])
def test_fields_tied_to_drawn_counts_follow_them(family, flags, field, value):
    """Wan-Animate runs a face adapter at every block i % inject_face_latents_blocks == 0 but builds only
    num_layers // interval of them (an IndexError for the drawn 1 or 3 blocks with the zoo's 2); HunyuanDiT's
    embedders are hidden_size wide and its blocks heads x head_dim, Sana's cross-attention reads the heads x head_dim
    wide caption projection as cross_attention_dim (shape mismatches for a drawn head count); SANA-WM's
    cross-attention splits hidden_size over the heads (3 heads of the zoo's 32 wide: a ValueError). SD3 / AuraFlow
    join the caption_projection_dim wide text to the heads x head_dim wide image tokens, PixArt / Latte / Allegro /
    LTX-Video / LTX-2 read their heads x head_dim wide caption projection as cross_attention_dim; LTX-2 without
    use_prompt_embeddings takes its text at that width (the pipeline's connector projects it): the fuzzer dropped
    each such drawn head count (fuzz seed 2000). ConsisID's facial extractor gives the perceiver cross-attention
    its keys, int(heads x head_dim / 3 * 2) wide in the class (a LayerNorm shape error; fuzz seed 3000). Fuzz seed
    4000: the SANA-WM refiner reads its heads x head_dim wide caption projection as cross_attention_dim (a matmul
    shape error, the head count dropped); NucleusMoE indexes its capacity_factors list by block (an IndexError for 3
    blocks with the zoo's list of 2). Fuzz seed 5000: Wan-VACE refuses vace_layers that name a block it does not
    have (the zoo's [0, 1] for a drawn 1 block); the list follows the blocks at its spacing (every_other: 2)."""
    assert fz.probe(family, flags, timeout=60) is None
    assert build(family, **flags).model.config[field] == value


@pytest.mark.parametrize("family", ["cogvideox", "consisid"])
def test_a_learned_position_table_is_built_fp32(family):
    """With use_learned_positional_embeddings the CogVideoX patch embedder keeps its sincos table, built in fp64,
    as a persistent buffer: the zoo refused to build the draw (its fp32 promise); it casts the table."""
    assert fz.probe(family, {"use_learned_positional_embeddings": True}, timeout=60) is None


def test_a_field_tied_to_the_block_counts_follows_a_draw():
    """HiDream indexes a caption projection per block by its llama_layers: a drawn block count (1 + 1 here, the
    zoo's list holds 4) was rejected with an IndexError, not the force_inference_output drawn with it (a flag that
    only acts in training). The zoo's list follows the counts; a list the caller gives is kept."""
    flags = {"force_inference_output": True, "num_layers": 1, "num_single_layers": 1}
    assert fz.probe("hidream", flags, timeout=60, batch=2) is None
    assert build("hidream", **flags).model.config.llama_layers == [0, 1]
    assert build("hidream", num_layers=1, num_single_layers=1, llama_layers=[1, 0]).model.config.llama_layers == [1, 0]
