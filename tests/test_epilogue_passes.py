"""The EPILOGUES phase: ``SplitConcatLinear`` (a linear over a concatenation as one GEMM per part) and
``FuseLinearGelu`` (tanh-GELU in the GEMM's epilogue, ``dit_passes::linear_gelu``).

On CPU the op is the two ATen ops it replaces, so outputs equal the original (fp32, 1e-5 relative: the split
only reorders the K sum). Checked: what each pass rewrites on FLUX (every single-stream ``proj_out``, every
tanh-GELU MLP) and on other families; what it leaves, with the reason counted (exact GELU, no bias, a shared
output or concatenation, a concatenation not on the last dim, an unaligned slice); a concatenation the linear
reads through reshapes of the leading dims (split, each part reshaped; Wan2.2-TI2V's timestep embedding), one
that reshapes the last dim or has symbolic sizes (left, counted); that the quantizers take their linears first
whatever order the user lists the passes in; aot_eager and RegionalCompile; the weight held once (the slices are
views of the one attribute); under TensorParallel on two gloo ranks. On a GPU: the op against its ATen pair and
its cuBLASLt epilogue.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build

LINEAR_GELU = torch.ops.dit_passes.linear_gelu.default
aten = torch.ops.aten
TOL = 1e-5


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _counts(compiled, name):
    return next(r.result.counts for r in compiled._current().manager.records if r.name == name)


def _nodes(compiled, target):
    return [n for n in compiled.graph.nodes if n.op == "call_function" and n.target is target]


def _gelu_linears(graph):
    """tanh-GELUs reading a linear with a bias, in the plain captured graph."""
    return [n for n in graph.nodes if n.target is aten.gelu.default and n.kwargs.get("approximate") == "tanh"
            and n.args[0].target is aten.linear.default and len(n.args[0].args) > 2]


def _cat_linears(graph):
    """Linears over a concatenation along the last dim (HunyuanVideo's single blocks also concatenate tokens)."""
    return [n for n in graph.nodes if n.target is aten.linear.default and n.args[0].target is aten.cat.default
            and n.args[0].args[1] in (-1, n.args[0].meta["val"].dim() - 1)]


@pytest.mark.parametrize("family", ["flux", "sd3", "hunyuanvideo", "wan"])
def test_rewritten_model_equals_the_original(family):
    zm = build(family)
    kw = zm.make_inputs(batch=1, seed=1)
    plain = compile_dit(zm.model, passes=[], example_inputs=kw)
    c = compile_dit(zm.model, passes=[passes.SplitConcatLinear(), passes.FuseLinearGelu()], example_inputs=kw)
    with torch.no_grad():
        ref, out = zm.model(**kw)[0], c(**kw)[0]
    assert _rel(out, ref) <= TOL
    gelus, cats = _gelu_linears(plain.graph), _cat_linears(plain.graph)
    assert _counts(c, "fuse_linear_gelu")["fused"] == len(gelus) == len(_nodes(c, LINEAR_GELU))
    assert _counts(c, "split_concat_linear")["split"] == len(cats)
    assert not _cat_linears(c.graph) and not _gelu_linears(c.graph)
    if family == "flux":  # every MLP (double: image and text) and every single block's proj_out
        blocks, singles = len(zm.model.transformer_blocks), len(zm.model.single_transformer_blocks)
        assert len(gelus) == 2 * blocks + singles
        paths = {n.meta["dit_module_path"] for n in _nodes(c, aten.linear.default) if n.args[1].target is
                 aten.slice.Tensor}
        assert {f"single_transformer_blocks.{i}.proj_out" for i in range(singles)} <= paths


def test_slices_are_views_of_the_one_weight():
    """The split reads the weight's column slices in place: no new attribute, nothing copied."""
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    before = {k: v.data_ptr() for k, v in zm.model.named_parameters()}
    c = compile_dit(zm.model, passes=[passes.SplitConcatLinear()], example_inputs=kw)
    gm = c.graph_module
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert "single_transformer_blocks_0_proj_out_weight" in attrs or any("proj_out" in a for a in attrs)
    assert all(p.data_ptr() == before[k] for k, p in zm.model.named_parameters())
    assert c.runtime.weights.records == {}  # no weight replaced


class _Parts(nn.Module):
    """Linears over concatenations and GELUs the passes must leave, and one of each they take."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        mk = lambda n, k, bias=True: nn.Linear(k, n, bias=bias)  # noqa: E731
        self.exact, self.nobias, self.shared, self.ok = mk(16, 8), mk(16, 8, False), mk(16, 8), mk(16, 8)
        self.cat_ok, self.cat_shared, self.cat_rows, self.cat_odd = mk(8, 24), mk(8, 24), mk(8, 8), mk(8, 6)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, x, y, z):
        a = F.gelu(self.exact(x))                                   # exact GELU: left
        b = F.gelu(self.nobias(x), approximate="tanh")              # no bias: left
        s = self.shared(x)
        c = F.gelu(s, approximate="tanh") + s                       # the linear's output read twice: left
        d = F.gelu(self.ok(x), approximate="tanh")                  # fused
        xy = torch.cat([x, y], -1)
        e = self.cat_ok(torch.cat([x, y], -1))                      # split
        f = self.cat_shared(xy) + xy[..., :8].sum()                 # the concatenation read elsewhere: left
        h = self.cat_rows(torch.cat([x, x], 0))                     # rows, not columns: left
        i = self.cat_odd(torch.cat([z, 2 * z], -1))                # a slice starting 12 bytes in: left
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum() + h.sum() + i.sum()


def test_what_is_left_is_counted_and_the_output_unchanged():
    """Through the torch.compile backend (the module is no DiT: compile_dit would find no blocks), whose weights
    are graph inputs rather than attributes: the passes rewrite the same."""
    import dit_passes

    m = _Parts().eval()
    g = torch.Generator().manual_seed(1)
    x, y, z = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 3, generator=g)
    be = dit_passes.backend(passes=[passes.FuseLinearGelu(), passes.SplitConcatLinear()], compiler="eager")
    with torch.no_grad():
        assert _rel(torch.compile(m, backend=be, fullgraph=True)(x, y, z), m(x, y, z)) <= TOL
    counts = {r.name: r.result.counts for r in be.last_manager.records}
    assert counts["fuse_linear_gelu"] == {"fused": 1, "skipped_exact_gelu": 1, "skipped_no_bias": 1,
                                          "skipped_shared_output": 1}
    assert counts["split_concat_linear"] == {"split": 1, "parts": 2, "skipped_not_last_dim": 1,
                                             "skipped_shared_cat": 1, "skipped_unaligned": 1}


class _Reshaped(nn.Module):
    """Linears reading a concatenation through reshapes: of the leading dims only (split), of the last dim (left)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.rows, self.chain, self.merged = nn.Linear(24, 8), nn.Linear(24, 8), nn.Linear(5 * 16, 8)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, x, y):
        xy = torch.cat([x.transpose(0, 1), y.transpose(0, 1)], -1)  # [5, 2, 8 + 16]
        a = self.rows(xy.reshape(-1, 24))  # the leading dims merged (the parts can't be viewed so: copied): split
        b = self.chain(torch.cat([y, x], -1).flatten(0, 1).unsqueeze(0))  # a chain of them: split
        c = self.merged(torch.cat([x, x], -1).flatten(1))           # the last dim merged into [2, 80]: left
        return a.sum() + b.sum() + c.sum()


def test_through_reshapes_of_the_leading_dims():
    """Each part gets the reshape of the leading dims before its partial linear; a reshape that changes the last
    dim (the concatenated one) is left, counted."""
    import dit_passes

    m = _Reshaped().eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 16, generator=g)
    be = dit_passes.backend(passes=[passes.SplitConcatLinear()], compiler="eager")
    with torch.no_grad():
        assert _rel(torch.compile(m, backend=be, fullgraph=True)(x, y), m(x, y)) <= TOL
    counts = {r.name: r.result.counts for r in be.last_manager.records}["split_concat_linear"]
    assert counts == {"split": 2, "parts": 4, "skipped_view_last_dim": 1}
    gm = be.graphs[-1]
    assert sum(n.target is aten.cat.default for n in gm.graph.nodes) == 1  # the merged one's, left
    reshaped = [n for n in gm.graph.nodes if n.target is aten.linear.default and n.args[0].target is
                aten.reshape.default]
    assert sorted(tuple(n.args[0].args[1]) for n in reshaped) == [(1, 10, 8), (1, 10, 16), (10, 8), (10, 16)]


def test_symbolic_shapes_are_left():
    """Shapes from a symbolic trace (every size a symbol): a reshape chain is left as symbolic_view, a direct
    concatenation as symbolic_width; the graph is unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dit_passes.infra.pass_base import PassContext

    def f(x, y, w1, w2, w3):
        a = F.linear(torch.cat([x, y], -1).reshape(-1, 24), w1)
        b = F.linear(torch.cat([y, x], -1).flatten(0, 1).unsqueeze(0), w2)
        return a.sum() + b.sum() + F.linear(torch.cat([x, y], -1), w3).sum()

    args = (torch.randn(2, 5, 8), torch.randn(2, 5, 16), *(torch.randn(8, 24) for _ in range(3)))
    gm = make_fx(f, tracing_mode="symbolic", pre_dispatch=True)(*args)
    before = str(gm.graph)
    result = passes.SplitConcatLinear().run(gm, PassContext())
    assert not result.changed and str(gm.graph) == before
    assert result.counts == {"split": 0, "parts": 0, "skipped_symbolic_view": 2, "skipped_symbolic_width": 1}


def test_wan_ti2v_timestep_linear_is_split():
    """Wan2.2-TI2V (expand_timesteps) concatenates [cos, sin] per token and reaches time_embedder.linear_1 through
    a view: the linear now reads the parts in place."""
    zm = build("wan[ti2v]")
    kw = zm.make_inputs(batch=1, seed=1)
    c = compile_dit(zm.model, passes=[passes.SplitConcatLinear()], example_inputs=kw)
    with torch.no_grad():
        assert _rel(c(**kw)[0], zm.model(**kw)[0]) <= TOL
    assert _counts(c, "split_concat_linear")["split"] >= 1
    paths = {n.meta["dit_module_path"] for n in _nodes(c, aten.linear.default) if n.args[1].target is
             aten.slice.Tensor}
    assert "condition_embedder.time_embedder.linear_1" in paths
    assert not [n for n in _nodes(c, aten.linear.default) if n.args[0].target is aten.view.default
                and n.args[0].args[0].target is aten.cat.default]


def test_quantizers_take_the_linears_first():
    """Listed before Fp8Linear, the epilogue passes still run after it (phase EPILOGUES > QUANTIZE): they find
    no block linear left to rewrite (the timestep embedding's, over a [sin, cos] concatenation, is split) and the
    output is Fp8Linear's alone."""
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    both = compile_dit(zm.model, passes=[passes.FuseLinearGelu(), passes.SplitConcatLinear(),
                                         passes.Fp8Linear(exclude=())], example_inputs=kw, keep_original=True)
    names = [r.name for r in both._current().manager.records]
    assert names.index("fuse_linear_gelu") > names.index("fp8_linear")
    assert names.index("split_concat_linear") > names.index("fp8_linear")
    blocks = [n for n in _nodes(both, aten.linear.default) if "blocks." in n.meta.get("dit_module_path", "")]
    assert not _nodes(both, LINEAR_GELU) and not blocks
    alone = compile_dit(zm.model, passes=[passes.Fp8Linear(exclude=())], example_inputs=kw, keep_original=True)
    with torch.no_grad():
        assert _rel(both(**kw)[0], alone(**kw)[0]) <= TOL


@pytest.mark.parametrize("compile_kwargs", [{"backend": "aot_eager"}, {"regional": True, "backend": "aot_eager"}])
def test_compiles(compile_kwargs):
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    c = compile_dit(zm.model, passes=[passes.SplitConcatLinear(), passes.FuseLinearGelu()], example_inputs=kw,
                    torch_compile={**compile_kwargs, "fullgraph": True})
    with torch.no_grad():
        assert _rel(c(**kw)[0], zm.model(**kw)[0]) <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (cuBLASLt's GELU epilogue)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_op_equals_its_aten_pair(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 333, 256, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(1024, 256, device="cuda", dtype=dtype, generator=g) * 256 ** -0.5
    b = torch.randn(1024, device="cuda", dtype=dtype, generator=g)
    out = LINEAR_GELU(x, w, b)
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")
    pair = F.gelu(F.linear(x, w, b), approximate="tanh")
    assert out.shape == pair.shape and out.dtype == dtype
    # bf16: GELU on the fp32 accumulator, rounded once, at least as close to float64 as the pair rounded twice;
    # fp32: the epilogue's tanh is an approximation (H100: 1.8e-6 relative against the pair's 2.2e-7)
    assert _rel(out, ref) <= max(1.05 * _rel(pair, ref), 1e-5 if dtype == torch.float32 else 0.0)
    compiled = torch.compile(lambda t: LINEAR_GELU(t, w, b), fullgraph=True)
    assert torch.equal(compiled(x), out)


def _tp_epilogues(rank, world):
    """On each gloo rank: tiny FLUX under TensorParallel(world) with the epilogue passes, against the unsharded model
    (row-parallel proj_out now reads this rank's attention heads and MLP columns in place)."""
    from dit_passes.passes.tensor_parallel import TensorParallel

    torch.manual_seed(0)
    zm = build("flux")
    kw = zm.make_inputs(batch=2)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        c = compile_dit(zm.model, passes=[TensorParallel(size=world), passes.SplitConcatLinear(),
                                          passes.FuseLinearGelu()], keep_original=True)
        out = c(**kw)[0]
    counts = {r.name: r.result.counts for r in c._current().manager.records}
    return {"err": _rel(out, ref), "split": counts["split_concat_linear"]["split"],
            "fused": counts["fuse_linear_gelu"]["fused"], "singles": len(zm.model.single_transformer_blocks)}


def test_with_tensor_parallel_on_two_ranks():
    from dit_passes.testing.multiproc import run_ranks

    for r in run_ranks(_tp_epilogues, 2, timeout=300):
        assert r["err"] <= TOL, r
        assert r["split"] >= r["singles"] and r["fused"] > 0, r


def test_epilogue_passes_say_when_they_rewrote_nothing():
    """A module without a tanh-GELU linear or a linear over a concatenation: both passes warn, naming what they
    looked for."""
    import warnings as _w

    import dit_passes

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    be = dit_passes.backend(passes=[passes.SplitConcatLinear(), passes.FuseLinearGelu()], compiler="eager")
    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        torch.compile(m, backend=be, fullgraph=True)(torch.randn(2, 4))
    said = [str(w.message) for w in caught]
    assert any("split_concat_linear rewrote nothing: no linear over a concatenation" in s for s in said), said
    assert any("fuse_linear_gelu rewrote nothing: no linear followed by tanh-GELU" in s for s in said), said
