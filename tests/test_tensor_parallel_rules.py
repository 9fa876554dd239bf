"""TensorParallel's rules beyond Megatron's plain q/k/v/MLP: one spawn of 2 gloo ranks over tiny toy DiTs, each a
pattern a diffusers family has (the coverage matrix runs the families themselves), against the single process.

* a LayerNorm over the sharded q hidden (Lumina-Next's norm_q): distributed, one all-gather of (mean, M2) per norm;
* a fused SwiGLU up projection sliced ``x[..., :h]`` / ``x[..., h:]`` (Flux2): sharded in segments, local slices;
* a fused QKV viewed ``(B, S, 3, H, D)`` and selected (PRX): segments from the view;
* GQA: kv heads that divide tp sharded through ``repeat_interleave``, fewer kv heads than ranks replicated
  (Stable Audio, Nucleus-MoE), one kv head that the attention broadcasts left whole (OmniGen);
* a projection writing the residual stream though its role says mlp_up (HunyuanDiT's skip_linear): replicated;
* a feed-forward applied to two token groups (CogView4): its weights sharded once, held once;
* MLP hidden sizes that do not divide tp (Mochi, Z-Image): zero-padded, exact, reported;
* head counts that do not divide tp (SD3.5-large, CogVideoX-2b, Sana): whole zero heads, exact, with the
  collectives of divisible heads; an RMSNorm or a LayerNorm over all heads (statistics of the real features), a
  fused QKV, one broadcast kv head, one kv head repeated to the q heads (Lumina-Next: sliced and zero-padded
  alike), an identity repeat_interleave of the heads (Cosmos) and an index of tokens (Mochi), a replicated KV
  cache joined to the padded keys (SANA-WM refiner);
* a flex attention with a per-head block mask (Kandinsky 6 SR's NABLA): heads sharded, the mask's heads sliced;
* a value all-gathered before an op without a rule, then viewed as only its traced layout allows (SANA-WM);
* refusals: a weight two linears shard differently, padding a hidden that a norm reads, with the working sizes, a
  flex attention whose score function reads the head index.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dit_passes.testing.multiproc import run_ranks

TOL = 1e-5
DIM, HEADS, HEAD_DIM = 32, 4, 8


class _Block(nn.Module):
    """One DiT block; the options switch on the patterns of the module docstring."""

    def __init__(self, kv_heads=None, q_norm=None, stacked=False, mlp="gelu", hidden=64, mlp_norm=False,
                 skip=False, ff_groups=1, kv_repeat=True, attn="sdpa", flip_heads=False, heads=HEADS, kv_cache=False,
                 copies=False):
        super().__init__()
        self.heads, inner = heads, heads * HEAD_DIM  # heads that do not divide tp: zero-padded
        kv_heads = heads if kv_heads is None else kv_heads
        self.attn_kind, self.flip_heads = attn, flip_heads
        self.kv_heads, self.q_norm_kind, self.stacked, self.mlp_kind = kv_heads, q_norm, stacked, mlp
        self.kv_repeat = kv_repeat  # False: one kv head broadcast over the q heads by the attention (OmniGen)
        self.hidden, self.ff_groups = hidden, ff_groups
        self.copies = copies  # k / v copied by a repeat_interleave of 1 (Cosmos) and an index of tokens (Mochi)
        # keys / values of earlier tokens at the full head width, joined to this call's (SANA-WM refiner's cache)
        self.register_buffer("cache", torch.randn(2, 1, heads, 2, HEAD_DIM) if kv_cache else None)
        self.skip = nn.Linear(2 * DIM, DIM) if skip else None  # reads [x, skip]: writes the residual stream
        self.norm1, self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False), nn.LayerNorm(DIM)
        if stacked:
            self.qkv = nn.Linear(DIM, 3 * inner)
        else:
            self.to_q = nn.Linear(DIM, inner)
            self.to_k, self.to_v = nn.Linear(DIM, kv_heads * HEAD_DIM), nn.Linear(DIM, kv_heads * HEAD_DIM)
        self.norm_q = {"layer": nn.LayerNorm(inner), "group": nn.GroupNorm(2, inner), "rms": nn.RMSNorm(inner),
                       None: None}[q_norm]
        if q_norm in ("layer", "rms"):  # not the identity affine: a wrong slice of it would show
            with torch.no_grad():
                for p in self.norm_q.parameters():
                    p.normal_(1.0 if p is self.norm_q.weight else 0.0, 0.3)
        self.to_out = nn.Linear(inner, DIM)
        if mlp == "tied":  # one square weight as up and down projection
            self.square = nn.Linear(DIM, DIM)
        elif mlp == "glu2":  # w1 / w3 / w2 (Z-Image)
            self.w1, self.w3, self.w2 = nn.Linear(DIM, hidden), nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)
        else:  # "gelu", or "swiglu": one fused up projection, halves sliced (Flux2)
            self.up = nn.Linear(DIM, 2 * hidden if mlp == "swiglu" else hidden)
            self.down = nn.Linear(hidden, DIM)
        self.mid_norm = nn.LayerNorm(hidden) if mlp_norm else None

    def attention(self, x):
        b, s, _ = x.shape
        if self.stacked:
            qkv = self.qkv(x).view(b, s, 3, self.heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        else:
            q = self.to_q(x)
            if self.q_norm_kind in ("layer", "rms"):  # over all heads (Wan's, LTX-Video's RMSNorm)
                q = self.norm_q(q)
            elif self.q_norm_kind == "group":
                q = self.norm_q(q.transpose(1, 2)).transpose(1, 2)
            q = q.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)
            k, v = (t.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2) for t in (self.to_k(x), self.to_v(x)))
            if self.kv_heads != self.heads and self.kv_repeat:
                k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            if self.cache is not None:
                k, v = (torch.cat([c.expand(b, -1, -1, -1), t], 2) for c, t in zip(self.cache, (k, v)))
            if self.copies:  # Cosmos repeats its kv heads to the q heads' count, here equal; Mochi indexes tokens
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                order = torch.arange(s - 1, -1, -1, device=v.device)
                k, v = k[:, :, order], v[:, :, order]
        if self.attn_kind.startswith("flex"):
            o = _flex(q, k, v, head_bias=self.attn_kind == "flex_head")
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        if self.flip_heads:  # an op the rules all-gather, then a view that only the traced layout allows
            o = o.contiguous().transpose(1, 2).flip(2).transpose(1, 2).view(b, HEADS, s * HEAD_DIM)
            o = o.view(b, HEADS, s, HEAD_DIM)
        return self.to_out(o.transpose(1, 2).reshape(b, s, self.heads * HEAD_DIM))

    def mlp(self, x):
        if self.mlp_kind == "tied":
            return self.square(F.gelu(self.square(x)))
        if self.mlp_kind == "glu2":
            h = F.silu(self.w1(x)) * self.w3(x)
        else:
            h = self.up(x)
            h = F.silu(h[..., :self.hidden]) * h[..., self.hidden:] if self.mlp_kind == "swiglu" else F.gelu(h)
        if self.mid_norm is not None:
            h = self.mid_norm(h)
        return (self.w2 if self.mlp_kind == "glu2" else self.down)(h)

    def forward(self, x):
        if self.skip is not None:
            x = self.skip(torch.cat([x, x.flip(1)], -1))
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        return x + torch.cat([self.mlp(g) for g in h.chunk(self.ff_groups, 1)], 1)


def _flex(q, k, v, block=4, head_bias=False):
    """Flex attention with a per-head block mask from the heads' own block scores (Kandinsky 6 SR's NABLA):
    each query block keeps its diagonal key block and the best-scoring one, a different pick per head."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    b, h, s, d = q.shape
    qa = q.reshape(b, h, s // block, block, d).mean(-2)
    ka = k.reshape(b, h, s // block, block, d).mean(-2)
    scores = qa @ ka.transpose(-2, -1)  # (b, h, 2, 2): per head
    keep = (scores >= scores.amax(-1, keepdim=True)) | torch.eye(2, dtype=torch.bool)
    first = keep[..., 0].int()  # key block 0 first when kept (2 blocks: the order is [0, 1] or [1, 0])
    kv_num = keep.sum(-1).to(torch.int32)
    kv_idx = torch.stack([1 - first, first], -1).to(torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=block, compute_q_blocks=False)
    if head_bias:  # a score that reads the head index: local on each rank, refused
        return flex_attention(q, k, v, score_mod=lambda sc, bi, hi, qi, ki: sc + 0.1 * hi, block_mask=mask)
    return flex_attention(q, k, v, score_mod=lambda sc, bi, hi, qi, ki: sc + 0.01 * (qi - ki), block_mask=mask)


class _ToyDiT(nn.Module):
    def __init__(self, second=None, **options):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(**options), _Block(**{**options, **(second or {})})])

    def forward(self, hidden_states):
        for b in self.blocks:
            hidden_states = b(hidden_states)
        return (hidden_states,)


CASES = {
    # Lumina-Next's norm_q, Flux2's fused SwiGLU, GQA with 2 kv heads over 2 ranks
    "layernorm_swiglu_gqa": dict(q_norm="layer", mlp="swiglu", kv_heads=2),
    # PRX's stacked QKV view, Z-Image's w1/w3/w2 with a hidden of 21, HunyuanDiT's skip projection
    "stacked_padded_skip": dict(stacked=True, mlp="glu2", hidden=21, skip=True),
    # one kv head, repeated (Stable Audio) then broadcast (OmniGen), a sliced SwiGLU of hidden 21 (Mochi),
    # applied to two token groups (CogView4)
    "kv1_padded_swiglu_tied": dict(kv_heads=1, mlp="swiglu", hidden=21, ff_groups=2, second=dict(kv_repeat=False)),
    # a flex attention over sharded heads with a per-head block mask (Kandinsky 6 SR, Wan-Animate 2)
    "flex_heads": dict(attn="flex"),
    # heads that do not divide tp (SD3.5-large's 38, CogVideoX-2b's 30 on 4 ranks): 3 heads zero-padded to 4, with
    # an RMSNorm over all heads (Wan); the same structure with 4 heads; a fused QKV, then one kv head (broadcast)
    "heads3_rms": dict(heads=3, q_norm="rms"),
    "heads3_layer_norm": dict(heads=3, q_norm="layer"),  # its moments over each rank's real features only
    "heads3_kv_cache": dict(heads=3, kv_cache=True),  # a replicated cache joined to padded keys / values
    "heads1_layer_norm": dict(heads=1, q_norm="layer"),  # rank 1 holds only padding (no real features)
    "heads4_rms": dict(q_norm="rms"),
    "heads3_stacked_kv1": dict(heads=3, stacked=True, second=dict(stacked=False, kv_heads=1, kv_repeat=False)),
    # one kv head repeated to the 3 q heads (Lumina-Next): replicated, sliced to the rank's q heads, zero-padded
    "heads3_gqa": dict(heads=3, kv_heads=1),
    "heads3_copies": dict(heads=3, copies=True),  # an identity repeat_interleave of the heads, an index of tokens
}
# exact through an all-gather the rules fall back to (a flip over the heads), the traced layout kept
GATHERED = {"flip_heads_view": dict(flip_heads=True)}
REFUSALS = {
    "tied_differently": dict(mlp="tied"),
    "pad_under_norm": dict(mlp="gelu", hidden=63, mlp_norm=True),
    "group_norm": dict(q_norm="group"),
    "flex_reads_head": dict(attn="flex_head"),
    "flex_heads1": dict(attn="flex", heads=1),  # flex attention cannot take zero-padded heads (AnyFlow-FAR, 1 head)
}


def _run_case(options, world):
    from torch.distributed.tensor.debug import CommDebugMode

    from dit_passes import compile_dit
    from dit_passes.passes.tensor_parallel import TensorParallel
    from dit_passes.testing.resident import resident_bytes, tensors_bytes

    torch.manual_seed(0)
    model = _ToyDiT(**options).eval()
    x = torch.randn(2, 8, DIM)
    with torch.no_grad():
        ref = model(x)[0]
    weights = {n: p.numel() * p.element_size() for n, p in [*model.named_parameters(), *model.named_buffers()]}
    c = compile_dit(model, passes=[TensorParallel(size=world)])
    c.lower(hidden_states=x)  # capture + passes outside the debug mode, which then sees only the run
    with torch.no_grad(), CommDebugMode() as comm:
        out = c(hidden_states=x)[0]
    gm = c.graph_module
    rec = [r for r in c._current().manager.records if r.name == "tensor_parallel"][0]
    released = dict(c.released)
    shards = tensors_bytes([gm.get_parameter(t) for t in released])
    return {
        "err": ((out - ref).abs().max() / ref.abs().max()).item(),
        "counts": rec.result.counts, "report": rec.result.report,
        "comm": {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()},
        "graph_ops": [str(n.target).split(".")[-2] for n in gm.graph.nodes
                      if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait" not in str(n.target)],
        "released": released, "shapes": {t: tuple(gm.get_parameter(t).shape) for t in released},
        "ops": {str(n.target).split(".")[-2] for n in gm.graph.nodes
                if n.op == "call_function" and "aten" in str(n.target)},
        # each weight once: what the module still holds whole, plus one shard per released weight
        "resident": resident_bytes(c), "bound": sum(weights.values()) - sum(weights[t] for t in released) + shards,
    }


def _refusal(options, world):
    from dit_passes import PassError, compile_dit
    from dit_passes.passes.tensor_parallel import TensorParallel

    try:
        compile_dit(_ToyDiT(**options), passes=[TensorParallel(size=world)])(hidden_states=torch.randn(1, 8, DIM))
    except PassError as e:
        return str(e)
    return "no error"


def _case_or_refusal(options, world):
    """A case's result; a refusal as its message, so one refused case fails its own test only."""
    from dit_passes import PassError
    try:
        return _run_case(options, world)
    except PassError as e:
        return {"refused": str(e)}


def _ranks(rank, world):
    out = {name: _case_or_refusal(options, world) for name, options in {**CASES, **GATHERED}.items()}
    out.update({name: _refusal(options, world) for name, options in REFUSALS.items()})
    return out


@pytest.fixture(scope="session")
def rule_ranks():
    return run_ranks(_ranks, 2, timeout=400)


def _exact(rule_ranks, case):
    """Each rank's (result, counts) of ``case``, checked exact and running exactly its collectives."""
    for rank, res in enumerate(rule_ranks):
        _check_exact(res[case], f"{case}@{rank}")
        yield res[case], res[case]["counts"]


def _check_exact(r, name):
    assert "refused" not in r, (name, r.get("refused"))
    c = r["counts"]
    assert r["err"] <= TOL, (name, r["err"])
    assert c["fallback_all_gather"] == 0 and c["all_gather"] == 0, (name, r["report"])
    # exactly the collectives the pass inserted ran: one all-reduce per row-parallel linear and per distributed
    # RMSNorm, one all-gather per distributed LayerNorm, nothing else
    reduces = c["all_reduce"] + c["norm_all_reduce"]
    assert r["comm"].get("all_reduce", 0) == reduces and c["all_reduce"] == c["row_parallel"], (name, r["comm"], c)
    assert r["comm"].get("all_gather_into_tensor", 0) == c["norm_all_gather"], (name, r["comm"], c)
    assert sorted(r["graph_ops"]) == sorted(["all_reduce"] * reduces
                                            + ["all_gather_into_tensor"] * c["norm_all_gather"]), (name, r)
    assert r["resident"] <= r["bound"], (name, r["resident"], r["bound"])


def test_layer_norm_slices_and_gqa_heads(rule_ranks):
    for r, c in _exact(rule_ranks, "layernorm_swiglu_gqa"):
        # per block: to_q, to_k, to_v, up column-parallel; to_out, down row-parallel; norm_q distributed
        assert (c["column_parallel"], c["row_parallel"], c["norm_all_gather"]) == (8, 4, 2), c
        assert c["replicated_column"] == c["padded_mlp"] == c["norm_all_reduce"] == 0, c
        # the fused up projection holds its half of gate and of value; 2 kv heads: one each
        assert r["shapes"]["blocks.0.up.weight"] == (64, DIM) and r["shapes"]["blocks.0.to_k.weight"] == (8, DIM)
        assert "2 all-gathers for full-hidden LayerNorms" in r["report"]


def test_stacked_qkv_padding_and_residual_projection(rule_ranks):
    for r, c in _exact(rule_ranks, "stacked_padded_skip"):
        assert (c["column_parallel"], c["row_parallel"], c["padded_mlp"], c["replicated_column"]) == (6, 4, 4, 2), c
        # qkv: rank's heads of q, k and v; w1 / w3: 11 rows (21 padded to 22), w2: 11 columns
        assert r["shapes"]["blocks.0.qkv.weight"] == (3 * DIM // 2, DIM)
        assert r["shapes"]["blocks.1.w1.weight"] == (11, DIM) and r["shapes"]["blocks.1.w2.weight"] == (DIM, 11)
        assert "blocks.0.skip.weight" not in r["released"]
        assert "blocks.0.skip" in r["report"] and "before any linear" in r["report"], r["report"]
        assert "[21] -> [22] at 4 linear(s): blocks.0.w1, blocks.0.w3" in r["report"], r["report"]
        assert "zero-padded [21] -> [22]" in r["released"]["blocks.0.w2.weight"]


def test_gqa_replicated_kv_padded_slices_and_weights_read_twice(rule_ranks):
    for r, c in _exact(rule_ranks, "kv1_padded_swiglu_tied"):
        # the feed-forward runs on two token groups: 2 up and 2 down linears per block read one weight each
        assert (c["column_parallel"], c["row_parallel"], c["padded_mlp"]) == (6, 6, 4), c
        assert c["replicated_column"] == 4 and c["shared_weights"] == 6, c  # up.weight, up.bias, down.weight
        assert "1 kv head(s) do not divide by tp=2" in r["report"]
        assert r["shapes"]["blocks.0.up.weight"] == (22, DIM) and r["shapes"]["blocks.0.down.weight"] == (DIM, 11)
        assert "blocks.0.to_k.weight" not in r["released"]
        assert "[21, 21] -> [22, 22] at 4 linear(s): blocks.0.up, blocks.1.up" in r["report"], r["report"]


def test_refusals_name_the_cause_and_the_sizes_that_work(rule_ranks):
    for res in rule_ranks:
        msg = res["tied_differently"]
        assert "blocks.0.square.weight" in msg and "must shard it alike" in msg, msg
        msg = res["pad_under_norm"]
        assert "63" in msg and "not divisible by tp=2" in msg and "[1, 3, 7, 9, 21, 63]" in msg, msg
        assert "zero-padding the MLP hidden is refused" in msg and "layer_norm" in msg, msg
        msg = res["group_norm"]
        assert "normalises over the sharded hidden size" in msg, msg


def test_flex_attention_sharded_over_heads(rule_ranks):
    for r, c in _exact(rule_ranks, "flex_heads"):
        # to_q / to_k / to_v / up column-parallel, to_out / down row-parallel; the block-score matmul local
        assert (c["column_parallel"], c["row_parallel"], c["replicated_column"]) == (8, 4, 0), c
        assert r["shapes"]["blocks.0.to_q.weight"] == (DIM // 2, DIM)
        assert c["local_slices"] >= 2, c  # the rank's heads of the block mask (kv_num_blocks, kv_indices) per block


def test_gathered_value_keeps_its_traced_layout(rule_ranks):
    for rank, res in enumerate(rule_ranks):
        r = res["flip_heads_view"]
        c = r["counts"]
        assert r["err"] <= TOL, (rank, r["err"])
        # one all-gather per block before the flip (the view after it needs the traced layout), nothing else
        assert c["fallback_all_gather"] == 2 and "aten.flip.default" in r["report"], r["report"]
        assert r["comm"].get("all_gather_into_tensor", 0) == 2, r["comm"]
        assert r["comm"].get("all_reduce", 0) == c["all_reduce"] == c["row_parallel"] == 2, (r["comm"], c)


def test_replicated_cache_joined_to_padded_heads(rule_ranks):
    for r, c in _exact(rule_ranks, "heads3_kv_cache"):
        # the cache's 3 heads sliced to the rank's and zero-padded like the projections' (k and v, per block)
        assert (c["column_parallel"], c["row_parallel"], c["padded_heads"]) == (8, 4, 6), c
        assert c["local_slices"] >= 4, c


def test_flex_attention_refusals_name_the_cause(rule_ranks):
    for res in rule_ranks:
        msg = res["flex_reads_head"]
        assert "score_mod reads the head index" in msg and "tensor_parallel" in msg, msg
        msg = res["flex_heads1"]  # the cause, not only the shard dim it leads to
        assert "1 head(s) do not divide by tp=2" in msg and "cannot take zero-padded heads" in msg, msg


def test_padded_heads_exact_with_the_collectives_of_divisible_heads(rule_ranks):
    for rank, res in enumerate(rule_ranks):
        _check_exact(res["heads4_rms"], f"heads4_rms@{rank}")
    for r, c in _exact(rule_ranks, "heads3_rms"):
        # per block: to_q / to_k / to_v padded 3 -> 4 heads and up column-parallel, to_out / down row-parallel,
        # norm_q over all heads distributed (sum of squares all-reduced, divided by the real 24 features)
        assert (c["column_parallel"], c["row_parallel"], c["padded_heads"], c["padded_mlp"]) == (8, 4, 6, 0), c
        assert c["norm_all_reduce"] == 2 and c["replicated_column"] == 0, c
        ref = next(res["heads4_rms"] for res in rule_ranks)
        assert r["comm"] == ref["comm"] and sorted(r["graph_ops"]) == sorted(ref["graph_ops"]), (r["comm"], ref)
        # each rank holds its 2 heads (one of them padding on rank 1): 16 rows of q / k / v, 16 columns of to_out
        for name in ("to_q", "to_k", "to_v"):
            assert r["shapes"][f"blocks.0.{name}.weight"] == (2 * HEAD_DIM, DIM), r["shapes"]
            assert "zero-padded [24] -> [32]" in r["released"][f"blocks.1.{name}.bias"]
        assert r["shapes"]["blocks.0.to_out.weight"] == (DIM, 2 * HEAD_DIM)
        assert "[24] -> [32] (heads [3] -> [4] of 8) at 6 linear(s): blocks.0.to_q" in r["report"], r["report"]


def test_padded_heads_of_a_fused_qkv_and_one_broadcast_kv_head(rule_ranks):
    for r, c in _exact(rule_ranks, "heads3_stacked_kv1"):
        # block 0: qkv padded in its 3 segments; block 1: to_q padded, the one kv head replicated
        assert (c["column_parallel"], c["padded_heads"], c["replicated_column"]) == (4, 2, 2), c
        assert r["shapes"]["blocks.0.qkv.weight"] == (3 * 2 * HEAD_DIM, DIM)
        assert r["shapes"]["blocks.1.to_q.weight"] == (2 * HEAD_DIM, DIM)
        assert "blocks.1.to_k.weight" not in r["released"]
        assert "[24, 24, 24] -> [32, 32, 32] (heads [3, 3, 3] -> [4, 4, 4] of 8)" in r["report"], r["report"]


def test_padded_heads_under_a_layer_norm_over_all_heads(rule_ranks):
    for case in ("heads3_layer_norm", "heads1_layer_norm"):
        for r, c in _exact(rule_ranks, case):
            # the collectives of 4 heads (one all-gather of (mean, M2) per norm), the moments of the real features
            assert (c["padded_heads"], c["norm_all_gather"], c["all_reduce"]) == (6, 2, 4), c


def test_padded_heads_through_an_identity_repeat_and_an_index_of_tokens(rule_ranks):
    for r, c in _exact(rule_ranks, "heads3_copies"):
        assert (c["column_parallel"], c["padded_heads"], c["replicated_column"]) == (8, 6, 0), c
        assert r["ops"] >= {"repeat_interleave", "index"}, r["ops"]


def test_padded_heads_with_one_kv_head_repeated_to_them(rule_ranks):
    for r, c in _exact(rule_ranks, "heads3_gqa"):
        # to_q padded 3 -> 4 heads; to_k / to_v (one head) replicated, their repeat to 3 heads sliced to the rank's
        # heads and zero-padded like q's (a slice and a pad per block, no collective)
        assert (c["column_parallel"], c["padded_heads"], c["replicated_column"]) == (4, 2, 4), c
        assert c["local_slices"] >= 4 and "1 kv head(s) do not divide by tp=2" in r["report"], c
        assert r["shapes"]["blocks.0.to_q.weight"] == (2 * HEAD_DIM, DIM)
