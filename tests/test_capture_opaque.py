"""Capture of a model with a submodule torch.export cannot trace: HiDream-style mixture of experts that
routes tokens on the host (``bincount().cpu().numpy()``). The failing submodule's class becomes opaque calls
(``dit_passes::opaque_module``) run eagerly, the rest is exported; a patch grid kept in a tensor and used as
reshape sizes is specialised on its values. Checked: the graph against eager (exact), the caller's model untouched,
DBCache and RegionalCompile on such a graph, context parallelism planning to run the opaque op on the gathered
sequence, and the contract's refusals (an opaque module writing into its input)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dit_passes import compile_dit, get_structure
from dit_passes.capture import CaptureError, capture
from dit_passes.capture_opaque import failing_module, is_opaque_call
from dit_passes.parallel.sequence_sharding import SequenceShardSpec, analyze
from dit_passes.passes import DBCache, RegionalCompile


class HostRoutedMoE(torch.nn.Module):
    """Top-1 experts, token counts per expert read on the host (what HiDream's ``moe_infer`` does)."""

    def __init__(self, dim: int, experts: int = 2, in_place: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(dim, dim) for _ in range(experts)])
        self.in_place = in_place

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        choice = self.gate(flat).argmax(-1)
        order = choice.argsort()
        ends = choice.bincount(minlength=len(self.experts)).cpu().numpy().cumsum(0)
        out = torch.zeros_like(flat)
        start = 0
        for i, end in enumerate(ends):
            rows = order[start:end]
            out[rows] = self.experts[i](flat[rows])
            start = end
        if self.in_place:  # breaks the opaque contract: the caller's tensor changes
            x.mul_(1.0)
        return out.reshape(x.shape)


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, in_place: bool):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.to_out = torch.nn.Linear(dim, dim)
        self.ff = HostRoutedMoE(dim, in_place=in_place)

    def forward(self, x, temb):
        b, s, d = x.shape
        h = self.norm(x) + temb[:, None]
        q, k, v = (p(h).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        x = x + self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d))
        return x + self.ff(x)


class TinyMoEDiT(torch.nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, patch: int = 2, in_place: bool = False):
        super().__init__()
        self.patch = patch
        self.proj_in = torch.nn.Linear(4 * patch * patch, dim)
        self.time = torch.nn.Linear(1, dim)
        self.blocks = torch.nn.ModuleList([_Block(dim, heads, in_place) for _ in range(layers)])
        self.proj_out = torch.nn.Linear(dim, 4 * patch * patch)

    def forward(self, hidden_states, timestep):
        b, c, hh, ww = hidden_states.shape
        p = self.patch
        grid = torch.tensor([hh // p, ww // p])  # the patch grid kept in a tensor (HiDream's img_sizes)
        x = hidden_states.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        x = self.proj_in(x)
        temb = self.time(timestep[:, None])
        for block in self.blocks:
            x = block(x, temb)
        gh, gw = grid  # one-element tensors as reshape sizes: read in C++, specialised on their values
        x = self.proj_out(x).reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hh, ww)
        return (x,)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, 8, 8, generator=gen), timestep=torch.tensor([0.5]))


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    model = TinyMoEDiT().eval()
    children = {n: m for n, m in model.named_modules()}
    captured = capture(model, (), _inputs())
    return model, children, captured


def test_untraceable_submodules_become_opaque_calls(moe):
    model, children, captured = moe
    gm = captured.gm
    ops = [n for n in gm.graph.nodes if is_opaque_call(n)]
    assert [n.meta["dit_module_path"] for n in ops] == ["blocks.0.ff", "blocks.1.ff"]
    assert all(isinstance(n.meta["val"], list) and n.meta["val"][0].shape == (1, 16, 16) for n in ops)
    # the caller's model is untouched (no proxy left in it); the graph holds the very modules, under their paths
    assert {n: m for n, m in model.named_modules()} == children
    assert gm.get_submodule("blocks.1.ff") is model.blocks[1].ff
    assert gm.get_parameter("blocks.0.ff.experts.1.weight") is model.blocks[0].ff.experts[1].weight
    assert captured.baked_scalars == [4, 4]  # the patch grid, read as reshape sizes
    with torch.no_grad():
        for seed in (0, 1):  # other values, same shapes: the experts route other tokens, eagerly
            kw = _inputs(seed)
            assert torch.equal(gm(kw["hidden_states"], kw["timestep"])[0], model(**kw)[0])


def test_cache_and_regional_compile_around_opaque_calls(moe):
    """DBCache on the fixture's model, RegionalCompile on another instance (other weights): a graph calling one
    instance's modules is never reused for another as a trace template."""
    model, _, _ = moe
    torch.manual_seed(1)
    other = TinyMoEDiT().eval()
    kw = _inputs()
    with torch.no_grad():
        always = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0,
                      enable_separate_cfg=False)
        cached = compile_dit(model, passes=[DBCache(max_warmup_steps=1, **always)])
        outs = [cached(**kw)[0] for _ in range(2)]
        assert list(cached.report("dbcache").last_generation()["step_cached"]) == [False, True]
        assert torch.equal(outs[0], model(**kw)[0]) and torch.allclose(outs[1], outs[0], rtol=0, atol=1e-6)
        regional = compile_dit(other, passes=[RegionalCompile(backend="aot_eager")])
        assert torch.equal(regional(**kw)[0], other(**kw)[0])


def test_context_parallel_runs_opaque_calls_on_the_gathered_sequence(moe):
    """Nothing proves an opaque module token-wise: the sequence analysis gathers its input and runs it whole."""
    _, _, captured = moe
    gm = captured.gm
    plan = analyze(gm, get_structure(gm), SequenceShardSpec(2, 0))
    opaque = [(n.meta["dit_module_path"], why) for n, why in plan.nonlocal_ops if is_opaque_call(n)]
    assert [p for p, _ in opaque] == ["blocks.0.ff", "blocks.1.ff"]
    assert all("opaque module" in why for _, why in opaque)


def test_opaque_module_writing_its_input_is_refused():
    model = TinyMoEDiT(in_place=True).eval()
    with pytest.raises(CaptureError, match=r"opaque module blocks\.0\.ff \(HostRoutedMoE\) writes into its inputs"):
        capture(model, (), _inputs())


def test_blame_goes_to_the_innermost_module_of_the_model_not_to_torch_layers():
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x)

    model = Outer()
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(3))  # raised inside nn.Linear: its caller's code is what to run eagerly
    assert failing_module(model, info.value) == ("inner", model.inner)
    with pytest.raises(RuntimeError) as info:
        model.inner.lin(torch.randn(3))
    assert failing_module(model.inner, info.value) is None  # only the model itself (and torch's layer) on the stack
