"""dit_passes as a torch.compile backend: the same structure and outputs as compile_dit; the
Inductor post-grad pass object's cache key (uuid)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import dit_passes
from dit_passes import InductorPostGradPass, compile_dit
from dit_passes.infra.pass_base import Pass, PassResult
from dit_passes.infra.phases import Phase
from dit_passes.models.zoo import build
from dit_passes.passes import Cleanup


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
    with pytest.raises(ValueError, match="compiler must be 'inductor' or 'eager'"):
        dit_passes.backend(compiler="tvm")
    with pytest.raises(TypeError, match="Pass instances"):
        dit_passes.backend(passes=[object()])
    with pytest.raises(RuntimeError, match="compiled no graph yet"):
        dit_passes.backend(compiler="eager").structure


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
