"""Async Ulysses (``Ulysses(size, async_qkv=True)``, front end ``ParallelismConfig(ulysses_async=True)``) on 2 gloo
ranks, one spawn: bit-equal to synchronous Ulysses and within 1e-5 of one process; the same collectives, as many;
in the graph, each q / k / v all-to-all is issued before the next projection's linear and waited for after it.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit_passes.testing import run_ranks

TOL = 1e-5
CASES = {  # joint attention; a padded-prompt mask (batch 2); cross-attention (local); 3 heads (padded) + odd tokens
    "flux": dict(family="flux"),
    "qwenimage": dict(family="qwenimage"),
    "wan": dict(family="wan"),
    "flux_odd_heads3": dict(family="flux", batch=1, variant="odd_tokens", overrides={"num_attention_heads": 3}),
}


class _Collectives(TorchDispatchMode):
    """Which collectives run and how many (the functional ops, as dispatched)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        # every functional collective; not its wait nor eager funcol's wrapper (_wrap_tensor_autograd)
        if "_c10d_functional" in name and not any(k in name for k in ("wait_tensor", "_wrap_tensor_autograd")):
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
    for r in gm.graph.nodes:
        if r.op != "call_function" or r.target is not ops.ulysses_received_attention:
            continue
        waits = list(r.args[:3])
        assert all(str(w.target) == "_c10d_functional.wait_tensor.default" for w in waits), waits
        sends = sorted((w.args[0] for w in waits), key=pos.__getitem__)
        assert all(str(s.target) == "_c10d_functional.all_to_all_single.default" for s in sends), sends
        wait_of = {w.args[0]: w for w in waits}
        for send, nxt in zip(sends, sends[1:]):
            linear = _projection(nxt)
            checks.append((pos[send] < pos[linear], pos[wait_of[send]] > pos[linear]))
    return checks


def _case(world, family, batch=2, variant="default", overrides=None):
    from dit_passes import ParallelismConfig, compile_dit
    from dit_passes.models.zoo import build
    from dit_passes.passes.context_parallel import Ulysses, describe_collectives

    zm = build(family, **(overrides or {}))
    inputs = zm.make_inputs(batch=batch, variant=variant, seed=1)
    out, runtime, counts, nodes = {}, {}, {}, {}
    with torch.no_grad():
        reference = zm.model(**inputs)[0]
        for mode, passes in (("sync", [Ulysses(size=world)]),
                             ("async", ParallelismConfig(ulysses_size=world, ulysses_async=True).to_passes())):
            compiled = compile_dit(zm.model, passes=passes)
            compiled.lower(**inputs)
            counter = _Collectives()
            with counter:
                out[mode] = compiled(**inputs)[0]
            runtime[mode] = dict(counter.counts)
            counts[mode] = dict(compiled._current().manager.records[-1].result.counts)
            nodes[mode] = describe_collectives(compiled.graph_module)
            if mode == "async":
                order = _graph_order(compiled.graph_module)
                again = compiled(**inputs)[0]
    rel = {m: ((o - reference).abs().max() / reference.abs().max()).item() for m, o in out.items()}
    return dict(rel=rel, bit_equal=torch.equal(out["sync"], out["async"]), again_equal=torch.equal(again, out["async"]),
                runtime=runtime, counts=counts, nodes=nodes, order=order, passes=[type(p).__name__ for p in passes],
                async_option=passes[0].config_items().get("async_qkv"))


def _rank_fn(rank, world):
    return {name: _case(world, **kw) for name, kw in CASES.items()}


@pytest.fixture(scope="module")
def async_ranks():
    return run_ranks(_rank_fn, 2, timeout=400)


def test_async_ulysses_equals_sync_and_single_process(async_ranks):
    for rank, cases in enumerate(async_ranks):
        assert set(cases) == set(CASES)
        for name, r in cases.items():
            where = f"rank {rank} {name}"
            assert r["passes"] == ["Ulysses"] and r["async_option"] is True, where  # through ParallelismConfig
            assert r["rel"]["async"] <= TOL and r["rel"]["sync"] <= TOL, f"{where}: {r['rel']}"
            assert r["bit_equal"] and r["again_equal"], f"{where}: async differs from sync Ulysses"


def test_async_ulysses_runs_the_same_collectives(async_ranks):
    for rank, cases in enumerate(async_ranks):
        for name, r in cases.items():
            where = f"rank {rank} {name}"
            sync, asy = r["counts"]["sync"], r["counts"]["async"]
            n = asy["attention_replaced"]
            assert n == sync["attention_replaced"] >= 2, where
            # every distributed attention overlapped (its chains moved), none left in the traced order
            assert asy["async_overlapped"] == n and asy["async_in_order"] == 0, f"{where}: {asy}"
            assert asy["all_to_all"] == sync["all_to_all"] == 4 * n, where
            assert r["nodes"]["async"].get("ulysses_received_attention") == n, f"{where}: {r['nodes']}"
            assert "ulysses_attention" not in r["nodes"]["async"], where
            # exactly the synchronous collectives: 4 all-to-alls per attention, the same all-gathers
            assert r["runtime"]["async"] == r["runtime"]["sync"], f"{where}: {r['runtime']}"
            a2a = r["runtime"]["async"]["_c10d_functional.all_to_all_single.default"]
            assert a2a == 4 * n, f"{where}: {r['runtime']}"


def test_async_ulysses_waits_after_the_next_projection(async_ranks):
    for rank, cases in enumerate(async_ranks):
        for name, r in cases.items():
            n = r["counts"]["async"]["attention_replaced"]
            assert len(r["order"]) == 2 * n, f"rank {rank} {name}: {r['order']}"  # v -> q, q -> k per attention
            assert all(issued and waited for issued, waited in r["order"]), f"rank {rank} {name}: {r['order']}"


def test_async_refusals_name_the_way_out():
    from dit_passes import ParallelismConfig
    from dit_passes.passes.context_parallel import Ulysses
    with pytest.raises(ValueError, match="float8=True, async_qkv=True"):
        Ulysses(2, float8=True, async_qkv=True)
    for bad in (dict(ulysses_size=2, ring_size=2), dict(ulysses_size=2, ulysses_float8=True), dict(ring_size=2)):
        with pytest.raises(NotImplementedError, match="Ulysses alone"):
            ParallelismConfig(ulysses_async=True, **bad).to_passes()
    (plain,) = ParallelismConfig(ulysses_size=2, ulysses_async=True).to_passes()
    assert plain.config_items() == {"size": 2, "float8": False, "async_qkv": True}
