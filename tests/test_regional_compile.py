"""RegionalCompile on CPU with torch.compile's "eager" / "aot_eager" backends (never Inductor: too slow here).

What is checked: the outputs equal the uncompiled CompiledDiT's bit for bit (fp32); which blocks are outlined
and how many templates they share, exactly; that torch.compile runs once per template (a counting backend),
never per block, and never again on a second call, a second generation or after re-lowering; that it composes
with DBCache (blocks inside the torch.cond arms, same cached steps); and the errors for unsupported settings.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dit_passes
from dit_passes import compile_dit, passes
from dit_passes.infra.pass_base import PassContext, PassError
from dit_passes.models.zoo import build
from dit_passes.passes.regional_compile import CompiledRegion

torch.set_num_threads(1)  # CI: 2 xdist workers and the rank tests share 2 cores; a second thread only spins
LINEAR = torch.ops.aten.linear.default


def _run(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


def _counts(compiled):
    rec = [r for r in compiled._current().manager.records if r.name == "regional_compile"]
    assert len(rec) == 1 and compiled._current().manager.records[-1] is rec[0]  # it runs last
    return rec[0].result.counts


def _regions(gm):
    """{submodule name: CompiledRegion} of the region calls in one graph."""
    return {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), CompiledRegion)}


def _tids(gm):
    return {m.path: m.template_id for m in _regions(gm).values()}


def _block_linears(gm):
    return [n for n in gm.graph.nodes if n.target is LINEAR and "blocks." in n.meta.get("dit_module_path", "")]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flux_blocks_share_two_templates_and_compile_once(backend):
    # tiny Flux: 2 double + 2 single blocks. Every block is outlined; the double blocks share one template and the
    # single blocks another: single block 1's leading cat of block 0's two output slices folds to the joint tensor
    # (cats_folded=1), and single block 0's cat of the two double-stream outputs runs before its call, so both
    # single blocks take the same contiguous joint tensor.
    zm = build("flux")
    kw = zm.make_inputs()
    ref = _run(compile_dit(zm.model, passes=[], example_inputs=kw), kw)
    cnt = CompileCounterWithBackend(backend)
    c = compile_dit(zm.model, passes=[passes.RegionalCompile(backend=cnt)], example_inputs=kw)
    assert _counts(c) == {"regions": 4, "templates": 2, "templates_reused": 0, "graphs": 1, "cats_folded": 1}
    gm = c.graph_module
    assert _tids(gm) == {"transformer_blocks.0": 0, "transformer_blocks.1": 0,
                         "single_transformer_blocks.0": 1, "single_transformer_blocks.1": 1}
    assert not _block_linears(gm)  # no block op left in the top graph
    assert cnt.frame_count == 0  # compiled lazily, at the first call
    assert torch.equal(_run(c, kw), ref)
    assert cnt.frame_count == 2  # one compilation per template, not per block
    assert torch.equal(_run(c, kw), ref)
    assert cnt.frame_count == 2  # no recompilation on the second call
    assert [bl.count for bl in c.structure.block_lists] == [2, 2]  # discovery's structure is still reported


def test_second_signature_and_relowering():
    zm = build("flux")
    kw, kw2 = zm.make_inputs(), zm.make_inputs(variant="alt_resolution")
    ref, ref2 = _run(zm.model, kw), _run(zm.model, kw2)
    cnt = CompileCounterWithBackend("eager")
    rc = passes.RegionalCompile(backend=cnt)
    c = compile_dit(zm.model, passes=[rc])
    assert torch.equal(_run(c, kw), ref) and cnt.frame_count == 2
    # another image size: a new graph whose blocks have other shapes, so two new templates
    assert torch.equal(_run(c, kw2), ref2) and cnt.frame_count == 4
    assert _counts(c) == {"regions": 4, "templates": 2, "templates_reused": 0, "graphs": 1, "cats_folded": 1}
    assert torch.equal(_run(c, kw), ref) and torch.equal(_run(c, kw2), ref2) and cnt.frame_count == 4
    # lowering again (set_passes) reuses the compiled templates kept in runtime.state: nothing compiles
    c.set_passes([rc])
    assert torch.equal(_run(c, kw), ref) and cnt.frame_count == 4
    assert _counts(c)["templates_reused"] == 2
    assert len(c.runtime.state["regional_compile"]) == 4


@pytest.mark.parametrize("family, regions, templates", [
    ("wan", 2, 1),  # two identical WanTransformerBlocks
    ("sd3", 2, 2),  # SD3's last block is context_pre_only (no text-stream output): another program
])
def test_other_families(family, regions, templates):
    zm = build(family)
    kw = zm.make_inputs()
    ref = _run(compile_dit(zm.model, passes=[], example_inputs=kw), kw)
    cnt = CompileCounterWithBackend("aot_eager")
    c = compile_dit(zm.model, torch_compile={"regional": True, "backend": cnt}, example_inputs=kw)
    counts = _counts(c)
    assert (counts["regions"], counts["templates"], counts["graphs"]) == (regions, templates, 1)
    assert not _block_linears(c.graph_module)
    assert torch.equal(_run(c, kw), ref) and torch.equal(_run(c, kw), ref)
    assert cnt.frame_count == templates


class _FlexBlock(torch.nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return x + self.out(flex_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class _FlexModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_FlexBlock(), _FlexBlock()])

    def forward(self, hidden_states):
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return (hidden_states,)


def test_flex_attention_stays_eager_between_two_regions_per_block():
    # Dynamo cannot trace an exported flex_attention node again (it takes only the user-level call): each block
    # is outlined as the region before and the region after it, the two blocks sharing those two templates.
    torch.manual_seed(0)
    model = _FlexModel().eval()
    kw = {"hidden_states": torch.randn(1, 128, 32)}
    ref = _run(compile_dit(model, passes=[], example_inputs=kw), kw)
    cnt = CompileCounterWithBackend("aot_eager")
    c = compile_dit(model, passes=[passes.RegionalCompile(backend=cnt, min_nodes=1)], example_inputs=kw)
    assert _counts(c) == {"regions": 4, "templates": 2, "templates_reused": 0, "graphs": 1, "cats_folded": 0}
    flex = [n for n in c.graph_module.graph.nodes if n.target is torch.ops.higher_order.flex_attention]
    assert len(flex) == 2 and torch.equal(_run(c, kw), ref)
    assert cnt.frame_count == 2


def test_template_signature_code_is_the_template_modules_code():
    # a template's signature takes the code generated from its graph without building its GraphModule (built only
    # for a signature not seen yet, to compile it): that code must be the module's, or equal blocks would not share
    from dit_passes.passes.regional_compile import _regions as block_regions, _Template
    zm = build("flux")
    c = compile_dit(zm.model, passes=[], example_inputs=zm.make_inputs())
    lists = set(c.structure.candidates) | {bl.name for bl in c.structure.block_lists}
    templates = [_Template(nodes) for _, nodes in block_regions(c.graph_module.graph, lists)]
    assert len(templates) == 4
    codes = [t.code() for t in templates]
    assert codes == [t.gm.code for t in templates] and len(set(codes)) == 2  # double and single blocks


def _step_loop(model, kwargs, steps=8):
    outs, lat = [], kwargs["hidden_states"].clone()
    for i in range(steps):
        kw = dict(kwargs, hidden_states=lat, timestep=torch.full_like(kwargs["timestep"], 1000.0 * (1 - i / steps)))
        o = _run(model, kw)
        outs.append(o)
        lat = lat - 0.05 * o.reshape(lat.shape)
    return torch.stack(outs)


def test_composes_with_dbcache_blocks_inside_the_branch():
    # 3 double + 4 single blocks, Fn=1: block 0 stays in the top graph, blocks 1..6 move into the compute arm of
    # the torch.cond; the cached arm has no blocks. Still 2 templates, shared across the graphs (graphs: top +
    # both arms), and 2 compilations in all: without grad the template calls run below autograd as the arms do,
    # so the top graph's double block and the branch's double blocks pass Dynamo's dispatch-key guards alike.
    zm = build("flux", num_layers=3, num_single_layers=4)
    kw = zm.make_inputs()
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.45, max_warmup_steps=2)
    plain = compile_dit(zm.model, passes=[passes.DBCache(**cfg)])
    cnt = CompileCounterWithBackend("aot_eager")
    # listed first on purpose: the PassManager runs it after the cache pass
    c = compile_dit(zm.model, passes=[passes.RegionalCompile(backend=cnt), passes.DBCache(**cfg)])
    ref, out = _step_loop(plain, kw), _step_loop(c, kw)
    assert torch.equal(out, ref)
    assert _counts(c) == {"regions": 7, "templates": 2, "templates_reused": 0, "graphs": 3, "cats_folded": 3}
    gm = c.graph_module
    assert _tids(gm) == {"transformer_blocks.0": 0}
    assert _tids(gm.dbcache_compute) == {"transformer_blocks.1": 0, "transformer_blocks.2": 0,
                                         **{f"single_transformer_blocks.{i}": 1 for i in range(4)}}
    assert _tids(gm.dbcache_cached) == {}
    assert cnt.frame_count == 2
    cached = c.cache_summary(as_dict=True)[-1]["cached_steps"]
    assert cached == plain.cache_summary(as_dict=True)[-1]["cached_steps"] and len(cached) >= 3
    # a second generation: same outputs and decisions, nothing compiles again
    ref2, out2 = _step_loop(plain, kw), _step_loop(c, kw)
    assert torch.equal(out2, ref2) and torch.equal(out2, out)
    assert [g["cached_steps"] for g in c.cache_summary(as_dict=True)] == [cached, cached]
    assert cnt.frame_count == 2


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="reduce-overhead.*copy every block's weights"):
        passes.RegionalCompile(mode="reduce-overhead")
    with pytest.raises(ValueError, match="reduce-overhead"):
        passes.RegionalCompile(options={"triton.cudagraphs": True})
    with pytest.raises(ValueError, match="fullgraph=False is not supported"):
        passes.RegionalCompile(fullgraph=False)
    with pytest.raises(TypeError, match=r"\['modee'\] are not torch.compile keyword arguments"):
        passes.RegionalCompile(modee="max-autotune")
    zm = build("flux")
    # regional + "reduce-overhead": the blocks compile without the mode, the whole step becomes one CUDA graph
    # (tests/test_cuda_graph_step.py: refused on a CPU before capturing)
    graphed = compile_dit(zm.model, torch_compile={"regional": True, "mode": "reduce-overhead"})
    assert graphed._cuda_graphs and "mode" not in graphed._regional.compile_kwargs
    with pytest.raises(ValueError, match="would compile the whole graph on top of it"):
        compile_dit(zm.model, passes=[passes.RegionalCompile()], torch_compile={})
    with pytest.raises(ValueError, match="a compile-phase pass is in passes=\\[...\\] already: keep one"):
        compile_dit(zm.model, passes=[passes.RegionalCompile()], torch_compile={"regional": True})


@pytest.mark.parametrize("frontend", ["dynamo", "inductor"])
def test_graph_without_weight_attributes_is_refused(frontend):
    # under the torch.compile backend (dit_passes.backend) weights are graph inputs and the graph is compiled whole
    zm = build("flux")
    kw = zm.make_inputs()
    gm = compile_dit(zm.model, passes=[], example_inputs=kw).graph_module
    with pytest.raises(PassError, match=f"weights as attributes.*'{frontend}' front end.*compile_dit"):
        passes.RegionalCompile(backend="eager").run(gm, PassContext(frontend=frontend))
    assert not _regions(gm)  # refused before touching the graph


def test_torch_compile_backend_refuses_it():
    # refused where the backend is built, before Dynamo traces anything: its compiler= compiles the graph there
    with pytest.raises(ValueError, match="dit_passes.backend cannot run regional_compile.*compile_dit"):
        dit_passes.backend(passes=[passes.RegionalCompile()], compiler="eager")


def test_torch_compile_regional_entry_point():
    zm = build("flux")
    kw = zm.make_inputs()
    ref = _run(zm.model, kw)
    cnt = CompileCounterWithBackend("eager")
    c = compile_dit(zm.model, passes=[passes.DBCache(Fn_compute_blocks=1)],
                    torch_compile={"regional": True, "backend": cnt})
    assert torch.equal(_run(c, kw), ref)  # the first step is a warm-up step: computed
    assert c._current().runner is None  # no whole-graph torch.compile
    assert [p.name for p in c.passes] == ["dbcache"]  # the user's list is unchanged
    assert [r.name for r in c._current().manager.records] == ["cleanup", "dbcache", "regional_compile"]
    assert cnt.frame_count == 2
    # regional=False is the whole-graph compile, as without the key
    w = compile_dit(zm.model, torch_compile={"regional": False, "backend": "eager"})
    assert torch.equal(_run(w, kw), ref) and w._current().runner is not None


def test_inductor_pool_is_warmed_only_for_inductor_on_cuda(monkeypatch):
    # compile_dit starts Inductor's compile workers at a CUDA lowering that Inductor will compile (so that they start
    # while the capture and the passes run); never on the CPU, never for another backend
    import dit_passes.compiled as compiled_mod
    warmed = []
    monkeypatch.setattr(compiled_mod, "_warm_inductor_pool", lambda: warmed.append(1))
    zm = build("flux")
    inductor = [compile_dit(zm.model, torch_compile={"regional": True}),
                compile_dit(zm.model, torch_compile={"regional": True, "mode": "reduce-overhead"}),
                compile_dit(zm.model, torch_compile={"mode": "max-autotune-no-cudagraphs"}),
                compile_dit(zm.model, passes=[passes.RegionalCompile()])]
    other = [compile_dit(zm.model), compile_dit(zm.model, torch_compile={"regional": True, "backend": "eager"}),
             compile_dit(zm.model, torch_compile={"backend": "aot_eager"})]
    assert [c._compiles_with_inductor() for c in inductor + other] == [True] * 4 + [False] * 3
    c = compile_dit(zm.model, torch_compile={"regional": True, "backend": "eager"}, example_inputs=zm.make_inputs())
    c2 = compile_dit(zm.model, torch_compile={"regional": True}, example_inputs=zm.make_inputs())
    assert c._current() is not None and c2._current() is not None and not warmed  # CPU: left to Inductor
