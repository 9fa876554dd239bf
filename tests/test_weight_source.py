"""A model built on the meta device plus a safetensors checkpoint: ``compile_dit(weights=...)``.

Single process: the meta build equals the CPU-built model and the model ends holding the graph's tensors. On 2
gloo ranks (one spawn): tensor parallelism reads only each rank's slice of a sharded weight (the source's byte
counters; with heads zero-padded only its real rows), the output equals the single-process eager one, a second
signature reads nothing again. Bad input:
meta weights with no checkpoint, a checkpoint missing a name or holding another shape (whole or a rank's slice).
"""
from __future__ import annotations

import re
import weakref

import pytest
import torch
from safetensors.torch import save_file

from dit_passes import PassError, SafetensorsWeights, compile_dit
from dit_passes.infra.weight_source import WeightSourceError
from dit_passes.models import zoo
from dit_passes.testing.multiproc import run_ranks

TOL = 1e-5


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta_twin(family: str, fuse: bool = False, **overrides) -> torch.nn.Module:
    """``family``'s tiny model built on the meta device (no weights), as a user builds a FLUX-size one."""
    config = {**zoo.config_for(family), **overrides}
    with torch.device("meta"):
        model = zoo.model_class(family)(**config).eval()
    if fuse:
        model.fuse_qkv_projections()
    return model


def _save(model: torch.nn.Module, path, drop=(), reshape=()) -> str:
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k not in drop}
    for k in reshape:  # another configuration's tensor: one row fewer
        sd[k] = sd[k][:-1].contiguous()
    save_file(sd, str(path))
    return str(path)


def _reference(family: str, fuse: bool, batch: int):
    torch.manual_seed(0)
    zm = zoo.build(family)
    if fuse:
        zm.model.fuse_qkv_projections()
    return zm, zm.make_inputs(batch=batch)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    zm, kw = _reference("flux", False, 1)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
    return zm, kw, ref, _save(zm.model, tmp_path_factory.mktemp("ckpt") / "flux.safetensors")


def test_meta_build_equals_cpu_model(flux):
    zm, kw, ref, path = flux
    model = _meta_twin("flux")
    source = SafetensorsWeights(path)
    c = compile_dit(model, passes=[], weights=source, example_inputs=kw)
    out = c(**kw)[0]
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-6
    sd = zm.model.state_dict()
    # read once, whole: each name the graph holds, its full size (no name read twice)
    held = {n.target for n in c.graph_module.graph.nodes if n.op == "get_attr"}
    assert set(source.bytes_read) == held and held <= set(sd)
    assert all(source.bytes_read[k] == _nbytes(sd[k]) for k in held)
    # the model holds the graph's tensors (one copy, not meta), on the inputs' device
    params = dict(model.named_parameters())
    assert all(not params[k].is_meta and params[k] is c.graph_module.get_parameter(k) for k in held if k in params)
    assert c.device == torch.device("cpu") and c.released == {}
    rec = [r for r in c._current().manager.records if r.name == "load_weights"][0]
    assert rec.result.counts == {"loaded": len(held), "bytes": sum(_nbytes(sd[k]) for k in held)}


def test_meta_weights_without_checkpoint_refused(flux):
    _, kw, _, _ = flux
    model = _meta_twin("flux")
    with pytest.raises(WeightSourceError, match=r"meta device \(e\.g\. \S+\).*pass weights="):
        compile_dit(model, passes=[], example_inputs=kw)
    # meta inputs: a shape-only dry run (memory planning) needs no values
    meta_kw = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    c = compile_dit(model, passes=[], example_inputs=meta_kw)
    assert c.graph_module is not None
    with pytest.raises(TypeError, match="safetensors path"):
        compile_dit(model, weights=3)
    with pytest.raises(FileNotFoundError, match="no safetensors file"):
        compile_dit(model, weights="/nonexistent/ckpt")


def test_checkpoint_missing_or_misshaped_refused(flux, tmp_path):
    zm, kw, _, _ = flux
    name = "transformer_blocks.0.norm1.linear.weight"
    shape = list(zm.model.state_dict()[name].shape)
    missing = _save(zm.model, tmp_path / "missing.safetensors", drop=[name])
    module = "transformer_blocks.0.norm1.linear"
    with pytest.raises(PassError, match=re.escape(f"load_weights (module {module}, weight): the checkpoint") + ".*"
                       + re.escape(f"no tensor '{name}' (expected shape {shape})")):
        compile_dit(_meta_twin("flux"), weights=missing, example_inputs=kw)
    other = _save(zm.model, tmp_path / "other.safetensors", reshape=[name])
    found = [shape[0] - 1] + shape[1:]
    with pytest.raises(PassError, match=re.escape(f"'{name}' has shape {found}, the model expects {shape}")
                       + ".*build the model with the checkpoint's config"):
        compile_dit(_meta_twin("flux"), weights=other, example_inputs=kw)


# ---------------------------------------------------------------- tensor parallelism on 2 gloo ranks
def _tp_case(rank, world, family, fuse, path):
    from dit_passes.passes.tensor_parallel import TensorParallel

    zm, kw = _reference(family, fuse, 2)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
    full = zm.model.state_dict()
    model = _meta_twin(family, fuse)
    source = SafetensorsWeights(path)
    c = compile_dit(model, passes=[TensorParallel(world)], weights=source)
    out = c(**kw)[0]
    gm = c.graph_module
    held = {n.target: gm.get_parameter(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    sharded = {k for k, t in held.items() if t.shape != full[k].shape}
    read_first = dict(source.bytes_read)
    kw1 = zm.make_inputs(batch=1)  # another signature: lowered again, nothing read again
    with torch.no_grad():
        ref1 = zm.model(**kw1)[0]
    out1 = c(**kw1)[0]
    params = dict(model.named_parameters())
    return {
        "err": ((out - ref).abs().max() / ref.abs().max()).item(),
        "err1": ((out1 - ref1).abs().max() / ref1.abs().max()).item(),
        "read": read_first, "read_again": dict(source.bytes_read),
        "full": {k: _nbytes(full[k]) for k in held}, "local": {k: _nbytes(t) for k, t in held.items()},
        "sharded": sharded,
        "model_meta": {k for k, p in params.items() if p.is_meta},
        "released": set(c.released),
    }


def _tp_bad_slice(rank, world, path):
    from dit_passes.passes.tensor_parallel import TensorParallel

    _, kw = _reference("flux", False, 1)
    try:
        compile_dit(_meta_twin("flux"), passes=[TensorParallel(world)], weights=path, example_inputs=kw)
    except PassError as e:
        return str(e)
    return "no error"


def _tp_dry_run(rank, world):
    """Shape-only: the meta model, meta inputs, no checkpoint (how bench/tp_meta_weights.py sizes FLUX.1-dev)."""
    import functools

    from dit_passes.passes.tensor_parallel import TensorParallel

    _, kw = _reference("flux", False, 2)
    meta_kw = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    gm = compile_dit(_meta_twin("flux"), passes=[TensorParallel(world)], example_inputs=meta_kw).graph_module
    held = {n.target: functools.reduce(getattr, n.target.split("."), gm) for n in gm.graph.nodes if n.op == "get_attr"}
    return {k: (t.is_meta, _nbytes(t)) for k, t in held.items()}


def _tp_ranks(rank, world, paths):
    return {"flux": _tp_case(rank, world, "flux", False, paths["flux"]),
            "flux_fused": _tp_case(rank, world, "flux", True, paths["flux_fused"]),
            "flux_heads3": _tp_case(rank, world, "flux[heads3]", False, paths["flux_heads3"]),
            "bad": _tp_bad_slice(rank, world, paths["bad"]), "dry": _tp_dry_run(rank, world)}


@pytest.fixture(scope="module")
def tp_two(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_ckpt")
    paths = {"flux": _save(_reference("flux", False, 1)[0].model, d / "flux.safetensors"),
             "flux_fused": _save(_reference("flux", True, 1)[0].model, d / "flux_fused.safetensors"),
             "flux_heads3": _save(_reference("flux[heads3]", False, 1)[0].model, d / "flux_heads3.safetensors"),
             "bad": _save(_reference("flux", False, 1)[0].model, d / "bad.safetensors",
                          reshape=["transformer_blocks.0.attn.to_q.weight"])}
    return run_ranks(_tp_ranks, 2, paths, timeout=600)


@pytest.mark.parametrize("case", ["flux", "flux_fused"])
def test_tp2_reads_only_its_slices(tp_two, case):
    for rank, res in enumerate(tp_two):
        r = res[case]
        assert r["err"] <= TOL and r["err1"] <= TOL, (rank, r["err"], r["err1"])
        full, read, sharded = r["full"], r["read"], r["sharded"]
        assert sharded and set(read) == set(full)  # every weight the graph holds read, each once
        if case == "flux_fused":
            assert any(k.endswith("to_qkv.weight") for k in sharded)
        for k in full:  # a sharded weight: exactly this rank's half of it; the rest whole
            assert read[k] == (full[k] // 2 if k in sharded else full[k]) == r["local"][k], (rank, k)
        bound = sum(full[k] for k in sharded) / 2 + sum(full[k] for k in full if k not in sharded)
        assert sum(read.values()) <= bound < sum(full.values())
        assert r["read_again"] == read  # the second signature reused the shards and the loaded weights
        # the model: sharded weights released (meta), the rest hold the graph's tensors; what the graph does not
        # read (the fused model's unfused q / k / v) stays meta, never read
        assert r["model_meta"] & set(full) == sharded == r["released"]
        assert not (r["model_meta"] - set(full)) & set(read)
        if case == "flux":
            assert r["model_meta"] == sharded


def test_tp2_padded_heads_read_only_their_real_rows(tp_two):
    """3 heads zero-padded to 4 over 2 ranks: rank 0 holds heads 0-1, rank 1 head 2 and a zero head; each reads
    only its real rows of the checkpoint (2 and 1 heads of q / k / v), the zeros are made, never read."""
    runs = [res["flux_heads3"] for res in tp_two]
    for rank, r in enumerate(runs):
        assert r["err"] <= TOL and r["err1"] <= TOL, (rank, r["err"], r["err1"])
        assert r["read_again"] == r["read"] and r["model_meta"] == r["sharded"] == r["released"]
        for k in r["sharded"]:
            assert r["read"][k] <= r["local"][k] and r["read"][k] < r["full"][k], (rank, k)
    sharded = runs[0]["sharded"]
    for k in sharded:  # every element of a sharded weight read by exactly one rank
        assert sum(r["read"][k] for r in runs) == runs[0]["full"][k], k
    q = "transformer_blocks.0.attn.to_q.weight"
    assert q in sharded and [r["read"][q] * 3 for r in runs] == [2 * runs[0]["full"][q], runs[0]["full"][q]]
    assert runs[0]["local"][q] == runs[1]["local"][q] == runs[0]["full"][q] * 2 // 3  # 2 heads of 3 each


def test_tp2_dry_run_on_meta_plans_the_same_bytes(tp_two):
    for res in tp_two:  # nothing allocated, and each weight as large as what the checkpoint build reads and keeps
        assert all(is_meta for is_meta, _ in res["dry"].values())
        assert {k: b for k, (_, b) in res["dry"].items()} == res["flux"]["local"]


def test_tp2_slice_shape_mismatch_refused(tp_two):
    for res in tp_two:
        msg = res["bad"]
        assert "tensor_parallel" in msg and "transformer_blocks.0.attn.to_q.weight" in msg, msg
        assert "tensor_parallel (module transformer_blocks.0.attn.to_q, rank" in msg, msg
        assert "has shape [31, 32], the model expects [32, 32]" in msg, msg


# ---------------------------------------------------------------- quantization from the checkpoint
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))  # K = 64: W4A4 applies


class _WatchedWeights(SafetensorsWeights):
    """Records, at each read of a watched name, how many earlier reads of watched names are still alive."""

    def __init__(self, path, watched):
        super().__init__(path)
        self.watched, self.alive_at_read, self._refs = set(watched), [], []

    def read(self, name, index=None, **to):
        t = super().read(name, index, **to)
        if name in self.watched:
            self.alive_at_read.append(sum(r() is not None for r in self._refs))
            self._refs.append(weakref.ref(t))
        return t


@pytest.mark.parametrize("modulation", ["w8a16", "w4a16_lr"])  # int8; the default, int4 + low-rank factors
def test_svdquant_from_checkpoint_one_weight_at_a_time(tmp_path, modulation):
    from dit_passes.passes import SVDQuantW4A4

    zm = zoo.build("flux", **FLUX64)
    kw = zm.make_inputs()
    path = _save(zm.model, tmp_path / "flux64.safetensors")
    sd = zm.model.state_dict()
    cpu = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation=modulation)], example_inputs=kw)
    quantized = set(cpu.released)  # the weights the quantizer replaced (the CPU model holds meta there now)
    assert quantized and all(k.endswith(".weight") for k in quantized)
    source = _WatchedWeights(path, quantized)
    model = _meta_twin("flux", **FLUX64)
    meta = compile_dit(model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation=modulation)], weights=source,
                       example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(meta(**kw)[0], cpu(**kw)[0])  # the same tables: the same numbers
    # each weight read once, whole; a quantized weight was dropped before the next one was read
    held = {n.target for n in meta.graph_module.graph.nodes if n.op == "get_attr"}
    assert set(source.bytes_read) >= quantized and not quantized & held
    assert all(source.bytes_read[k] == _nbytes(sd[k]) for k in source.bytes_read)
    assert len(source.alive_at_read) == len(quantized) and max(source.alive_at_read) == 0
    # the model: quantized weights released (meta, marked), the rest the graph's own tensors
    assert set(meta.released) == quantized
    params = dict(model.named_parameters())
    assert {k for k, p in params.items() if p.is_meta} == quantized
    rec = [r for r in meta._current().manager.records if r.name == "svdquant_w4a4"]
    assert rec and "read from the checkpoint one linear at a time" in rec[0].result.report
    with pytest.raises(PassError, match="calibrate_fn runs the model.*dynamic=True"):
        compile_dit(_meta_twin("flux", **FLUX64), weights=path, example_inputs=kw,
                    passes=[SVDQuantW4A4(rank=8, calibrate_fn=lambda: None, serialize_to=str(tmp_path / "q"))])
