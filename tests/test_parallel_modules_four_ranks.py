"""Parallel modules on 4 gloo ranks, in one spawn (process start-up on a 2-core machine dominates, so every case shares it).

- TE-P (T5) and CN-P (Flux ControlNet) at tp 4 (test_parallel_modules.py: tp 2), one all-reduce per
  row-parallel linear and ~1/4 of the linear bytes per rank; the video VAE (AutoencoderKLWan) decoding and
  encoding over all 4 ranks (test_vae_parallel.py: pairs).
- seed 002 "Hybrid TE-P + VAE-P + CN-P": ``ParallelismConfig(ulysses_size=4, tp_size=2,
  extra_parallel_modules=[te, vae, cn])`` scaled to ulysses 2 x tp 2, without the ControlNet (the tiny zoo has no
  ControlNet pipeline): ``enable_cache`` with DBCache gives the single process's images and cached steps, the text
  encoder runs tensor-parallel, the pipeline's own decode runs split over the 4 ranks.

fp32 everywhere, max relative error <= 1e-5 against the single process.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes.testing import run_ranks

TOL = 1e-5


def _wan_vae(world):
    from test_vae_parallel import _rel, _tiny_wan

    from dit_passes.passes.vae_parallel import parallel_vae
    vae = _tiny_wan()
    pv = parallel_vae(vae, world)
    z = torch.randn(1, 4, 2, 9, 8, generator=torch.Generator().manual_seed(3))  # 9 latent rows over 4 ranks
    x = torch.randn(1, 3, 5, 24, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.parameters
    return {"decode": _rel(pv.decode(z).sample, ref_d), "encode": _rel(pv.encode(x).latent_dist.parameters, ref_e),
            "report": pv.report()}


def _ranks(rank, world):
    from test_frontend_parallel import _case as _frontend_case
    from test_parallel_modules import _controlnet, _run, _text_encoder

    from dit_passes import passes
    out = {}
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    out["tp"] = {"t5": _run(_text_encoder("t5"), dict(input_ids=ids), [passes.TensorParallel(size=world)])}
    cn, kw = _controlnet(heads=4)
    out["tp"]["flux_controlnet"] = _run(cn, kw, [passes.TensorParallel(size=world)])
    out["wan_vae"] = _wan_vae(world)
    out["hybrid"] = _frontend_case(world, "ulysses_x_tp")
    return out


@pytest.fixture(scope="session")
def four():
    return run_ranks(_ranks, 4, timeout=540)


@pytest.mark.multiproc
def test_tep_cnp_tp4_and_wan_vae_four_ranks(four):
    for rank, res in enumerate(four):
        for name, r in res["tp"].items():
            where = f"rank {rank} {name}"
            assert r["err"] <= TOL, f"{where}: max relative error {r['err']:.2e}"
            tp = r["passes"]["tensor_parallel"]
            assert tp["all_reduce"] == tp["row_parallel"] >= 4, f"{where}: {tp}"
            assert r["comm"].get("all_reduce", 0) == tp["all_reduce"] + tp.get("norm_all_reduce", 0), f"{where}: {r}"
            # q/k/v, MLP and proj linears hold ~1/4 (row-parallel biases stay whole); modulation is replicated
            assert tp["qkv_mlp_proj_bytes_after"] < tp["qkv_mlp_proj_bytes_before"] / 4 * 1.1, f"{where}: {tp}"
        wan = res["wan_vae"]
        assert wan["decode"] <= TOL and wan["encode"] <= TOL, f"rank {rank} wan vae: {wan}"
        for rep in wan["report"].values():
            assert rep["world_size"] == 4 and len(rep["rows"]) == 4, rep
    assert four[0]["tp"]["flux_controlnet"]["n_out"] == 4


@pytest.mark.multiproc
def test_seed_hybrid_ulysses2_tp2_with_te_and_vae_parallel_four_ranks(four):
    for rank, res in enumerate(four):
        r = res["hybrid"]
        assert r["rel"] <= TOL, (rank, r)
        assert r["cached"] and r["cached"] == r["ref_cached"], (rank, r)
        assert r["te_rel"] <= TOL and "tensor_parallel" in r["te_passes"], (rank, r)
        assert {"ulysses", "tensor_parallel", "dbcache"} <= set(r["passes"]), (rank, r)
        assert r["vae_world"] == [4] and r["restored"], (rank, r)  # and disable_cache gave the modules back
