"""LoRA with the passes. Unfused PEFT adapters (``transformer.add_adapter`` / ``load_lora_weights``) show up
as separate adapter projections beside each base linear: block discovery gives them the role "lora", the
context-parallel passes run them as they are (per token), tensor parallelism refuses them with the fix
(fuse first), and fused LoRA is plain weights that every pass takes.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.infra.pass_base import PassError
from dit_passes.models.zoo import build
from dit_passes.testing import run_ranks

peft = pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]


def _with_lora(seed=0):
    zm = build("flux")
    torch.manual_seed(seed)
    zm.model.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian"))
    return zm


def test_adapters_found_and_tensor_parallel_refuses_unfused():
    zm = _with_lora()
    kw = zm.make_inputs()
    compiled = compile_dit(zm.model, passes=[], example_inputs=kw)
    lora = compiled.structure.linears_with_role("lora")
    # A and B projections of every targeted linear inside the blocks
    assert len(lora) == 2 * sum(1 for n, m in zm.model.named_modules() if n.endswith("lora_A") and
                                 ("transformer_blocks" in n))
    assert all(".lora_" in s.module_path for s in lora)
    with torch.no_grad():
        assert torch.equal(compiled(**kw)[0], zm.model(**kw)[0])
    with pytest.raises(PassError, match=r"unfused LoRA adapter projection\(s\).*fuse_lora"):
        compile_dit(zm.model, passes=[passes.TensorParallel(size=2)], example_inputs=kw)


def _ranks(rank, world):
    out = {}
    zm = _with_lora()
    kw = zm.make_inputs(batch=1, seed=1)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        out["ulysses_unfused"] = (compile_dit(zm.model, passes=[passes.Ulysses(world)])(**kw)[0] - ref).abs().max() / ref.abs().max()
        zm.model.fuse_lora(lora_scale=1.0)
        fused_ref = zm.model(**kw)[0]
        out["fused_matches_unfused"] = ((fused_ref - ref).abs().max() / ref.abs().max()).item()
        tp = compile_dit(zm.model, passes=[passes.TensorParallel(world)])
        out["tp_fused"] = ((tp(**kw)[0] - fused_ref).abs().max() / fused_ref.abs().max()).item()
        out["tp_lora_sites"] = len(tp.structure.linears_with_role("lora"))
    out["ulysses_unfused"] = float(out["ulysses_unfused"])
    return out


@pytest.mark.multiproc
def test_unfused_lora_under_ulysses_and_fused_lora_under_tp_two_ranks():
    for rank, r in enumerate(run_ranks(_ranks, 2, timeout=180)):
        assert r["ulysses_unfused"] <= 1e-5, (rank, r)
        assert r["fused_matches_unfused"] <= 1e-5, (rank, r)  # fusing changes nothing numerically
        assert r["tp_fused"] <= 1e-5 and r["tp_lora_sites"] == 0, (rank, r)
