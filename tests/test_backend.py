"""dit_passes as a torch.compile backend: the same structure and outputs as compile_dit, and for every pass it
runs (the caches, the fusions, the attention backend, analysis) the same outputs and decisions over a denoising
loop, its state kept between calls in the backend's runtime; the passes it cannot run refused when it is built;
the Inductor post-grad pass object's cache key (uuid)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import copy
import warnings

import dit_passes
from dit_passes import InductorPostGradPass, compile_dit, passes
from dit_passes.infra.pass_base import Pass, PassError, PassResult
from dit_passes.infra.phases import Phase
from dit_passes.models.zoo import build
from dit_passes.passes import Cleanup

torch.set_num_threads(1)  # CI: 2 xdist workers share 2 cores


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _shape(s):
    return ([(bl.name, bl.count) for bl in s.block_lists], s.num_streams,
            sorted(Counter(a.block for a in s.attention).items(), key=str),
            sorted({(a.num_heads, a.head_dim) for a in s.attention}),
            Counter(lin.role for lin in s.linears if lin.block is not None))


class CountNodes(Pass):
    name = "count_nodes"
    phase = Phase.ANALYSIS
    reads = ("structure",)

    def run(self, gm, ctx):
        return PassResult(False, {"nodes": len(gm.graph.nodes)}, f"frontend={ctx.frontend}")


@pytest.mark.parametrize("family", ["flux", "hunyuanvideo", "wan"])
def test_backend_same_structure_and_outputs(family):
    zm = build(family)
    inputs = zm.make_inputs()
    be = dit_passes.backend(passes=[CountNodes()], compiler="eager")
    compiled = torch.compile(zm.model, backend=be)
    with torch.no_grad():
        ref = zm.model(**inputs)[0]
        out = compiled(**inputs)[0]
    assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item()}"
    assert len(be.graphs) == 1  # no graph break on these models
    exported = compile_dit(zm.model, example_inputs=inputs).structure
    assert _shape(be.structure) == _shape(exported)
    assert [(bl.name, bl.count) for bl in be.structure.block_lists] == list(zm.expected["block_lists"].items())
    explained = [r.description for r in be.last_manager.records]
    assert explained == ["cleanup()", "count_nodes()"]
    assert be.last_manager.records[1].result.report == "frontend=dynamo"


def test_backend_rejects_bad_arguments():
    with pytest.raises(ValueError, match="compiler must be one of"):
        dit_passes.backend(compiler="tvm")
    with pytest.raises(TypeError, match="Pass instances"):
        dit_passes.backend(passes=[object()])
    with pytest.raises(RuntimeError, match="compiled no graph yet"):
        dit_passes.backend(compiler="eager").structure
    with pytest.raises(RuntimeError, match="this backend has no residual cache"):
        dit_passes.backend(compiler="eager").cache_summary()


def test_post_grad_pass_uuid_is_stable():
    a = InductorPostGradPass([Cleanup()]).uuid()
    assert a == InductorPostGradPass([Cleanup()]).uuid()  # same passes, a new object: same key
    assert a != InductorPostGradPass([]).uuid()
    assert a != InductorPostGradPass([Cleanup(), CountNodes()]).uuid()
    assert InductorPostGradPass([Cleanup(), CountNodes()]).uuid() != InductorPostGradPass([CountNodes(), Cleanup()]).uuid()
    assert isinstance(a, str) and len(a) == 64


class _TinyBlock(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


class _TinyDiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_TinyBlock(), _TinyBlock()])

    def forward(self, hidden_states):
        for blk in self.blocks:
            hidden_states = blk(hidden_states)
        return hidden_states


@pytest.mark.inductor
def test_inductor_backend_tiny_model():
    torch.manual_seed(0)
    model = _TinyDiT().eval()
    x = torch.randn(1, 4, 8)
    be = dit_passes.backend(compiler="inductor")
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend=be)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert [(bl.name, bl.count) for bl in be.structure.block_lists] == [("blocks", 2)]


# -- every pass that keeps the weights, through torch.compile, against compile_dit --------------------------------

STEPS = 8
# name -> (passes, the report whose per-call decisions are compared; None: a rewrite without state)
CASES = {
    "dbcache": (lambda: [passes.DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.5,
                                        max_warmup_steps=2)], "dbcache"),
    "dbprune": (lambda: [passes.DBPrune(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.1,
                                        max_warmup_steps=2)], "dbprune"),
    "first_block_cache": (lambda: [passes.FirstBlockCache(threshold=0.42)], "first_block_cache"),
    "mag_cache": (lambda: [passes.MagCache(threshold=0.3, num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS)],
                  "mag_cache"),
    "taylorseer": (lambda: [passes.TaylorSeerCache(cache_interval=2, disable_cache_before_step=2,
                                                   taylor_factors_dtype=torch.float32)], "taylorseer_cache"),
    "sea_cache": (lambda: [passes.SeaCache(threshold=0.3, num_inference_steps=STEPS)], "sea_cache"),
    "tea_cache": (lambda: [passes.TeaCache(threshold=0.3, num_inference_steps=STEPS)], "tea_cache"),
    "pab": (lambda: [passes.PyramidAttentionBroadcast(spatial_attention_block_skip_range=2)], "pab"),
    "faster_cache": (lambda: [passes.FasterCache(spatial_attention_block_skip_range=2, is_guidance_distilled=True,
                                                 attention_weight=0.3)], "faster_cache"),
    # the fusions, the attention kernel and an analysis pass, in one graph (each counted below)
    "fusions": (lambda: [passes.FuseNormRope(), passes.FuseNormModulate(), passes.FuseLinearGelu(),
                         passes.SplitConcatLinear(), passes.AttentionBackend("math"), CountNodes()], None),
}


def denoise(model, handle, inputs, generations=2, steps=STEPS):
    """``generations`` loops of ``steps``: the timestep falls, the latents move with the output, each call in the
    "cond" cache context; ``handle`` (the CompiledDiT or the backend) starts each generation. Returns the stacked
    outputs."""
    outs = []
    for g in range(generations):
        handle.new_generation()
        lat = inputs["hidden_states"] + 0.3 * g
        for i in range(steps):
            kw = dict(inputs, hidden_states=lat, timestep=torch.full_like(inputs["timestep"], 1000.0 * (1 - i / steps)))
            with torch.no_grad(), handle.cache_context("cond"):
                o = model(**kw)[0]
            outs.append(o)
            lat = lat - 0.05 * o
    return torch.stack(outs)


def _decisions(handle, report):
    return [bool(c) for c in handle.report(report).last_generation()["step_cached"]]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _counts(manager):
    return {r.name: r.result.counts for r in manager.records if r.name != "cleanup"}


def _backend_vs_compile_dit(case, compiler):
    make, report = CASES[case]
    zm = build("flux")
    inputs = zm.make_inputs()
    reference = compile_dit(copy.deepcopy(zm.model), passes=make())
    ref = denoise(reference, reference, inputs)
    be = dit_passes.backend(passes=make(), compiler=compiler)
    out = denoise(torch.compile(zm.model, backend=be, fullgraph=True), be, inputs)
    assert _rel(out, ref) <= 1e-5, f"{case}: outputs differ from compile_dit's by {_rel(out, ref):.3g} relative"
    assert len(be.graphs) == 1  # one shape, no graph break: lowered once, its state kept between the calls
    assert _counts(be.last_manager) == _counts(reference._current().manager)
    if report is not None:
        ours = _decisions(be, report)
        assert ours == _decisions(reference, report)
        assert 0 < sum(ours) < STEPS, f"{case}: the config should cache some steps, not all: {ours}"
        assert be.cache_report() is reference.cache_report() is None or be.cache_summary() == reference.cache_summary()
    return be


@pytest.mark.parametrize("case", list(CASES))
def test_pass_under_torch_compile_equals_compile_dit(case):
    """The pass's graph takes its state as extra inputs / outputs; the backend feeds them from its runtime, so two
    generations of the loop give compile_dit's outputs (1e-5 relative, fp32) and its per-step decisions."""
    be = _backend_vs_compile_dit(case, "eager")
    if case == "fusions":
        counts = _counts(be.last_manager)
        assert all(counts[p][k] > 0 for p, k in [("fuse_norm_rope", "fused"), ("fuse_norm_modulate", "fused"),
                                                 ("fuse_linear_gelu", "fused"), ("split_concat_linear", "split"),
                                                 ("attention_backend", "attention_rewritten")]), counts
        assert be.last_manager.records[-1].result.report == "frontend=dynamo"


def test_dbcache_under_aot_eager():
    """Through AOTAutograd (``compiler="aot_eager"``, the path Inductor takes): the cond and the state inputs trace."""
    _backend_vs_compile_dit("dbcache", "aot_eager")


def test_second_resolution_keeps_each_shapes_state():
    """Two resolutions alternating, as compile_dit's one graph per signature: Dynamo recompiles at the second shape
    (from then on one graph with symbolic sizes), the backend lowers it per concrete shape, and a shape seen before
    continues its own cache state (a fresh state there would compute steps compile_dit caches). One block of each
    stream (Fn_compute_blocks=1: the second is the cached range): the states are per shape, whatever the depth."""
    zm = build("flux", num_layers=1, num_single_layers=1)
    a, b = zm.make_inputs(), zm.make_inputs(variant="alt_resolution")
    assert a["hidden_states"].shape != b["hidden_states"].shape
    make = lambda: [passes.DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.35,  # noqa: E731
                                   max_warmup_steps=1)]

    def alternate(model):
        outs, lats = [], [a["hidden_states"], b["hidden_states"]]
        for i in range(4):
            for j, inputs in enumerate((a, b)):
                t = torch.full_like(inputs["timestep"], 1000.0 * (1 - i / 4))
                with torch.no_grad():
                    o = model(**dict(inputs, hidden_states=lats[j], timestep=t))[0]
                outs.append(o.flatten())
                lats[j] = lats[j] - 0.05 * o
        return torch.cat(outs)

    reference = compile_dit(copy.deepcopy(zm.model), passes=make())
    ref = alternate(reference)
    be = dit_passes.backend(passes=make(), compiler="eager")
    out = alternate(torch.compile(zm.model, backend=be))
    assert _rel(out, ref) <= 1e-5
    assert be.cache_summary(as_dict=True) == reference.cache_summary(as_dict=True)
    assert any(be.report("dbcache").last_generation()["step_cached"])  # the state carried: some steps cached
    # a at its static graph, b (and a again) at the symbolic one Dynamo recompiles to: more lowerings than shapes,
    # one cache state per shape (the summaries, equal, name g0 and g1 only)
    assert len(be.graphs) >= 3


REFUSED = {
    "int8": (lambda: passes.Int8Linear(), "replaces weights by quantized ones"),
    "fuse_sibling_linears": (lambda: passes.FuseSiblingLinears(), "concatenates weights"),
    "offload": (lambda: passes.LayerwiseOffload(), "moves weights off the device"),
    "regional_compile": (lambda: passes.RegionalCompile(backend="eager"), "compiler='inductor'"),
    "ulysses": (lambda: passes.Ulysses(size=2), "shards the step over ranks"),
    "tensor_parallel": (lambda: passes.TensorParallel(size=2), "shards the step over ranks"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_at_construction(case):
    make, why = REFUSED[case]
    p = make()
    with pytest.raises(ValueError, match="dit_passes.backend cannot run") as err:
        dit_passes.backend(passes=[passes.DBCache(), p], compiler="eager")
    assert p.describe() in str(err.value) and why in str(err.value) and "compile_dit" in str(err.value)
    assert "dbcache(" not in str(err.value)  # the pass it can run is not named


class _Blocks(torch.nn.Module):
    """Four tiny attention blocks; ``graph_break`` breaks Dynamo's graph after the second."""

    def __init__(self, graph_break=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_TinyBlock() for _ in range(4)])
        self.graph_break = graph_break

    def forward(self, hidden_states, timestep):
        hidden_states = hidden_states + 0.01 * timestep.view(-1, 1, 1)  # a DiT's time embedding, reduced
        for i, blk in enumerate(self.blocks):
            hidden_states = blk(hidden_states)
            if self.graph_break and i == 1:
                torch._dynamo.graph_break()
        return hidden_states


class _Wrapped(torch.nn.Module):
    """A forward behind a ``*args`` wrapper (as diffusers' LoRA-scale decorator is)."""

    def __init__(self):
        super().__init__()
        self.inner = _Blocks()
        self.blocks = self.inner.blocks

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_graph_break_and_positional_arguments_are_named():
    """A graph break hands the passes a part of the model: the error says so and how to find the break. Positional
    arguments through a ``*args`` wrapper have no name (the passes find the timestep by name): a warning says to call
    with keywords; keywords through it keep their names."""
    x, t = torch.randn(1, 4, 8), torch.ones(1)
    cache = lambda: [passes.DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0)]  # noqa: E731
    with pytest.raises(PassError, match=r"graph break .*fullgraph=True"), torch.no_grad():
        torch.compile(_Blocks(graph_break=True), backend=dit_passes.backend(passes=cache(), compiler="eager"))(x, t)
    torch._dynamo.reset()
    be = dit_passes.backend(passes=cache(), compiler="eager")
    with pytest.warns(UserWarning, match="keyword arguments"), torch.no_grad():
        torch.compile(_Wrapped(), backend=be)(x, t)
    torch._dynamo.reset()
    be = dit_passes.backend(passes=cache(), compiler="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch.compile(_Wrapped(), backend=be)(hidden_states=x, timestep=t)
    assert {"hidden_states", "timestep"} <= {n.target for n in be.graphs[-1].graph.find_nodes(op="placeholder")}
