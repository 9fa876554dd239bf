"""Async Ulysses (``Ulysses(size, async_qkv=True)``, ``USP(..., ulysses_async=True)``, front end
``ParallelismConfig(ulysses_async=True)``) on 2 gloo ranks (Ulysses, float8 Ulysses) and 4 (USP 2 x 2, plain and
float8 with the all-gather ring), one spawn each: bit-equal to the synchronous form of the same config (within 1e-5 of
one process; float8: within FP8_TOL, as synchronous float8); the same collectives, as many; in the graph, each
q / k / v all-to-all is issued before the next projection's linear and waited for after it.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit_passes.testing import run_ranks

TOL = 1e-5
FP8_TOL = 0.05  # as synchronous float8 Ulysses (tests/test_context_parallel.py): e4m3 keeps 3 mantissa bits
# Flux's joint attention runs in flux_odd_heads3 (the plain all-to-alls) and flux_fp8 (e4m3 all-to-alls); QwenImage's
# joint attention with a mask over the even tokens
CASES = {  # joint attention + a padded-prompt mask (batch 2); cross-attention (local); 3 heads (padded) + odd tokens
    "qwenimage": dict(family="qwenimage"),
    "wan": dict(family="wan"),
    # odd tokens, 3 heads over 2 ranks: cache-dit's ulysses_anything case (exact here with or without it)
    "flux_odd_heads3": dict(family="flux", batch=1, variant="odd_tokens", overrides={"num_attention_heads": 3},
                            anything=True),
    "flux_fp8": dict(family="flux", kind="ulysses_fp8"),
}
USP_CASES = {  # 4 ranks, ring of 2 Ulysses pairs: joint attention; a mask, 3 heads (padded), fp8, the all-gather ring
    "flux_usp": dict(family="flux", kind="usp", batch=1),
    "qwenimage_usp_fp8_allgather": dict(family="qwenimage", kind="usp_fp8_allgather",
                                        overrides={"num_attention_heads": 3}),
}


class _Collectives(TorchDispatchMode):
    """Which collectives run and how many (the functional ops, as dispatched)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        # every functional collective, not its wait nor eager funcol's wrapper (_wrap_tensor_autograd); the ring's
        # point-to-point exchange (one custom op)
        if ("_c10d_functional" in name and not any(k in name for k in ("wait_tensor", "_wrap_tensor_autograd"))
                or "ring_exchange" in name):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _is_linear(n) -> bool:
    return n.op == "call_function" and str(n.target) in ("aten.linear.default", "aten.addmm.default", "aten.mm.default")


def _projection(n):
    """The nearest linear ``n`` is computed from (breadth-first over inputs)."""
    todo, seen = [n], {n}
    while todo:
        m = todo.pop(0)
        if _is_linear(m):
            return m
        for a in m.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    raise AssertionError(f"no linear under {n}")


def _graph_order(gm):
    """For each async attention: (issue before the next linear, wait after it) for each consecutive pair of sends."""
    from dit_passes.parallel import sequence_ops as ops
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    checks = []
    received = {getattr(ops, k) for k in dir(ops) if k.endswith("_received_attention")}
    for r in gm.graph.nodes:
        if r.op != "call_function" or r.target not in received:
            continue
        # float8: each wait read by its decoding
        waits = [a.args[0] if a.target is ops.from_fp8_rows else a for a in r.args[:3]]
        assert all(str(w.target) == "_c10d_functional.wait_tensor.default" for w in waits), waits
        sends = sorted((w.args[0] for w in waits), key=pos.__getitem__)
        assert all(str(s.target) == "_c10d_functional.all_to_all_single.default" for s in sends), sends
        wait_of = {w.args[0]: w for w in waits}
        for send, nxt in zip(sends, sends[1:]):
            linear = _projection(nxt)
            checks.append((pos[send] < pos[linear], pos[wait_of[send]] > pos[linear]))
    return checks


def _configs(kind, world, anything=False):
    """(synchronous, async) ParallelismConfig kwargs of a kind: ulysses[_fp8] over the world, usp[_fp8][_allgather]
    a ring of 2 Ulysses groups."""
    usp = kind.startswith("usp")
    sizes = dict(ulysses_size=world // 2 if usp else world, ring_size=2 if usp else None,
                 ulysses_float8="fp8" in kind, ring_rotate_method="allgather" if "allgather" in kind else "p2p",
                 ulysses_anything=anything)
    return sizes, dict(sizes, ulysses_async=True)


def _case(world, family, kind="ulysses", batch=2, variant="default", overrides=None, anything=False):
    from dit_passes import ParallelismConfig, compile_dit
    from dit_passes.models.zoo import build
    from dit_passes.passes.context_parallel import describe_collectives

    zm = build(family, **(overrides or {}))
    inputs = zm.make_inputs(batch=batch, variant=variant, seed=1)
    out, runtime, counts, nodes, items = {}, {}, {}, {}, {}
    with torch.no_grad():
        reference = zm.model(**inputs)[0]
        for mode, config in zip(("sync", "async"), _configs(kind, world, anything)):
            passes = ParallelismConfig(**config).to_passes()
            compiled = compile_dit(zm.model, passes=passes)
            compiled.lower(**inputs)
            counter = _Collectives()
            with counter:
                out[mode] = compiled(**inputs)[0]
            runtime[mode] = dict(counter.counts)
            counts[mode] = dict(compiled._current().manager.records[-1].result.counts)
            nodes[mode] = describe_collectives(compiled.graph_module)
            items[mode] = [(type(p).__name__, p.config_items()) for p in passes]
            if mode == "async":
                order = _graph_order(compiled.graph_module)
                again = compiled(**inputs)[0]
    rel = {m: ((o - reference).abs().max() / reference.abs().max()).item() for m, o in out.items()}
    return dict(rel=rel, bit_equal=torch.equal(out["sync"], out["async"]), again_equal=torch.equal(again, out["async"]),
                runtime=runtime, counts=counts, nodes=nodes, order=order, items=items, kind=kind)


def _rank_fn(rank, world):
    return {name: _case(world, **kw) for name, kw in CASES.items()}


def _usp_rank_fn(rank, world):
    return {name: _case(world, **kw) for name, kw in USP_CASES.items()}


@pytest.fixture(scope="module", params=[2, 4], ids=["ulysses_2_ranks", "usp_4_ranks"])
def async_results(request):
    """Each rank's cases: Ulysses on 2 ranks, USP 2 x 2 on 4."""
    world = request.param
    return run_ranks(_rank_fn if world == 2 else _usp_rank_fn, world, timeout=400 if world == 2 else 500)


def _received_op(kind):
    usp, fp8, gathered = kind.startswith("usp"), "fp8" in kind, "allgather" in kind
    return f"{'usp' if usp else 'ulysses'}{'_fp8' if fp8 else ''}{'_allgather' if gathered else ''}_received_attention"


@pytest.mark.parity("ParallelismConfig", "ParallelismConfig.ulysses_size", "ParallelismConfig.ring_size",
                    "ParallelismConfig.ulysses_async", "ParallelismConfig.ulysses_float8",
                    "ParallelismConfig.ring_rotate_method", "ParallelismConfig.ulysses_anything")
def test_async_ulysses_equals_sync_and_single_process(async_results):
    for rank, cases in enumerate(async_results):
        for name, r in cases.items():
            where = f"rank {rank} {name}"
            (sync_pass, sync_items), (async_pass, async_items) = r["items"]["sync"][0], r["items"]["async"][0]
            # through ParallelismConfig: the synchronous pass with the async option on, nothing else changed
            assert async_pass == sync_pass == ("USP" if r["kind"].startswith("usp") else "Ulysses"), where
            option = "ulysses_async" if async_pass == "USP" else "async_qkv"
            assert async_items == dict(sync_items, **{option: True}) and not sync_items[option], where
            tol = FP8_TOL if "fp8" in r["kind"] else TOL
            assert r["rel"]["async"] <= tol and r["rel"]["sync"] <= tol, f"{where}: {r['rel']}"
            assert r["bit_equal"] and r["again_equal"], f"{where}: async differs from the synchronous form"


def test_async_ulysses_runs_the_same_collectives(async_results):
    for rank, cases in enumerate(async_results):
        for name, r in cases.items():
            where = f"rank {rank} {name}"
            sync, asy = r["counts"]["sync"], r["counts"]["async"]
            n = asy["attention_replaced"]
            assert n == sync["attention_replaced"] >= 2, where
            # every distributed attention overlapped (its chains moved), none left in the traced order
            assert asy["async_overlapped"] == n and asy["async_in_order"] == 0, f"{where}: {asy}"
            assert asy["all_to_all"] == sync["all_to_all"] == 4 * n, where
            assert r["nodes"]["async"].get(_received_op(r["kind"])) == n, f"{where}: {r['nodes']}"
            assert not any(k.endswith("_attention") and "received" not in k for k in r["nodes"]["async"]), where
            # exactly the synchronous collectives: 4 all-to-alls per attention, the same all-gathers (and exchanges)
            assert r["runtime"]["async"] == r["runtime"]["sync"], f"{where}: {r['runtime']}"
            a2a = r["runtime"]["async"]["_c10d_functional.all_to_all_single.default"]
            assert a2a == 4 * n, f"{where}: {r['runtime']}"
            exchanges = r["runtime"]["async"].get("dit_passes.ring_exchange.default", 0)
            ring = 2 if r["kind"].startswith("usp") and "allgather" not in r["kind"] else 1
            assert exchanges == (ring - 1) * n, f"{where}: {r['runtime']}"  # USP 2 x 2, p2p: one per attention


def test_async_ulysses_waits_after_the_next_projection(async_results):
    for rank, cases in enumerate(async_results):
        for name, r in cases.items():
            n = r["counts"]["async"]["attention_replaced"]
            assert len(r["order"]) == 2 * n, f"rank {rank} {name}: {r['order']}"  # v -> q, q -> k per attention
            assert all(issued and waited for issued, waited in r["order"]), f"rank {rank} {name}: {r['order']}"


def test_async_refusals_name_the_way_out():
    from dit_passes import ParallelismConfig
    from dit_passes.passes.context_parallel import USP, Ulysses
    for bad in (dict(ring_size=2), dict(ulysses_size=1, ring_size=2), dict()):  # no Ulysses all-to-all to overlap
        with pytest.raises(ValueError, match="ulysses_size > 1"):
            ParallelismConfig(ulysses_async=True, **bad).to_passes()
    (plain,) = ParallelismConfig(ulysses_size=2, ulysses_async=True).to_passes()
    assert plain.config_items() == {"size": 2, "float8": False, "async_qkv": True}
    assert Ulysses(2, float8=True, async_qkv=True).config_items() == {"size": 2, "float8": True, "async_qkv": True}
    assert USP(2, 2, ulysses_async=True).async_form().received_op.__name__ == "usp_received_attention"
    assert USP(2, 2, ulysses_async=True, ulysses_float8=True, ring_rotate_method="allgather").async_form(
    ).received_op.__name__ == "usp_fp8_allgather_received_attention"
    assert USP(2, 2).async_form() is None
