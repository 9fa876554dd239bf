"""Unfused LoRA with Ring (tests/test_lora.py covers Ulysses only), and fused LoRA with
the passes other than TP (DBCache, fp8, int8, SVDQuant W4A4, layerwise offload): after ``fuse_lora`` no adapter
site is left in the graph and each pass gives what it gives on the fused weights."""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.testing import run_ranks

peft = pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]


def _with_lora(seed=0, **overrides):
    zm = build("flux", **overrides)
    torch.manual_seed(seed)
    zm.model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian"))
    return zm


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _ring_ranks(rank, world):
    zm = _with_lora()
    kw = zm.make_inputs(batch=1, seed=1)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        c = compile_dit(zm.model, passes=[passes.Ring(world)])
        out = c(**kw)[0]
    return {"rel": _rel(out, ref), "lora_sites": len(c.structure.linears_with_role("lora"))}


@pytest.mark.multiproc
def test_unfused_lora_under_ring_two_ranks():
    for rank, r in enumerate(run_ranks(_ring_ranks, 2, timeout=180)):
        assert r["lora_sites"] > 0, (rank, r)  # the adapters really are separate projections in the graph
        assert r["rel"] <= 1e-5, (rank, r)


def test_fused_lora_with_cache_quant_and_offload_passes():
    zm = _with_lora(num_attention_heads=4)  # inner dim 64: every block linear qualifies for W4A4
    kw = zm.make_inputs()
    zm.model.fuse_lora(lora_scale=1.0)
    with torch.no_grad():
        fused = zm.model(**kw)[0]
    cases = {
        "dbcache_never": ([passes.DBCache(Fn_compute_blocks=1, residual_diff_threshold=0.0)], 1e-5),
        "offload": ([passes.LayerwiseOffload(onload_device="cpu", async_transfer=True)], 0.0),
        "fp8": ([passes.Fp8Linear()], 0.05),
        "int8": ([passes.Int8Linear()], 0.02),
        "svdq_dq_r16": ([passes.SVDQuantW4A4(rank=16, dynamic=True)], 0.05),
    }
    for name, (ps, bound) in cases.items():
        c = compile_dit(zm.model, passes=ps, keep_original=True)  # every case lowers the same model again
        with torch.no_grad():
            out = c(**kw)[0]
        assert len(c.structure.linears_with_role("lora")) == 0, name
        err = _rel(out, fused)
        assert err <= bound, (name, err)
        if name in ("fp8", "int8", "svdq_dq_r16"):
            res = c._current().manager.records[-1].result
            assert res.counts["replaced"] > 0 and err > 0, (name, res.counts, err)
