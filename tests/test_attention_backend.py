"""AttentionBackend: every aten attention becomes ``dit_passes::sdpa_backend`` with the backends in order.

On CPU the preferred cuDNN kernel cannot run, so with ``fallback=True`` the CPU kernel the aten op would have
picked runs: outputs equal the unrewritten graph's (fp32, 1e-6 relative). Checked too: the count of rewritten
attentions equals the model's attention calls; the op's output keeps ``q``'s layout whatever kernel ran (the
graph around it was traced with that layout), and its fake agrees; composition with DBCache (both arms of the
branch carry the op, same cached steps) and RegionalCompile; ``fallback=False`` naming what to do.
"""
from __future__ import annotations

import pytest
import torch

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.attention_backend import _layout_of

SDPA_BACKEND = torch.ops.dit_passes.sdpa_backend.default
TOL = 1e-6


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _ops(compiled):
    """``sdpa_backend`` nodes in the lowered graph and its subgraphs (the cache branch's arms)."""
    gms = {id(m): m for gm in compiled.graphs.values() for m in gm.modules() if isinstance(m, torch.fx.GraphModule)}
    return sum(1 for gm in gms.values() for n in gm.graph.nodes if n.target is SDPA_BACKEND)


def _attention_calls(zm):
    ex = zm.expected
    return sum(n * ex["block_lists"][lst] for lst, n in ex["attention_per_block"].items())


@pytest.mark.parametrize("family", ["flux", "hunyuanvideo", "wan"])
def test_rewritten_attention_equals_the_original(family):
    zm = build(family)
    kw = zm.make_inputs(batch=1, seed=1)
    plain = compile_dit(zm.model, passes=[], example_inputs=kw)
    aten_sdpa = sum(1 for n in plain.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        c = compile_dit(zm.model, passes=[passes.AttentionBackend("cudnn")], example_inputs=kw)
        out = c(**kw)[0]
    counts = c._current().manager.records[-1].result.counts
    # every attention: the main stack's and, in HunyuanVideo, the token refiner's
    assert counts["attention_rewritten"] == aten_sdpa == _ops(c) >= _attention_calls(zm), counts
    assert not any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in c.graph.nodes)
    assert _rel(out, ref) <= TOL


def test_output_keeps_q_layout_whatever_kernel_ran():
    # q, k, v as DiTs pass them: (B, S, H, D) memory viewed as (B, H, S, D). The math kernel returns a
    # contiguous (B, H, S, D) tensor; the op must hand back q's layout, as its fake (and the traced graph) says.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g).transpose(1, 2) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for backends in ("math", "flash", "cudnn,flash,efficient,math"):
        out = SDPA_BACKEND(q, k, v, None, False, None, backends)
        assert _rel(out, ref) <= TOL, backends
        assert _layout_of(out) == _layout_of(q) == [0, 2, 1, 3], (backends, out.stride())
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = SDPA_BACKEND(fq, fk, fv, None, False, None, "math")
    assert fake.stride() == out.stride() and fake.shape == out.shape


def test_with_dbcache_both_arms_carry_the_op_and_cache_the_same_steps():
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.5, max_warmup_steps=1)

    def steps(c):
        outs, x = [], kw["hidden_states"]
        with torch.no_grad():
            for t in (1.0, 0.9, 0.8, 0.7):
                out = c(**{**kw, "hidden_states": x, "timestep": torch.tensor([t])})[0]
                x = x + 0.01 * out
                outs.append(out)
        return torch.stack(outs), c.cache_summary(as_dict=True)[-1]["cached_steps"]

    ref, ref_cached = steps(compile_dit(zm.model, passes=[passes.DBCache(**cfg)], example_inputs=kw))
    c = compile_dit(zm.model, passes=[passes.DBCache(**cfg), passes.AttentionBackend()], example_inputs=kw)
    names = [r.name for r in c._current().manager.records]
    assert names.index("attention_backend") < names.index("dbcache")  # ordered by the declarations
    out, cached = steps(c)
    assert cached == ref_cached and cached, cached
    assert _rel(out, ref) <= TOL
    assert _ops(c) == _attention_calls(zm)  # the middle blocks' attentions sit inside the branch's subgraphs


def test_with_regional_compile():
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        c = compile_dit(zm.model, passes=[passes.RegionalCompile(backend="aot_eager"), passes.AttentionBackend()],
                        example_inputs=kw)
        out = c(**kw)[0]
    assert [r.name for r in c._current().manager.records][-2:] == ["attention_backend", "regional_compile"]
    assert _rel(out, ref) <= TOL


def test_no_fallback_names_the_fix_and_bad_names_are_refused():
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    c = compile_dit(zm.model, passes=[passes.AttentionBackend("cudnn", fallback=False)], example_inputs=kw)
    with pytest.raises(RuntimeError, match=r"none of the backends \[cudnn\].*fallback=True"), torch.no_grad():
        c(**kw)
    with pytest.raises(ValueError, match="unknown.*'fa3'.*choose from"):
        passes.AttentionBackend("fa3")
    assert passes.AttentionBackend(["flash", "math"], fallback=False).backends == ["flash", "math"]
