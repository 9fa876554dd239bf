"""SVDQuantW4A4 over FuseSiblingLinears: a fused linear of m siblings gets rank ``rank`` x m (graph fact
``fused_linears``), its checkpoint records the members and ranks, and loads back bit-identically.

Tiny zoo FLUX with hidden size 64 (every block linear has K % 64 == 0), fp32 CPU, DQ. The expected groups come
from the model's module names (double-stream blocks: to_q / to_k / to_v and add_q / k / v_proj; single-stream:
proj_mlp + to_q / to_k / to_v), not from the pass.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

import dit_passes
from dit_passes.infra.facts import facts_of
from dit_passes.infra.pass_base import PassError
from dit_passes.models import zoo
from dit_passes.passes import FuseSiblingLinears, SVDQuantW4A4

torch.set_num_threads(1)
compile_dit = functools.partial(dit_passes.compile_dit, keep_original=True)  # one model, compiled several times
load = functools.partial(dit_passes.load, keep_original=True)
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))
RANK = 4


@pytest.fixture(scope="module")
def flux():
    zm = zoo.build("flux", **FLUX64)
    kw = zm.make_inputs(batch=1)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
    return zm, kw, ref


def _expected_groups(cfg):
    groups = []
    for i in range(cfg.num_layers):
        a = f"transformer_blocks.{i}.attn"
        groups += [{f"{a}.to_q", f"{a}.to_k", f"{a}.to_v"}, {f"{a}.add_q_proj", f"{a}.add_k_proj", f"{a}.add_v_proj"}]
    for i in range(cfg.num_single_layers):
        b = f"single_transformer_blocks.{i}"
        groups.append({f"{b}.proj_mlp", f"{b}.attn.to_q", f"{b}.attn.to_k", f"{b}.attn.to_v"})
    return groups


def _ranks(gm):
    """{linear path: rank of its low-rank branch} from the graph's lora_down tensors."""
    return {n[:-len(".lora_down")]: int(t.shape[0]) for n, t in gm.named_buffers() if n.endswith(".lora_down")}


def _run(c, kw):
    with torch.no_grad():
        return c(**kw)[0]


def _err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def _quant_report(c):
    return [r for r in c._current().manager.records if r.name == SVDQuantW4A4.name][0].result.report


def test_fused_linear_gets_rank_per_member_and_checkpoint_loads_back(flux, tmp_path):
    zm, kw, ref = flux
    cfg, model = zm.model.config, zm.model
    ck = str(tmp_path / "q")
    c = compile_dit(model, passes=[FuseSiblingLinears(), SVDQuantW4A4(rank=RANK, dynamic=True, serialize_to=ck)])
    out = _run(c, kw)
    fact = facts_of(c.graph_module).fused_linears
    expected = _expected_groups(cfg)
    assert sorted(map(sorted, ({m for m, _ in f.members} for f in fact.values()))) == sorted(map(sorted, expected))
    for path, f in fact.items():
        assert f.members[0][0] == path  # the fused linear keeps its first member's path
        assert [r for _, r in f.members] == [model.get_submodule(m).out_features for m, _ in f.members]
    ranks = _ranks(c.graph_module)
    for path, f in fact.items():
        assert ranks[path] == RANK * len(f.members), path  # 12 for q / k / v, 16 with proj_mlp
        assert tuple(c.graph_module.get_buffer(f"{path}.lora_up").shape) == (f.out_features, RANK * len(f.members))
    others = {p: r for p, r in ranks.items() if p not in fact}
    assert others and set(others.values()) == {RANK}  # attention out, MLP, modulation (w4a16_lr): rank 4 each
    report = _quant_report(c)
    assert f"{2 * cfg.num_layers} at rank {3 * RANK}" in report
    assert f"{cfg.num_single_layers} at rank {4 * RANK}" in report

    # no worse than each member with its own rank-4 branch (measured: 0.0173 fused vs 0.0190 unfused)
    unfused = _run(compile_dit(model, passes=[SVDQuantW4A4(rank=RANK, dynamic=True)]), kw)
    assert 1e-4 < _err(out, ref) <= 1.1 * _err(unfused, ref)

    # the checkpoint: tag r<rank>, the fused linears' ranks and members recorded, and it loads back bit-identically
    side = json.load(open(os.path.join(ck, f"svdq_int4_r{RANK}_dq.json")))
    assert side["config"]["rank_of"] == {p: RANK * len(f.members) for p, f in fact.items()}
    assert {p: s["members"] for p, s in side["structure"]["linears"].items() if "members" in s} == \
        {p: [list(m) for m in f.members] for p, f in fact.items()}
    loaded = load(model, ck, passes=[FuseSiblingLinears()])
    assert torch.equal(_run(loaded, kw), out)
    assert _ranks(loaded.graph_module) == ranks
    with pytest.raises(PassError, match="FuseSiblingLinears"):  # the graph must fuse as the checkpoint was
        _run(load(model, ck), kw)


def test_nvfp4_fused_rank(flux):
    zm, kw, _ = flux
    c = compile_dit(zm.model, passes=[FuseSiblingLinears(), SVDQuantW4A4(rank=RANK, dynamic=True, precision="nvfp4")])
    _run(c, kw)
    ranks, fact = _ranks(c.graph_module), facts_of(c.graph_module).fused_linears
    assert len(fact) == len(_expected_groups(zm.model.config))
    assert {p: ranks[p] for p in fact} == {p: RANK * len(f.members) for p, f in fact.items()}


def test_no_fact_without_fusion(flux, tmp_path):
    zm, kw, _ = flux
    ck = str(tmp_path / "q")
    c = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=RANK, dynamic=True, serialize_to=ck)])
    _run(c, kw)
    assert facts_of(c.graph_module).fused_linears == {}
    assert set(_ranks(c.graph_module).values()) == {RANK}
    assert "fused" not in _quant_report(c)
    side = json.load(open(os.path.join(ck, f"svdq_int4_r{RANK}_dq.json")))
    assert "rank_of" not in side["config"] and not any("members" in s for s in side["structure"]["linears"].values())
    with pytest.raises(PassError, match="FuseSiblingLinears"):  # an unfused checkpoint into a fused graph
        _run(load(zm.model, ck, passes=[FuseSiblingLinears()]), kw)


def test_meta_built_model_writes_the_same_fused_checkpoint(flux, tmp_path):
    """Built on the meta device (``weights=``): the members read from the checkpoint for the fused weight, the same
    tables and signature as from the loaded model."""
    from safetensors.torch import save_file

    from dit_passes import SafetensorsWeights

    zm, kw, _ = flux
    path = str(tmp_path / "flux.safetensors")
    save_file({k: v.detach().contiguous().clone() for k, v in zm.model.state_dict().items()}, path)
    with torch.device("meta"):
        meta = zoo.model_class("flux")(**{**zoo.config_for("flux"), **FLUX64}).eval()
    outs, sides = [], []
    for name, model, kwargs in (("loaded", zm.model, {}), ("meta", meta, {"weights": SafetensorsWeights(path)})):
        ck = str(tmp_path / name)
        q = SVDQuantW4A4(rank=RANK, dynamic=True, serialize_to=ck)
        outs.append(_run(compile_dit(model, passes=[FuseSiblingLinears(), q], example_inputs=kw, **kwargs), kw))
        sides.append(json.load(open(os.path.join(ck, f"svdq_int4_r{RANK}_dq.json"))))
    assert torch.equal(outs[0], outs[1])
    # the same tables (not the files' sha256: safetensors writes its header's metadata in a per-process hash order)
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / n / f"svdq_int4_r{RANK}_dq.safetensors")) for n in ("loaded", "meta"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert sides[0]["structure"] == sides[1]["structure"]
    assert any("members" in s for s in sides[0]["structure"]["linears"].values())
