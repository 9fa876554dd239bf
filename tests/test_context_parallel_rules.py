"""Context parallelism on the diffusers families whose ops needed their own sequence rules, 2 gloo ranks.

One rank call runs every case: ERNIE-Image (sequence-first stream [tokens, batch, features]), PRX (image queries
over text + image keys; a gathered value keeps its traced memory layout, which a later ``view`` relies on), Sana
(``pad`` off the token dim, linear attention: a matmul contracting the tokens, all-reduced), LongCat-Audio (a
depthwise ``conv1d`` over the sharded text: gathered; the main stack's stream sharded where that stack starts; a
``sum`` over the text tokens, all-reduced), NucleusMoE (expert-choice routing: ``topk`` / ``scatter_add`` over the
tokens, gathered), Z-Image (rotary embeddings inside ``wrap_with_autocast`` regions, analysed as regions of their
own), OmniGen (one K/V head broadcast over the query heads, as SDPA does), AnyFlow-FAR, Kandinsky 6 SR and
Wan-Animate 2 (flex attention: gathered, run whole; Wan-Animate 2's ``new_zeros`` buffers replicated) and Flux with one text token (a
stream shorter than the group stays replicated). Every case: the output equals the single-process one (fp32,
rel <= 1e-5) on every rank, twice, and the collectives that run are exactly those the pass counted. Parameters a
class initialises to a constant (zero output layers, zero adaLN gates) are redrawn first, so that every block
contributes to the output. The toys at the end check single rules without ranks.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dit_passes.analysis.blocks import get_structure
from dit_passes.capture import capture
from dit_passes.infra.pass_base import PassError
from dit_passes.parallel.propagate import PropagationError, repropagate
from dit_passes.parallel.sequence_sharding import SequenceShardSpec, analyze
from dit_passes.testing import run_ranks
from dit_passes.testing.counting import OpCounter
from test_context_parallel import _TinyDiT  # noqa: E402 - the tests folder is on sys.path (pytest's rootdir)

TOL = 1e-5
_KINDS = ("all_to_all_single", "all_gather_into_tensor", "ring_exchange", "all_reduce")


@contextlib.contextmanager
def _empty_is_nan():
    """``torch.empty`` fills with NaN meanwhile (deterministic mode), so that the zoo tells the parameters a class
    leaves uninitialised (NucleusMoE's experts) from the others by comparing two builds, whatever memory the
    allocator hands out (two builds may get the same stale bytes in a process that ran other tests)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _wake(model: torch.nn.Module) -> None:
    """Redraw the parameters a class initialises to one constant (zero gates would hide the blocks)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _first(out) -> torch.Tensor:
    return out[0][0] if isinstance(out[0], (list, tuple)) else out[0]


def _one_text_token(kw: dict) -> dict:
    kw["encoder_hidden_states"] = kw["encoder_hidden_states"][:, :1].contiguous()
    kw["txt_ids"] = kw["txt_ids"][:1]
    return kw


# family -> (parallel kind, batch, input edit)
CASES = {
    "ernie_image": ("ulysses", 2, None),
    "prx": ("ring", 1, None),
    "sana": ("ulysses", 1, None),
    "longcat_audio": ("ulysses", 1, None),
    "nucleusmoe": ("ring", 1, None),
    "zimage": ("ulysses", 1, None),
    "omnigen": ("ring", 1, None),
    "anyflow_far": ("ring", 1, None),
    "kandinsky6_sr": ("ulysses", 1, None),
    "wan_animate2": ("ulysses", 1, None),
    "flux": ("ring", 1, _one_text_token),
}


def _case(family, kind, batch, edit, world):
    from dit_passes import compile_dit
    from dit_passes.models.zoo import build
    from dit_passes.passes import Ring, Ulysses

    with _empty_is_nan():
        zm = build(family)
    _wake(zm.model)
    kw = zm.make_inputs(batch=batch, seed=1)
    kw = edit(kw) if edit else kw
    with torch.no_grad():
        ref = _first(zm.model(**kw))
        compiled = compile_dit(zm.model, passes=[Ulysses(size=world) if kind == "ulysses" else Ring(size=world)])
        compiled.lower(**kw)
        ran = OpCounter(_KINDS)
        with ran:
            out = _first(compiled(**kw))
        again = _first(compiled(**kw))
    outs = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(outs, out.contiguous())
    gm = compiled.graph_module
    return {"err": max(((o - ref).abs().max() / ref.abs().max()).item() for o in (out, again)),
            "agree": all(torch.equal(o, outs[0]) for o in outs), "shape_ok": out.shape == ref.shape,
            "counts": dict(compiled._current().manager.records[-1].result.counts), "ran": dict(ran.counts),
            "report": compiled._current().manager.records[-1].result.report,
            # the dims along which 3-D values ([batch, tokens, features] or [tokens, batch, features]) are sharded
            "shard_dims_3d": sorted({int(n.args[1]) for n in gm.graph.nodes if n.op == "call_function" and
                                     getattr(n.target, "__name__", "") == "shard_sequence" and
                                     n.args[0].meta["val"].dim() == 3})}


def _empty_shard_gather(rank, world):
    """A value of 1 token on 2 ranks (rank 1 holds none) gathers back whole."""
    from dit_passes.parallel import sequence_ops as ops
    full = torch.arange(6.0).reshape(1, 3, 2)[:, :1]
    local = full[:, :1] if rank == 0 else full[:, :0]
    got = ops.gather_sequence(local, 1, dist.group.WORLD.group_name, [1, 0], [], [])
    return torch.equal(got, full)


def _rule_cases(rank, world):
    results = {family: _case(family, *spec, world) for family, spec in CASES.items()}
    return results, _empty_shard_gather(rank, world)


@pytest.fixture(scope="module")
def rule_ranks():
    return run_ranks(_rule_cases, 2, timeout=600)


def test_families_match_single_process_with_the_collectives_counted(rule_ranks):
    for rank, (cases, empty_gather_ok) in enumerate(rule_ranks):
        assert empty_gather_ok, f"rank {rank}: gathering a value with an empty shard"
        assert set(cases) == set(CASES)
        for family, r in cases.items():
            where = f"rank {rank} {family} {CASES[family][0]}"
            assert r["err"] <= TOL and r["agree"] and r["shape_ok"], f"{where}: rel {r['err']:.2e}, agree {r['agree']}"
            c, ulysses = r["counts"], CASES[family][0] == "ulysses"
            n = c["attention_replaced"]
            want = {"all_to_all_single": 4 * n if ulysses else 0, "ring_exchange": 0 if ulysses else n,
                    "all_gather_into_tensor": c["outputs_gathered"] + c["nonlocal_gathers"],
                    "all_reduce": c["all_reduce"]}
            assert {k: r["ran"].get(k, 0) for k in want} == want, f"{where}: ran {r['ran']}, counted {c}"
            assert c["all_gather"] == want["all_gather_into_tensor"] and c["outputs_gathered"] == 1, f"{where}: {c}"
    cases = rule_ranks[0][0]
    # ERNIE-Image: its stream is [tokens, batch, features] (batch 2 here): sharded on dim 0, attention distributed
    assert cases["ernie_image"]["counts"]["attention_replaced"] == 2 and cases["ernie_image"]["shard_dims_3d"] == [0]
    # PRX: queries over text + image keys stay local over the gathered keys (k and v per attention)
    assert cases["prx"]["counts"]["attention_local"] == 2 and cases["prx"]["counts"]["nonlocal_gathers"] == 4
    # linear attention: one all-reduce per block, for v^T k (a sum over the tokens: the toys below)
    assert cases["sana"]["counts"]["all_reduce"] == 2
    # LongCat-Audio: its text ConvNeXt convs (and their sums over the tokens) run before the stack, whole on every rank
    # (no attention: not blocks), so nothing is gathered or reduced for them; the audio stream sharded where the stack
    # starts (had the convs been taken as the stack's first blocks: 4 gathers, 1 all-reduce, 2 inputs sharded)
    longcat = cases["longcat_audio"]["counts"]
    assert longcat["nonlocal_gathers"] == 0 and longcat["all_reduce"] == 0, longcat
    assert longcat["inputs_sharded"] == 1 and longcat["attention_replaced"] == 4
    # Z-Image: q and k rotary regions of 2 blocks rewritten, the attention still distributed
    assert cases["zimage"]["counts"]["regions"] == 4 and cases["zimage"]["counts"]["attention_replaced"] == 2
    # OmniGen: K / V with one head, broadcast to the query heads, the attention still distributed
    assert cases["omnigen"]["counts"]["attention_replaced"] == 2
    # flex attention (AnyFlow-FAR, Kandinsky 6 SR, Wan-Animate 2: block masks over global positions) runs whole on
    # its gathered q / k / v; the streams stay sharded around it (Wan-Animate 2 builds its padded q / k / v with
    # new_zeros + slice_scatter, which gather too; its rotary tail is an empty slice, the same on every rank)
    for family in ("anyflow_far", "kandinsky6_sr"):
        assert cases[family]["report"].count("flex attention: its block mask") >= 1, cases[family]["report"]
        assert cases[family]["counts"]["nonlocal_gathers"] >= 3
    assert cases["anyflow_far"]["counts"]["attention_local"] == 2  # cross-attention over the full text
    assert cases["wan_animate2"]["counts"]["attention_local"] == 4  # text and image cross-attention
    # Flux with 1 text token: the text stream stays replicated, the image is sharded; attention still distributed
    assert cases["flux"]["counts"]["inputs_sharded"] == 1 and cases["flux"]["counts"]["attention_replaced"] == 4


# ------------------------------------------------------------------------------ analysis only (no ranks)
# the toy of test_context_parallel.py: two blocks of attention, then ``op`` on the attention output
def _plan(op, tokens=6, edit=None):
    gm = capture(_TinyDiT(op), (), {"hidden_states": torch.randn(1, tokens, 8)}).gm
    for n in gm.graph.nodes:
        n.target = (edit or {}).get(n.target, n.target)
    return analyze(gm, get_structure(gm), SequenceShardSpec(2, 0))


def test_rules_partial_sums_gathers_and_refusals():
    aten = torch.ops.aten
    # linear attention: y (y^T y) contracts the tokens in y^T y (partial sum, all-reduced), then rows stay local
    plan = _plan(lambda y: y @ (y.transpose(1, 2) @ y) * 1e-2)
    assert [n.target for n in plan.reduced] == [aten.matmul.default] * 2 and not plan.nonlocal_ops
    # a sum over the tokens is a partial sum too; a pad of the features is local
    plan = _plan(lambda y: F.pad(y, (0, 1))[..., :8] + y.sum(dim=1, keepdim=True))
    assert [n.target for n in plan.reduced] == [aten.sum.dim_IntList] * 2 and not plan.nonlocal_ops
    # a depthwise conv over the tokens mixes neighbours: its input is gathered, it runs whole
    w = torch.randn(8, 1, 3)
    plan = _plan(lambda y: F.conv1d(y.transpose(1, 2), w, padding=1, groups=8).transpose(1, 2))
    conv = (aten.conv1d.default, "aten.conv1d.default mixes tokens")
    assert [(n.target, why) for n, why in plan.nonlocal_ops] == [conv] * 2
    # a stream shorter than the group stays replicated: nothing is sharded, every attention runs whole
    plan = _plan(lambda y: y, tokens=1)
    assert not plan.streams and not plan.layouts and not plan.attention
    # a scatter over the tokens (global indices) is gathered; in place on a token-sharded tensor it would update a
    # gathered copy: refused before running (export writes it out of place; the graph is edited to in place)
    index = torch.zeros(1, 6, 8, dtype=torch.long)
    plan = _plan(lambda y: y.clone().scatter_add(1, index, y))
    assert [n.target for n, _ in plan.nonlocal_ops] == [aten.scatter_add.default] * 2
    with pytest.raises(PassError, match=r"in-place op aten\.scatter_add_\.default .*updates a token-sharded"):
        _plan(lambda y: y.clone().scatter_add(1, index, y), edit={aten.scatter_add.default: aten.scatter_add_.default})


def _relative_flex(y):
    """Flex attention over the heads of ``y`` with a relative-position score (it reads the global query index)."""
    from torch.nn.attention.flex_attention import flex_attention
    b, n, d = y.shape
    q = y.view(b, n, 2, d // 2).transpose(1, 2)
    out = flex_attention(q, q, q, score_mod=lambda s, bi, h, qi, ki: s - 0.1 * (qi - ki).abs())
    return out.transpose(1, 2).reshape(b, n, d)


def test_flex_attention_gathers_and_new_tensors_are_replicated():
    aten = torch.ops.aten
    # flex attention's score / mask functions index global positions: q / k / v gathered, it runs whole
    plan = _plan(_relative_flex)
    flex = [(n, why) for n, why in plan.nonlocal_ops if n.target is torch.ops.higher_order.flex_attention]
    assert len(flex) == 2 and all("flex attention" in why for _, why in flex)
    # new_zeros of a sharded value: a constant of the full size (replicated), sliced where it meets the shard
    plan = _plan(lambda y: y + y.new_zeros(y.shape).fill_(1.0))
    zeros = [n for n in plan.region if n.target is aten.new_zeros.default]
    assert len(zeros) == 2 and not plan.nonlocal_ops and not any(n in plan.layouts for n in zeros)
    # an empty slice of the token dim (the tail past a rotated prefix) is the same empty value on every rank; a cat
    # with it adds no tokens: nothing gathered, the cat keeps the shard's layout
    plan = _plan(lambda y: torch.cat([y * 2, y[:, 6:]], dim=1))
    cats = [n for n in plan.region if n.target is aten.cat.default]
    assert not plan.nonlocal_ops and all(plan.layouts[n].lengths == (6,) for n in cats) and len(cats) == 2


def test_repropagate_checks_a_view_against_the_new_layout():
    """A rewrite that changes a value's layout (same shape) re-derives the ops after it: a ``view`` the traced
    layout allowed and the new one does not fails here, naming the node, not inside the rewritten graph."""
    gm = capture(_Twice(), (), {"x": torch.randn(2, 4, 3)}).gm
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    old = x.meta["val"]
    x.meta["val"] = old.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, features outermost
    with pytest.raises(PropagationError, match=rf"node '{view.name}'.*[Cc]annot view"):
        repropagate(gm.graph, {mul}, strides=True)


class _Twice(torch.nn.Module):
    def forward(self, x):
        return (x * 2).view(2, 12)
