"""Context parallelism on the families test_context_parallel.py runs only on divisible
sequence lengths: HunyuanVideo (5-D latents, a text mask) with 25 image tokens + 7 text tokens, on 2 gloo
ranks, for Ulysses and Ring (Flux and Wan run odd lengths, and USP with 3 heads, in test_context_parallel.py).

Same checks as test_context_parallel.py: every rank's output equals the single-process output (fp32,
max relative <= 1e-5), all ranks agree, and the collectives that ran are exactly 4 all-to-alls per
distributed attention (Ulysses part), ring - 1 exchanges per attention (Ring part), one output gather.
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dit_passes.testing import run_ranks

TOL = 1e-5


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        for kind in ("all_to_all_single", "all_gather_into_tensor", "ring_exchange"):
            if kind in name:
                self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def _uneven_inputs(family, zm):
    """25 image tokens (5 x 5 patches) and 7 text tokens: divisible by neither 2 nor 4."""
    assert family == "hunyuanvideo", family
    kw = zm.make_inputs(batch=1, seed=1)
    kw["hidden_states"] = torch.randn(1, 4, 1, 10, 10, generator=torch.Generator().manual_seed(5))
    kw["encoder_attention_mask"] = kw["encoder_attention_mask"][:, :7]
    kw["encoder_hidden_states"] = kw["encoder_hidden_states"][:, :7].contiguous()
    return kw


def _case(family, kind, world, uneven=True, overrides=None):
    from dit_passes import compile_dit
    from dit_passes.models.zoo import build
    from dit_passes.passes.context_parallel import USP, Ring, Ulysses

    zm = build(family, **(overrides or {}))
    kw = _uneven_inputs(family, zm) if uneven else zm.make_inputs(batch=1, seed=1)
    p = {"ulysses": lambda: Ulysses(size=world), "ring": lambda: Ring(size=world),
         "usp": lambda: USP(ulysses=2, ring=world // 2)}[kind]()
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        compiled = compile_dit(zm.model, passes=[p])
        compiled.lower(**kw)
        counter = _Counter()
        with counter:
            out = compiled(**kw)[0]
    counts = dict(compiled._current().manager.records[-1].result.counts)
    outs = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(outs, out.contiguous())
    return {"err": ((out - ref).abs().max() / ref.abs().max()).item(), "shape": tuple(out.shape),
            "ref_shape": tuple(ref.shape), "agree": all(torch.equal(o, outs[0]) for o in outs),
            "counts": counts, "ran": dict(counter.counts)}


def _two(rank, world):
    return {("hunyuanvideo", k): _case("hunyuanvideo", k, world) for k in ("ulysses", "ring")}


def _check(results, world):
    for rank, cases in enumerate(results):
        for (family, kind), r in cases.items():
            where = f"rank {rank}/{world} {family} {kind}"
            assert r["err"] <= TOL, f"{where}: max relative error {r['err']:.2e}"
            assert r["agree"] and r["shape"] == r["ref_shape"], where
            n = r["counts"]["attention_replaced"]
            assert n >= 2, f"{where}: {r['counts']}"
            ulysses = {"ulysses": world, "ring": 1}.get(kind, 2)
            ring = world // ulysses
            want = {"all_to_all_single": 4 * n if ulysses > 1 else 0, "ring_exchange": (ring - 1) * n,
                    "all_gather_into_tensor": 1}
            got = {k: r["ran"].get(k, 0) for k in want}
            assert got == want, f"{where}: ran {r['ran']}, expected {want}"


@pytest.mark.multiproc
def test_uneven_hunyuan_two_ranks():
    _check(run_ranks(_two, 2, timeout=300), 2)
