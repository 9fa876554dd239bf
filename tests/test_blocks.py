"""Block discovery on every zoo family, checked against the zoo's ``expected`` (written from the
diffusers configs, independently of discovery), and linear roles checked against module names."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from dit_passes import compile_dit
from dit_passes.models.zoo import FAMILIES, build


def structure_of(family):
    zm = build(family)
    return zm, compile_dit(zm.model, example_inputs=zm.make_inputs()).structure


@pytest.mark.parametrize("family", FAMILIES)
def test_structure_matches_expected(family):
    zm, s = structure_of(family)
    exp = zm.expected
    assert [(bl.name, bl.count) for bl in s.block_lists] == list(exp["block_lists"].items())
    assert len(s.blocks) == sum(exp["block_lists"].values())
    assert [b.index for b in s.blocks] == list(range(len(s.blocks)))
    assert [b.path for b in s.blocks] == [f"{n}.{i}" for n, c in exp["block_lists"].items() for i in range(c)]
    assert s.num_streams == exp["streams"]
    per_block = Counter(a.block for a in s.attention)
    for b in s.blocks:
        assert per_block[b.index] == exp["attention_per_block"][b.list_name], b.path
        assert b.nodes and b.stream_inputs and b.stream_outputs, b.path
    for a in s.attention:
        if a.block is not None:
            assert (a.num_heads, a.head_dim, a.layout) == (exp["heads"], exp["head_dim"], "BHSD")
    # lists outside the main stack are seen but not taken (HunyuanVideo's token refiner, refiners, ...)
    for aux, count in exp.get("aux_block_lists", {}).items():
        assert s.candidates.get(aux) == count and aux not in {bl.name for bl in s.block_lists}
    # blocks are contiguous, in order, between prologue and epilogue
    order = {n: i for i, n in enumerate(s.blocks[0].first.graph.nodes)}
    for prev, cur in zip(s.blocks, s.blocks[1:]):
        assert order[prev.last] < order[cur.first]
    assert all(order[n] < order[s.blocks[0].first] for n in s.prologue)
    assert all(order[n] > order[s.blocks[-1].last] for n in s.epilogue)


def test_hunyuan_token_refiner_is_prologue():
    zm, s = structure_of("hunyuanvideo")
    refiner = "context_embedder.token_refiner.refiner_blocks"
    assert s.candidates[refiner] == 2
    refiner_attn = [a for a in s.attention if a.node.meta["dit_module_path"].startswith(refiner)]
    assert len(refiner_attn) == 2 and all(a.block is None for a in refiner_attn)
    prologue = set(s.prologue)
    assert all(a.node in prologue for a in refiner_attn)
    assert s.blocks[0].path == "transformer_blocks.0"


# role by module name: an independent reference for the dataflow-derived roles
FLUX_DOUBLE = {"norm1.linear": "modulation", "norm1_context.linear": "modulation", "attn.to_q": "q",
               "attn.to_k": "k", "attn.to_v": "v", "attn.add_q_proj": "q", "attn.add_k_proj": "k",
               "attn.add_v_proj": "v", "attn.to_out.0": "attn_out", "attn.to_add_out": "attn_out",
               "ff.net.0.proj": "mlp_up", "ff.net.2": "mlp_down", "ff_context.net.0.proj": "mlp_up",
               "ff_context.net.2": "mlp_down"}
FLUX_SINGLE = {"norm.linear": "modulation", "proj_mlp": "mlp_up", "attn.to_q": "q", "attn.to_k": "k",
               "attn.to_v": "v", "proj_out": "proj"}
WAN_BLOCK = {"attn1.to_q": "q", "attn1.to_k": "k", "attn1.to_v": "v", "attn1.to_out.0": "attn_out",
             "attn2.to_q": "q", "attn2.to_k": "k", "attn2.to_v": "v", "attn2.to_out.0": "attn_out",
             "ffn.net.0.proj": "mlp_up", "ffn.net.2": "mlp_down"}


def _roles_by_suffix(s, block):
    prefix = s.blocks[block].path + "."
    return {lin.module_path[len(prefix):]: lin.role for lin in s.linears if lin.block == block}


def test_flux_linear_roles():
    zm, s = structure_of("flux")
    for b in s.blocks:
        want = FLUX_DOUBLE if b.list_name == "transformer_blocks" else FLUX_SINGLE
        assert _roles_by_suffix(s, b.index) == want, b.path
    counts = Counter(lin.role for lin in s.linears if lin.block is not None)
    assert counts == Counter({"q": 6, "k": 6, "v": 6, "modulation": 6, "mlp_up": 6, "attn_out": 4,
                              "mlp_down": 4, "proj": 2})
    assert all(lin.role == "other" for lin in s.linears if lin.block is None)  # prologue/epilogue
    q = s.linears_with_role("q")[0]
    assert q.weight == "transformer_blocks.0.attn.to_q.weight"
    assert (q.in_features, q.out_features) == (zm.expected["heads"] * zm.expected["head_dim"],) * 2
    assert {lin.role for lin in s.column_parallel_linears()} == {"q", "k", "v", "mlp_up"}
    assert {lin.role for lin in s.row_parallel_linears()} == {"attn_out", "mlp_down", "proj"}
    with pytest.raises(ValueError, match="unknown linear roles"):
        s.linears_with_role("query")


def test_single_stream_linear_roles_wan():
    zm, s = structure_of("wan")
    assert s.num_streams == 1
    for b in s.blocks:
        assert _roles_by_suffix(s, b.index) == WAN_BLOCK, b.path
        assert len(b.stream_inputs) == 1
    # self-attention q/k/v read the image stream; cross-attention k/v the text (kv_len = text tokens)
    a0, a1 = s.attention_in(0)
    assert a0.q_len == a0.kv_len and a1.kv_len == zm.expected["tokens"]["default"]["text"]


def test_attention_sites_link_projections():
    _, s = structure_of("flux")
    for a in s.attention:
        assert a.node.target is torch.ops.aten.scaled_dot_product_attention.default
        assert a.q.meta["val"].shape[1] == a.num_heads
    assert s.blocks_range(1, 3) == s.blocks[1:3]
    assert "transformer_blocks x2" in s.summary() and "heads=2, head_dim=16" in s.summary()


def test_mixture_of_experts_router_role_and_quantizers_keep_it():
    """NucleusMoE's expert gate feeds softmax -> topk: role ``router`` (by dataflow); Fp8Linear's default selection
    leaves it in precision (rounding it flips the experts chosen), ``exclude=()`` takes it too."""
    import diffusers

    from dit_passes import passes
    from dit_passes.models import zoo

    if not hasattr(diffusers, zoo.class_name_of("nucleusmoe")):
        pytest.skip("this diffusers has no NucleusMoE transformer")
    zm = build("nucleusmoe")
    kw = zm.make_inputs(batch=1, seed=1)
    s = compile_dit(zm.model, passes=[], example_inputs=kw).structure
    routers = [lin.module_path for lin in s.linears_with_role("router")]
    assert routers and all(p.endswith("img_mlp.gate") for p in routers), routers
    assert not any(lin.module_path.endswith("gate") and lin.role != "router" for lin in s.linears)

    def quantized(**kw_pass):
        c = compile_dit(zm.model, passes=[passes.Fp8Linear(**kw_pass)], example_inputs=kw, keep_original=True)
        return {n.meta.get("dit_module_path") for n in c.graph.nodes if n.meta.get("dit_quant")}
    assert not set(routers) & quantized()
    assert set(routers) <= quantized(exclude=())


@pytest.mark.parametrize("family,overrides,lists", [
    ("wan", dict(num_layers=1), [("blocks", 1)]),
    ("flux", dict(num_layers=1, num_single_layers=3), [("transformer_blocks", 1), ("single_transformer_blocks", 3)]),
    ("flux3", dict(num_layers=1, num_single_layers=1), [("txt_mode_blocks", 1), ("single_transformer_blocks", 1)]),
])
def test_a_list_of_one_attending_block_is_a_block_list(family, overrides, lists):
    """A one-layer DiT (and FLUX with one double block) captures as a DiT: a list of one block counts when the block
    attends; the lowered module equals eager. One block: DBCache refuses with a reason (nothing between Fn and Bn).
    More: it caches, its streams told from the side inputs without a second reader (FLUX.2's per-list modulation
    vectors, which a list of one block reads once: the cut refused them as streams before)."""
    from dit_passes.infra.pass_base import PassError
    from dit_passes.passes import DBCache
    zm = build(family, **overrides)
    kw = zm.make_inputs()
    compiled = compile_dit(zm.model, example_inputs=kw)
    assert [(bl.name, bl.count) for bl in compiled.structure.block_lists] == lists
    with torch.no_grad():
        torch.testing.assert_close(compiled(**kw)[0], zm.model(**kw)[0], rtol=1e-5, atol=1e-5)
    # two calls on the same inputs as two steps of one state (under the default they are one step's CFG branches)
    cache = [DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1, residual_diff_threshold=1.0,
                     enable_separate_cfg=False)]
    if sum(c for _, c in lists) == 1:
        with pytest.raises(PassError, match="at least one middle block can be cached"):
            compile_dit(zm.model, passes=cache, example_inputs=kw)
        return
    cached = compile_dit(zm.model, passes=cache, example_inputs=kw)
    with torch.no_grad():
        outs = [cached(**kw)[0] for _ in range(2)]
    assert list(cached.report("dbcache").last_generation()["step_cached"]) == [False, True]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,lists,prologue", [
    ("hidream", [("double_stream_blocks", 2), ("single_stream_blocks", 2)], "caption_projection"),
    ("longcat_audio", [("blocks", 4)], "text_conv_layer"),
])
def test_a_list_that_runs_no_attention_is_not_blocks(family, lists, prologue):
    """HiDream's five caption projections and LongCat-Audio's text convolutions are lists of one class feeding the
    first block list: the stack held them as its first blocks (DBCache's Fn counted projections; its residual
    signal was a projection's output). Lists whose blocks run no attention stay prologue where others attend."""
    zm = build(family, redraw_zeros=True)
    kw = zm.make_inputs(seed=1)
    compiled = compile_dit(zm.model, example_inputs=kw)
    s = compiled.structure
    assert [(bl.name, bl.count) for bl in s.block_lists] == lists
    assert s.candidates[prologue] >= 2 and all(not b.path.startswith(prologue) for b in s.blocks)
    with torch.no_grad():
        torch.testing.assert_close(compiled(**kw)[0], zm.model(**kw)[0], rtol=1e-5, atol=1e-5)
