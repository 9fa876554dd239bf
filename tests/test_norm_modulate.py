"""FuseNormModulate and ``dit_passes::(residual_)layer_norm_modulate``: AdaLN's LayerNorm and modulation as one op.

On CPU the ops are the ATen ops they replace, so the rewritten model equals the original bit for bit. Checked: what
the pass rewrites on FLUX (every block norm, the gated residual before each second norm, never across a block's
edge, so a cache cut at a block edge still holds) and on families of other forms (Wan's fp32 norm of a bf16 stream,
CogVideoX's affine norm); what it leaves, counted by reason; RegionalCompile; the Triton kernel under the
interpreter against a float64 reference; on a GPU the ops' CUDA path.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.norm_modulate import layer_norm_modulate_reference, residual_layer_norm_modulate_reference
from test_norm_rope import _counts as counts_of, _to  # noqa: E402 - the tests folder is on sys.path

LNM = torch.ops.dit_passes.layer_norm_modulate.default
RLNM = torch.ops.dit_passes.residual_layer_norm_modulate.default
aten = torch.ops.aten


def _counts(records):
    return counts_of(records, "fuse_norm_modulate")


def _nodes(graph, *targets):
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_every_block_norm_fused_and_the_output_equal(dtype):
    zm = build("flux", redraw_zeros=True)  # non-zero gates: a wrong residual would show
    model, kw = _to(zm, dtype)
    c = compile_dit(model, passes=[passes.FuseNormModulate()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    doubles, singles = len(model.transformer_blocks), len(model.single_transformer_blocks)
    # a double block: image and text norm1 (the block's input) and norm2 (after the attention's gated residual);
    # a single block: its input norm; the output norm. A single block's input is the previous block's residual:
    # another block, so never joined
    counts = _counts(c._current().manager.records)
    assert counts == {"fused": 4 * doubles + singles + 1, "with_residual": 2 * doubles}
    assert len(_nodes(c.graph, LNM)) + len(_nodes(c.graph, RLNM)) == counts["fused"]
    assert len(_nodes(c.graph, RLNM)) == counts["with_residual"]
    assert not _nodes(c.graph, aten.layer_norm.default, aten.native_layer_norm.default)
    # the blocks' ``1 + scale`` joined (summed in fp32 in the kernel, as Inductor's fused kernel did); the output
    # norm's is a view of the sum (``(1 + scale)[:, None, :]``): read as it is
    blocks = [n for n in _nodes(c.graph, LNM, RLNM) if "blocks." in n.meta["dit_module_path"]]
    assert len(blocks) == counts["fused"] - 1 and all(n.args[6 if n.target is LNM else 8] is True for n in blocks)


# wan: an fp32 LayerNorm of the bf16 stream, the modulation in fp32, cast back (the casts joined);
# cogvideox: an affine LayerNorm (weight and bias) over the text and video tokens
@pytest.mark.parametrize("family", ["wan", "cogvideox"])
def test_other_forms_equal_the_original(family):
    model, kw = _to(build(family, redraw_zeros=True), torch.bfloat16)
    c = compile_dit(model, passes=[passes.FuseNormModulate()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    counts = _counts(c._current().manager.records)
    blocks = model.blocks if family == "wan" else model.transformer_blocks
    assert counts["fused"] >= 2 * len(blocks), counts
    ops = _nodes(c.graph, LNM, RLNM)
    if family == "wan":
        assert any(n.args[-1] == torch.bfloat16 for n in ops)  # the cast back to the stream's dtype joined
    else:  # the norm's weight joined (an argument of the op)
        assert all((n.args[1] if n.target is LNM else n.args[3]) is not None for n in ops)


def test_a_cache_cut_at_a_block_edge_still_holds():
    """DBCache after the pass: its cached call equals its computed one on the same inputs, and the computed call
    equals DBCache's without the pass (the residual joined inside blocks only: the blocks stay node ranges)."""
    zm = build("flux", redraw_zeros=True)
    kw = zm.make_inputs(batch=1, seed=1)
    always = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=1)
    outs = []
    for chosen in ([passes.FuseNormModulate()], []):
        c = compile_dit(zm.model, passes=chosen + [passes.DBCache(**always)], example_inputs=kw)
        with torch.no_grad():
            outs.append([c(**kw)[0], c(**kw)[0]])  # computed (warm-up), then cached
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.allclose(outs[0][1], outs[0][0], rtol=1e-5, atol=1e-6)


class _Norms(nn.Module):
    """One of each: fused with its residual, fused plain, the norm read twice (shared), a scale that does not
    broadcast to the rows (shape), and a residual whose sum is read before the modulation (joined without it)."""

    def __init__(self, d=8):
        super().__init__()
        self.d = d

    def forward(self, r, y, g, m, a, m_rows):
        d = self.d
        h = r + g * y
        out1 = torch.layer_norm(h, [d], None, None, 1e-6) * m + a
        out2 = torch.layer_norm(r, [d], None, None, 1e-6) * (1 + m) + a
        n = torch.layer_norm(y, [d], None, None, 1e-6)
        out3 = n * m + a + n
        out4 = torch.layer_norm(y, [d], None, None, 1e-6) * m_rows + a  # [2, B, T, d]: wider than the rows
        h2 = r + y
        early = h2.sum()
        out5 = torch.layer_norm(h2, [d], None, None, 1e-6) * m + a
        return out1 + h, out2, out3, out4, out5 + early


def test_what_is_left_is_counted_and_the_output_unchanged():
    import dit_passes
    r, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    g, m, a = torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.randn(8)
    args = (r, y, g, m, a, torch.randn(2, 2, 1, 8))
    be = dit_passes.backend(passes=[passes.FuseNormModulate()], compiler="eager")
    with torch.no_grad():
        got, want = torch.compile(_Norms(), backend=be, fullgraph=True)(*args), _Norms()(*args)
    assert all(torch.equal(x, w) for x, w in zip(got, want))
    assert _counts(be.last_manager.records) == {"fused": 3, "with_residual": 1, "skipped_shape": 1,
                                                "skipped_shared": 1}


def test_compiles_in_the_regional_form():
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    c = compile_dit(zm.model, passes=[passes.FuseNormModulate(), passes.DBCache(Fn_compute_blocks=1)],
                    example_inputs=kw, torch_compile={"regional": True, "backend": "aot_eager", "fullgraph": True})
    with torch.no_grad():
        assert torch.allclose(c(**kw)[0], zm.model(**kw)[0], rtol=1e-5, atol=1e-6)


def _case(dtype, device="cpu", d=24, rows=(3, 5), weight=True, residual=True, gate=True, seed=0):
    """Row tensors strided (a transpose), a scale (about 1) per batch, broadcast over the tokens, a 1-D shift."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)
    y = rnd(rows[1], rows[0], d).to(dtype).transpose(0, 1)
    r = rnd(*rows, d).to(dtype) if residual else None
    g = rnd(rows[0], 1, d).to(dtype) if gate and residual else None
    w, b = (rnd(d).to(dtype), rnd(d).to(dtype)) if weight else (None, None)
    return y, r, g, w, b, 1e-6, 1 + rnd(rows[0], 1, d).to(dtype), rnd(d).to(dtype)


def _check(out, ref, exact, dtype):
    """fp32: rounding only; bf16: as close to float64 as the reference, which rounds after each op."""
    err, ref_err = (out.double() - exact).abs(), (ref.double() - exact).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 2e-5 * max(1.0, exact.abs().max().item()), err.max().item()
    else:
        assert err.max() <= 1.5 * ref_err.max() and err.mean() <= 1.1 * ref_err.mean(), (err.max(), ref_err.max())


def _run_both(y, r, g, w, b, eps, m, a, plus_one, kernel_call):
    """(kernel output, reference, float64) pairs: out, and h first with a residual."""
    if r is None:
        ref = layer_norm_modulate_reference(y, w, b, eps, m, a, plus_one)
        exact = layer_norm_modulate_reference(*(t.double() if t is not None else None for t in (y, w, b)), eps,
                                              m.double(), a.double(), plus_one)
        return [(kernel_call(), ref, exact)]
    href, ref = residual_layer_norm_modulate_reference(r, y, g, w, b, eps, m, a, plus_one)
    dbl = [t.double() if t is not None else None for t in (r, y, g, w, b)]
    hex_, exact = residual_layer_norm_modulate_reference(*dbl, eps, m.double(), a.double(), plus_one)
    h, out = kernel_call()
    # h: one rounding of r + g * y (the reference rounds the product too); out: the norm of the rounded h
    exact_out = layer_norm_modulate_reference(h.double(), dbl[3], dbl[4], eps, m.double(), a.double(), plus_one)
    return [(h, href, hex_), (out, ref, exact_out)]


@pytest.mark.parametrize("dtype,d,weight,residual,gate,plus_one", [
    (torch.float32, 24, True, True, True, False), (torch.bfloat16, 24, True, True, True, True),
    (torch.float32, 20, False, False, False, True), (torch.bfloat16, 96, False, True, False, False),
    (torch.bfloat16, 3072, False, False, False, True)])
def test_triton_kernel_matches_the_reference(dtype, d, weight, residual, gate, plus_one):
    """Under TRITON_INTERPRET=1 (as CI runs the tests): strided rows, a scale per batch, a 1-D shift, a row width
    not a power of two, the residual with and without its gate, ``1 + scale`` summed in the kernel, FLUX's
    width."""
    from dit_passes.kernels import ln_modulate_triton as k
    if not k.interpreting():
        pytest.skip("runs the Triton kernel under TRITON_INTERPRET=1")
    y, r, g, w, b, eps, m, a = _case(dtype, d=d, weight=weight, residual=residual, gate=gate)

    def call():
        out = torch.empty(y.shape, dtype=dtype)
        if r is None:
            return k.layer_norm_modulate_into(y, w, b, eps, m, a, out, scale_plus_one=plus_one)
        h = torch.empty(y.shape, dtype=dtype)
        k.layer_norm_modulate_into(y, w, b, eps, m, a, out, residual=r, gate=g, h_out=h, scale_plus_one=plus_one)
        return h, out
    for out, ref, exact in _run_both(y, r, g, w, b, eps, m, a, plus_one, call):
        _check(out, ref, exact, dtype)


def test_kernel_refuses_what_it_cannot_take():
    from dit_passes.kernels import ln_modulate_triton as k
    from dit_passes.passes.norm_modulate import MAX_D
    assert k.MAX_D == MAX_D  # the pass leaves rows the kernel would not take
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="rank 1..3"):
        k.layer_norm_modulate_into(x, None, None, 1e-6, x, x, torch.empty_like(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the ops' Triton path)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_cuda_op_matches_the_reference(dtype, residual):
    y, r, g, w, b, eps, m, a = _case(dtype, device="cuda", d=3072, rows=(2, 1024), residual=residual)
    args = ((y,) if r is None else (r, y, g)) + (w, b, eps, m - 1, a, True)  # FLUX's form: 1 + scale in the op
    op = LNM if r is None else RLNM

    def call():
        return op(*args)
    for out, ref, exact in _run_both(y, r, g, w, b, eps, m - 1, a, True, call):
        assert out.dtype == dtype and out.is_contiguous()
        _check(out, ref, exact, dtype)
    compiled = torch.compile(lambda *t: op(*t), fullgraph=True)
    got, want = compiled(*args), op(*args)
    assert all(torch.equal(x, v) for x, v in zip(got if residual else [got], want if residual else [want]))


def test_wan_fp32_cast_read_elsewhere_stays():
    """Wan casts its residual stream with ``type_as`` before the norm (a no-op in fp32) and reads that cast again
    as the next residual: the cast stays and the op reads it, so every modulated norm of Wan is fused (norm1 and
    norm3 of each block, norm_out), the output equal to eager's."""
    zm = build("wan", redraw_zeros=True)
    model, kw = zm.model, zm.make_inputs(batch=1, seed=1)
    c = compile_dit(model, passes=[passes.FuseNormModulate()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    counts = _counts(c._current().manager.records)
    assert counts["fused"] == 2 * len(model.blocks) + 1 and not any(k.startswith("skipped") for k in counts), counts


def test_nothing_rewritten_is_said():
    """A model without AdaLN's LayerNorm + modulation (Z-Image modulates an RMSNorm): the pass warns, naming why."""
    zm = build("zimage", redraw_zeros=True)
    with pytest.warns(UserWarning, match="fuse_norm_modulate rewrote nothing: no LayerNorm followed by a modulation"):
        compile_dit(zm.model, passes=[passes.FuseNormModulate()], example_inputs=zm.make_inputs(batch=1, seed=1))
