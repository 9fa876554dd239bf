"""Tensor parallelism beyond the transformer: text encoders (TE-P), a ControlNet (CN-P), and the
context × tensor hybrid (ulysses 2 × tp 2 on one mesh, tp innermost). gloo CPU ranks, fp32.

The same TensorParallel pass runs on text encoders from transformers captured with torch.export: block
discovery finds ``encoder.block.N`` (T5) / ``layers.N`` (Llama, Qwen3), the linear roles come from the
graph, head counts in the views are rewritten, one all-reduce per row-parallel linear.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from dit_passes.testing import run_ranks

TOL = 1e-5


def _text_encoder(name):
    import transformers as T
    torch.manual_seed(0)
    if name == "t5":
        return T.T5EncoderModel(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                           dropout_rate=0.0)).eval()
    if name == "llama":
        return T.LlamaModel(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64)).eval()
    return T.Qwen3Model(T.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64)).eval()


def _controlnet(heads=2):
    """A tiny FluxControlNetModel with ``heads`` heads of ``32 // heads`` channels (tp must divide ``heads``)."""
    import diffusers
    torch.manual_seed(0)
    rope = {2: (4, 6, 6), 4: (2, 2, 4)}[heads]
    m = diffusers.FluxControlNetModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                      attention_head_dim=32 // heads, num_attention_heads=heads, joint_attention_dim=32,
                                      pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=rope).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.abs().max() == 0:  # ControlNet's zero-initialised output projections: make them count
                p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 16, generator=g), controlnet_cond=torch.randn(1, 16, 16, generator=g),
              conditioning_scale=1.0, encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
              pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
              img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.zeros(8, 3), return_dict=False)
    return m, kw


def _run(module, kw, passes):
    from torch.distributed.tensor.debug import CommDebugMode
    from dit_passes import compile_dit

    with torch.no_grad():
        ref = pytree.tree_leaves(module(**kw))
        compiled = compile_dit(module, passes=passes)
        compiled.lower(**kw)
        comm = CommDebugMode()
        with comm:
            out = pytree.tree_leaves(compiled(**kw))
    rec = {r.name: r.result.counts for r in compiled._current().manager.records}
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out, ref) if b.abs().max() > 0)
    return {"err": err, "n_out": len(out), "passes": rec, "comm": counts}


def _two_ranks(rank, world):
    from dit_passes import passes
    out = {}
    for name in ("t5", "llama", "qwen3"):
        model = _text_encoder(name)
        ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
        kw = dict(input_ids=ids) if name == "t5" else dict(input_ids=ids, use_cache=False)
        out[name] = _run(model, kw, [passes.TensorParallel(size=world)])
    cn, kw = _controlnet()
    out["flux_controlnet"] = _run(cn, kw, [passes.TensorParallel(size=world)])
    return out


def _four_ranks(rank, world):
    from dit_passes.models.zoo import build
    from dit_passes.passes.parallel_plan import hybrid_passes
    out = {}
    # Wan: cross-attention, no modulation linear. Flux with the heads the ranks divide runs this same hybrid (ulysses 2
    # x tp 2) against the single process in test_parallel_modules_four_ranks.py (seed 002, through enable_cache); the
    # 5-head Flux below runs every check of this test on Flux, with both paddings on top
    zm = build("wan")
    out["wan"] = _run(zm.model, zm.make_inputs(batch=1, seed=1), hybrid_passes(ulysses=2, tp=2))
    # 5 heads: TP zero-pads them to 6 (3 per tp rank), then Ulysses pads each tp rank's 3 to 4 (2 per cp rank):
    # both paddings in one model, and a TP zero head travels through the all-to-alls as a real one
    zm = build("flux", num_attention_heads=5)
    out["flux_5_heads"] = _run(zm.model, zm.make_inputs(batch=1, seed=1), hybrid_passes(ulysses=2, tp=2))
    try:
        hybrid_passes(ulysses=2, tp=3)
    except ValueError as e:
        out["size_error"] = str(e)
    return out


@pytest.mark.multiproc
def test_text_encoders_and_controlnet_tensor_parallel_two_ranks():
    results = run_ranks(_two_ranks, 2, timeout=240)
    for rank, res in enumerate(results):
        for name, r in res.items():
            where = f"rank {rank} {name}"
            assert r["err"] <= TOL, f"{where}: max relative error {r['err']:.2e}"
            tp = r["passes"]["tensor_parallel"]
            # exactly one all-reduce per row-parallel linear, and that is what ran
            assert tp["all_reduce"] == tp["row_parallel"] >= 4, f"{where}: {tp}"
            assert r["comm"].get("all_reduce", 0) == tp["all_reduce"] + tp.get("norm_all_reduce", 0), f"{where}: {r}"
            assert tp["block_linear_bytes_after"] < 0.75 * tp["block_linear_bytes_before"], f"{where}: {tp}"
    assert results[0]["flux_controlnet"]["n_out"] == 4  # 2 double-block + 2 single-block control samples


@pytest.mark.multiproc
def test_ulysses_times_tp_hybrid_four_ranks():
    results = run_ranks(_four_ranks, 4, timeout=400)
    for rank, res in enumerate(results):
        for name, family in (("wan", "wan"), ("flux_5_heads", "flux")):
            r = res[name]
            where = f"rank {rank} {name}"
            assert r["err"] <= TOL, f"{where}: max relative error {r['err']:.2e}"
            assert set(r["passes"]) >= {"ulysses", "tensor_parallel"}, where
            tp, cp = r["passes"]["tensor_parallel"], r["passes"]["ulysses"]
            assert r["comm"].get("all_reduce", 0) == tp["all_reduce"] + tp.get("norm_all_reduce", 0), f"{where}: {r}"
            assert r["comm"].get("all_to_all_single", 0) == cp["all_to_all"] == 4 * cp["attention_replaced"], f"{where}: {r}"
            # Ulysses gathers the output once; TP all-gathers each AdaLN modulation output (modulation="column")
            assert cp["outputs_gathered"] == 1 and tp["fallback_all_gather"] == 0, f"{where}: {tp}"
            # tiny Flux: 2 double blocks x 2 + 2 single blocks x 1 modulation linears; Wan's blocks modulate with a
            # table added to the timestep projection made outside them: no modulation linear
            assert tp["all_gather"] == {"flux": 6, "wan": 0}[family], f"{where}: {tp}"
            assert r["comm"].get("all_gather_into_tensor", 0) == 1 + tp["all_gather"], f"{where}: {r}"
            # column-parallel linears with padded heads: q / k / v of both streams (2 double blocks x 6) and of the
            # 2 single blocks (x 3)
            assert tp["padded_heads"] == (18 if name == "flux_5_heads" else 0), f"{where}: {tp}"
        assert "2 × 1 × 3 = 6 ranks, but the group has 4" in res["size_error"]
