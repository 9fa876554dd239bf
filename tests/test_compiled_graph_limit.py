"""A CompiledDiT under mixed traffic: at most ``max_graphs`` lowered graphs (least recently called evicted, with
the cache state kept for them), evictions counted and warned about, and one caller at a time.

References: the eager transformer (``passes=[]`` computes the same ATen ops in the same order: bitwise equal), and
for the residual cache the same pass list on a module without a limit, fed the same requests.
"""
from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch

from dit_passes import compile_dit, passes

diffusers = pytest.importorskip("diffusers")
from diffusers import FluxTransformer2DModel  # noqa: E402

TEXT_DIM, POOLED_DIM, IN_CH = 32, 24, 16
# (batch, image tokens, text tokens): three signatures
A, B, C = (1, 16, 8), (1, 36, 8), (2, 16, 8)


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=IN_CH, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()


def flux_call(shape, seed: int = 0) -> dict:
    batch, tokens, text = shape
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, tokens, IN_CH, generator=g),
                encoder_hidden_states=torch.randn(batch, text, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(batch, POOLED_DIM, generator=g),
                timestep=torch.rand(batch, generator=g), img_ids=torch.randn(tokens, 3, generator=g),
                txt_ids=torch.zeros(text, 3), guidance=torch.full((batch,), 3.5), return_dict=False)


def test_lru_eviction_outputs_counts_and_warning():
    model = tiny_flux()
    c = compile_dit(model, passes=[], max_graphs=2)
    # A is called again before C arrives: the least recently called is then B, which C evicts
    calls = [A, B, A, C, A, B, C]
    lowered_after, names = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, shape in enumerate(calls):
            kw = flux_call(shape, seed=i)
            with torch.no_grad():
                ref, out = model(**kw)[0], c(**kw)[0]
            assert torch.equal(out, ref), f"call {i} {shape}: max diff {(out - ref).abs().max()}"
            assert len(c.graphs) <= 2
            lowered_after.append(c.graph_stats.lowered)
            names.append(sorted(c.graphs.keys()))
            if i == len(calls) - 2:  # 2 of the last 4 lowerings evicted: not more than the limit yet
                assert not [w for w in caught if "keep evicting" in str(w.message)]
    # A, B lowered; A called; C evicts B (the least recently called); A called; B evicts C; C evicts A
    assert lowered_after == [1, 2, 2, 3, 3, 4, 5]
    stats = c.graph_stats
    assert (stats.lowered, stats.evicted, stats.graphs, stats.limit) == (5, 3, 2, 2)
    # ids are never reused: the re-lowered B is g3, not a name a live graph had
    assert names == [["g0"], ["g0", "g1"], ["g0", "g1"], ["g0", "g2"], ["g0", "g2"], ["g0", "g3"], ["g3", "g4"]]
    warned = [w for w in caught if "keep evicting" in str(w.message)]
    assert len(warned) == 1 and issubclass(warned[0].category, RuntimeWarning)
    assert "max_graphs=2" in str(warned[0].message) and "raise max_graphs" in str(warned[0].message)
    assert "2 graph(s) kept (limit 2); 5 lowered, 3 evicted" in c.explain(print_output=False)
    # lowering the limit evicts at once; a bad limit is refused
    c.max_graphs = 1
    assert list(c.graphs.keys()) == ["g4"] and c.graph_stats.evicted == 4
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        compile_dit(model, max_graphs=0)


def test_evicted_cache_state_goes_and_a_relowered_signature_matches():
    """DBCache keeps its buffers per graph id: a bounded module must drop an evicted graph's buffers and never give
    a new graph an id (and so buffers) of a live one. Requests A, B, C, A, each a new generation of 5 steps; the
    bounded module (limit 2) evicts A and lowers it again, and must answer as a module that kept every graph."""
    model = tiny_flux()
    cfg = dict(Fn_compute_blocks=1, residual_diff_threshold=0.45, max_warmup_steps=2)
    bounded = compile_dit(model, passes=[passes.DBCache(**cfg)], max_graphs=2)
    unbounded = compile_dit(model, passes=[passes.DBCache(**cfg)], max_graphs=None)

    def request(module, shape, seed):
        module.new_generation()
        kw = flux_call(shape, seed)
        outs, lat = [], kw["hidden_states"]
        for i in range(5):
            step = dict(kw, hidden_states=lat, timestep=torch.full_like(kw["timestep"], 1.0 - i / 5))
            with torch.no_grad():
                o = module(**step)[0]
            outs.append(o)
            lat = lat - 0.05 * o
        return torch.stack(outs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for seed, shape in enumerate([A, B, C, A]):
            got, want = request(bounded, shape, seed), request(unbounded, shape, seed)
            assert torch.equal(got, want), f"request {seed} {shape}: max diff {(got - want).abs().max()}"
            store = bounded.runtime.state["dbcache"]
            live = sorted(int(n[1:]) for n in bounded.graphs.keys())
            assert sorted(store._programs) == live and {g for g, _ in store._slots} <= set(live)
            if seed == 0:
                first_graph = weakref.ref(bounded.graphs["g0"])
    gc.collect()
    assert first_graph() is None, "the evicted graph is still referenced"
    assert (bounded.graph_stats.lowered, bounded.graph_stats.evicted) == (4, 2)
    assert unbounded.graph_stats.evicted == 0 and len(unbounded.graphs) == 3
    cached = sum(len(c["cached_steps"]) for g in bounded.cache_summary(as_dict=True) for c in g["contexts"].values())
    assert cached > 0, "the cache never hit: the state would not matter"


class _Blocker:
    """A runtime state entry whose ``after_call`` (run inside forward, after the graph) holds the first call until
    released, so a second thread enters while it runs."""

    def __init__(self) -> None:
        self.entered, self.release, self.armed = threading.Event(), threading.Event(), True

    def after_call(self) -> bool:
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(30), "never released"
        return False


def test_second_thread_gets_a_clear_error_and_the_first_its_output():
    model = tiny_flux()
    c = compile_dit(model, passes=[])
    kw = flux_call(A)
    with torch.no_grad():
        ref = model(**kw)[0]
    blocker = c.runtime.state["blocker"] = _Blocker()
    result = {}

    def first():
        with torch.no_grad():
            result["out"] = c(**kw)[0]

    t = threading.Thread(target=first)
    t.start()
    try:
        assert blocker.entered.wait(60), "the first call never reached its end"
        with pytest.raises(RuntimeError, match="running a call in another thread") as err:
            with torch.no_grad():
                c(**kw)
        assert "its own module" in str(err.value) and "lock" in str(err.value)
        with pytest.raises(RuntimeError, match="running a call in another thread"):
            c.lower(**kw)
        with pytest.raises(RuntimeError, match="running a call in another thread"):
            with c.cache_context("uncond"):
                pass
        with pytest.raises(RuntimeError, match="running a call in another thread"):
            c.new_generation()
        assert c.runtime.context == "default"  # the refused block did not switch the running call's context
    finally:
        blocker.release.set()
        t.join(60)
    assert torch.equal(result["out"], ref)
    with torch.no_grad():
        again = c(**kw)[0]  # the lock is free again
    assert torch.equal(again, ref) and c.runtime.calls == 2 and c.graph_stats.lowered == 1
    with c.cache_context("uncond"), torch.no_grad():  # the same thread re-enters from its own cache_context block
        assert torch.equal(c(**kw)[0], ref) and c.runtime.context == "uncond"


def test_evicted_graph_takes_its_compiled_templates_along():
    """RegionalCompile's templates are shared by a module's graphs and keyed by block shapes: a template no kept
    graph calls goes with the graph evicted, so the compiled code stays bounded too."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dit_passes.models.zoo import build

    zm = build("flux")
    kw, kw2 = zm.make_inputs(), zm.make_inputs(variant="alt_resolution")
    with torch.no_grad():
        ref, ref2 = zm.model(**kw)[0], zm.model(**kw2)[0]
    cnt = CompileCounterWithBackend("eager")
    c = compile_dit(zm.model, passes=[passes.RegionalCompile(backend=cnt)], max_graphs=1)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], ref)
        table = c.runtime.state["regional_compile"]
        first = set(table)
        assert len(first) == 2 and cnt.frame_count == 2
        assert torch.equal(c(**kw2)[0], ref2)  # evicts the first graph: its two templates go
        assert set(table).isdisjoint(first) and len(table) == 2 and all(u == {1} for u in table.users.values())
    assert sorted(v[0] for v in table.values()) == [2, 3] and cnt.frame_count == 4  # ids are not reused
