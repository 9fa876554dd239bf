"""FuseNormRope and ``dit_passes::rms_norm_rope``: the q / k RMSNorm and the interleaved rotary embedding as one op.

On CPU the op is the ATen ops it replaces, so the rewritten model equals the original bit for bit (fp32 and
bf16). Checked: what the pass rewrites on FLUX (q and k of every attention, the double blocks' text and image
norms folded into one op each) and on other families (Chroma's functionalised graph, JoyImage's rotation of the
upcast norm); what it leaves, with the reason counted; aot_eager and RegionalCompile; Ulysses on two gloo ranks
(the rope of a sequence shard, its cos / sin sliced); the Triton kernel under the interpreter against the reference
(parts of a concatenation, strided input, broadcast tables, no weight, an odd head size padded); on a GPU the op's
CUDA path, eager and compiled.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.norm_rope import rms_norm_rope_reference

NORM_ROPE = torch.ops.dit_passes.rms_norm_rope.default
aten = torch.ops.aten


def _counts(records, name="fuse_norm_rope"):
    return next(r.result.counts for r in records if r.name == name)


def _nodes(graph, target):
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


def _to(zm, dtype):
    model = zm.model.to(dtype)
    kw = zm.make_inputs(batch=1, seed=1)
    return model, {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flux_every_q_and_k_fused_and_the_output_equal(dtype):
    zm = build("flux")
    model, kw = _to(zm, dtype)
    plain = compile_dit(model, passes=[], example_inputs=kw)
    c = compile_dit(model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    doubles, singles = len(model.transformer_blocks), len(model.single_transformer_blocks)
    counts = _counts(c._current().manager.records)
    assert counts == {"fused": 2 * (doubles + singles), "parts": 4 * doubles + 2 * singles}
    assert len(_nodes(c.graph, NORM_ROPE)) == counts["fused"]
    assert not _nodes(c.graph, aten.rms_norm.default) and not _nodes(c.graph, aten.unbind.int)
    assert len(_nodes(plain.graph, aten.rms_norm.default)) == counts["parts"]
    # the double blocks' ops read the text and the image norms' inputs, concatenated along the tokens
    two = [n for n in _nodes(c.graph, NORM_ROPE) if len(n.args[0]) == 2]
    assert len(two) == 2 * doubles and {n.args[5] for n in two} == {1}


# a model whose ropes the pass takes in their complex form (qwenimage), one without a rope (sd3); one it rewrites in
# part is test_decomposed_rms_norm_fused's hunyuanvideo; every class: the coverage matrix's norm_rope column
@pytest.mark.parametrize("family", ["qwenimage", "sd3"])
def test_other_families_equal_the_original(family):
    zm = build(family, redraw_zeros=True)
    kw = zm.make_inputs(batch=1, seed=1)
    c = compile_dit(zm.model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        ref, out = zm.model(**kw), c(**kw)
    ref, out = ref[0] if isinstance(ref, tuple) else ref.sample, out[0] if isinstance(out, tuple) else out.sample
    assert torch.equal(out, ref)
    counts = _counts(c._current().manager.records)
    assert counts.get("fused", 0) == len(_nodes(c.graph, NORM_ROPE))


@pytest.mark.parametrize("family", ["chroma", "joyimage_edit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp32: the coverage matrix's norm_rope column (every class)
def test_functionalised_and_upcast_first_forms_fused(family, dtype):
    """Chroma's graph is functionalised at capture (in-place ops), so its flatten is a view; JoyImage rotates
    ``to(y, f32)`` and casts back with ``type_as(out, y)``. Every interleaved rope of both is fused, bit for bit."""
    zm = build(family, redraw_zeros=True)
    model, kw = _to(zm, dtype)
    plain = compile_dit(model, passes=[], example_inputs=kw)
    c = compile_dit(model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    ropes = len(_nodes(plain.graph, aten.unbind.int))
    assert ropes and _counts(c._current().manager.records)["fused"] == ropes
    assert not _nodes(c.graph, aten.unbind.int) and len(_nodes(c.graph, NORM_ROPE)) == ropes


@pytest.mark.parametrize("family", ["ltxvideo", "sana_wm_refiner"])
def test_norm_and_rope_over_all_heads_fused(family):
    """LTX-Video and the SANA-WM refiner norm q / k over all heads and rope them before the head split (the pair
    split by ``unflatten`` in the refiner): the self-attention's q and k of every block fused, bit for bit."""
    zm = build(family, redraw_zeros=True)
    model, kw = _to(zm, torch.float32)
    c = compile_dit(model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    assert _counts(c._current().manager.records)["fused"] == 2 * len(model.transformer_blocks)


def test_rows_wider_than_the_kernel_are_left():
    """A norm + rope over more than MAX_D values (LTX-Video's 2048-wide q / k) would run the op's reference on the
    GPU, slower than Inductor's kernels: left, counted as a shape skip."""
    import dit_passes
    from dit_passes.passes.norm_rope import MAX_D

    class Wide(nn.Module):
        def forward(self, q, cos, sin):
            return _Ropes.rope(torch.rms_norm(q, [q.shape[-1]], None, 1e-6), cos, sin)

    q, cos, sin = (torch.randn(1, 3, 1, MAX_D + 2) for _ in range(3))
    be = dit_passes.backend(passes=[passes.FuseNormRope()], compiler="eager")
    with torch.no_grad():
        assert torch.equal(torch.compile(Wide(), backend=be, fullgraph=True)(q, cos, sin), Wide()(q, cos, sin))
    assert _counts(be.last_manager.records) == {"fused": 0, "parts": 0, "skipped_shape": 1}


@pytest.mark.parametrize("family", ["hunyuanvideo"])  # hunyuanvideo15 / hunyuanimage / framepack: the matrix
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp32: the coverage matrix's norm_rope column (every class)
def test_decomposed_rms_norm_fused(family, dtype):
    """HunyuanVideo (1.5) norm q / k with diffusers' RMSNorm, which the graph has as ATen ops (pow, mean, rsqrt,
    the weight's product): the op takes them with ``decomposed=True``, its reference repeats them, bit for bit.
    The self-attention's q and k of every dual-stream block fused (HunyuanVideo's single blocks rope only the image
    part of the tokens: left, counted as no_norm)."""
    zm = build(family, redraw_zeros=True)
    model, kw = _to(zm, dtype)
    c = compile_dit(model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        assert torch.equal(c(**kw)[0], model(**kw)[0])
    ops = _nodes(c.graph, NORM_ROPE)
    assert len(ops) == 2 * len(model.transformer_blocks) and all(n.args[6] is True for n in ops)
    singles = len(getattr(model, "single_transformer_blocks", ()))
    assert _counts(c._current().manager.records) == {"fused": len(ops), "parts": len(ops),
                                                     **({"skipped_no_norm": 2 * singles} if singles else {})}


class _DecomposedNorms(nn.Module):
    """diffusers' RMSNorm written out (taken) and forms the pass must leave."""

    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8).to(dtype))
        self.w32 = nn.Parameter(torch.randn(8))

    @staticmethod
    def norm(x, w, eps=1e-6, llama=False):
        if llama:  # the statistics and the product of the upcast x, cast back with type_as: left
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w
        h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
        if w is None:
            return h.to(x.dtype)
        return (h.to(w.dtype) if w.dtype in (torch.float16, torch.bfloat16) else h) * w

    def forward(self, q, cos, sin):
        a = _Ropes.rope(self.norm(q, self.w), cos, sin)                 # fused
        b = _Ropes.rope(self.norm(q, None), cos, sin)                   # fused (no weight)
        c = _Ropes.rope(self.norm(q, self.w, llama=True), cos, sin)     # left: no_norm
        d = _Ropes.rope(self.norm(q, self.w32), cos, sin)               # fp32 weight on bf16 q: fp32 out, left
        return a.float().sum() + b.float().sum() + c.float().sum() + d.float().sum()


def _through_backend(m: nn.Module, dtype=torch.float32) -> dict:
    """The pass's counts on ``m`` through the torch.compile backend (no DiT: compile_dit would find no blocks),
    the compiled output equal to the module's."""
    import dit_passes

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 8, generator=g).to(dtype)
    cos, sin = torch.randn(1, 6, 1, 8, generator=g), torch.randn(1, 6, 1, 8, generator=g)
    be = dit_passes.backend(passes=[passes.FuseNormRope()], compiler="eager")
    with torch.no_grad():
        assert torch.equal(torch.compile(m, backend=be, fullgraph=True)(q, cos, sin), m(q, cos, sin))
    return _counts(be.last_manager.records)


def test_decomposed_forms_taken_and_left():
    assert _through_backend(_DecomposedNorms(torch.bfloat16), torch.bfloat16) == {
        "fused": 2, "parts": 2, "skipped_no_norm": 1, "skipped_dtype": 1}


@pytest.mark.parametrize("family", ["ace_step", "cosmos"])
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # fp32: the coverage matrix's norm_rope column (every class)
def test_half_split_rope_fused(family, dtype):
    """ACE-Step and Cosmos rope with diffusers' ``use_real_unbind_dim=-2`` (x1, x2 = unbind(reshape(y, [..., 2,
    D/2]), -2), rot = cat([-x2, x1], -1)) after diffusers' RMSNorm: the self-attention's q and k of every block
    fused with ``half_split=True``, bit for bit."""
    zm = build(family, redraw_zeros=True)
    model, kw = _to(zm, dtype)
    c = compile_dit(model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        ref, out = model(**kw), c(**kw)
    ref, out = ref[0] if isinstance(ref, tuple) else ref.sample, out[0] if isinstance(out, tuple) else out.sample
    assert torch.equal(out, ref)
    ops = _nodes(c.graph, NORM_ROPE)
    blocks = len(getattr(model, "transformer_blocks", getattr(model, "layers", ())))
    assert blocks and len(ops) == 2 * blocks and all(n.args[7] is True for n in ops)
    assert _counts(c._current().manager.records) == {"fused": len(ops), "parts": len(ops)}


class _HalfRopes(nn.Module):
    """The half-split rotation's three spellings, each after an RMSNorm: all taken."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    @staticmethod
    def rope(y, cos, sin, form):
        if form == "unbind":
            x1, x2 = y.reshape(*y.shape[:-1], 2, -1).unbind(-2)
        elif form == "chunk":
            x1, x2 = y.chunk(2, dim=-1)
        else:
            x1, x2 = y[..., : y.shape[-1] // 2], y[..., y.shape[-1] // 2:]
        return y * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, q, cos, sin):
        return sum(self.rope(torch.rms_norm(q, [8], self.w, 1e-6), cos, sin, f).sum()
                   for f in ("unbind", "chunk", "slices"))


def test_half_split_forms_taken():
    assert _through_backend(_HalfRopes()) == {"fused": 3, "parts": 3}


class _Ropes(nn.Module):
    """Ropes the pass must leave (each reason once) and one it takes."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    @staticmethod
    def rope(y, cos, sin, upcast=True):
        x0, x1 = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
        rot = torch.stack([-x1, x0], -1).flatten(3)
        if not upcast:
            return y * cos + rot * sin
        return (y.float() * cos + rot.float() * sin).to(y.dtype)

    def forward(self, q, cos, sin):
        n = torch.rms_norm(q, [8], self.w, 1e-6)
        a = self.rope(n, cos, sin)                                   # fused
        shared = torch.rms_norm(q, [8], self.w, 1e-6)
        b = self.rope(shared, cos, sin) + shared                     # the norm read outside the rope: left
        c = self.rope(q, cos, sin)                                   # no norm: left
        h = torch.rms_norm(q.to(torch.bfloat16), [8], None, 1e-6)
        d = self.rope(h, cos.to(torch.bfloat16), sin.to(torch.bfloat16), upcast=False)   # bf16 math: left
        return a.sum() + b.sum() + c.sum() + d.float().sum()


def test_what_is_left_is_counted_and_the_output_unchanged():
    assert _through_backend(_Ropes()) == {"fused": 1, "parts": 1, "skipped_compute_dtype": 1, "skipped_no_norm": 1,
                                          "skipped_shared_norm": 1}


# regional (the preset's form: the op inside each compiled block); the whole graph through aot_eager takes 10 s more
@pytest.mark.parametrize("compile_kwargs", [{"regional": True, "backend": "aot_eager"}])
def test_compiles(compile_kwargs):
    zm = build("flux")
    kw = zm.make_inputs(batch=1, seed=1)
    c = compile_dit(zm.model, passes=[passes.FuseNormRope(), passes.DBCache(Fn_compute_blocks=1)], example_inputs=kw,
                    torch_compile={**compile_kwargs, "fullgraph": True})
    with torch.no_grad():
        assert torch.allclose(c(**kw)[0], zm.model(**kw)[0], rtol=1e-5, atol=1e-6)


def _ulysses_norm_rope(rank, world):
    """On each gloo rank: tiny FLUX under Ulysses(world) with FuseNormRope, against the unsharded model."""
    torch.manual_seed(0)
    zm = build("flux")
    kw = zm.make_inputs(batch=1)
    with torch.no_grad():
        ref = zm.model(**kw)[0]
        c = compile_dit(zm.model, passes=[passes.Ulysses(size=world), passes.FuseNormRope()], example_inputs=kw,
                        keep_original=True)
        out = c(**kw)[0]
    return {"err": ((out - ref).norm() / ref.norm()).item(), "counts": _counts(c._current().manager.records),
            "blocks": len(zm.model.transformer_blocks) + len(zm.model.single_transformer_blocks)}


def test_with_ulysses_on_two_ranks():
    from dit_passes.testing.multiproc import run_ranks

    for r in run_ranks(_ulysses_norm_rope, 2, timeout=300):
        assert r["err"] <= 1e-5, r
        assert r["counts"]["fused"] == 2 * r["blocks"], r


def _case(dtype, device="cpu", d=16, parts=(5, 7), weight=True, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randn(2, 3, n, d, device=device, generator=g).to(dtype).transpose(1, 2) for n in parts]  # strided
    ws = [torch.randn(d, device=device, generator=g).to(dtype) if weight else None for _ in parts]
    s = sum(parts)
    cos = torch.randn(1, s, 1, d, device=device, generator=g)  # fp32 tables broadcast over batch and heads
    sin = torch.randn(s, 1, d, device=device, generator=g)
    return xs, ws, [1e-6] * len(parts), cos, sin, 1


def _no_less_accurate(out, ref, exact, dtype):
    """fp32: rounding only; bf16 / fp16: against float64, as close as the reference (which rounds the norm before
    and after its weight, the kernel once): max and mean errors within a margin of the reference's."""
    err, ref_err = (out.double() - exact).abs(), (ref.double() - exact).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 1e-5, err.max().item()
    else:
        assert err.max() <= 1.5 * ref_err.max() and err.mean() <= 1.1 * ref_err.mean(), (err.max(), ref_err.max())


@pytest.mark.parametrize("dtype,d,weight,decomposed,half", [
    (torch.float32, 16, True, False, False), (torch.bfloat16, 16, True, False, False),
    (torch.float32, 12, False, False, False), (torch.bfloat16, 128, True, False, False),
    (torch.bfloat16, 128, True, True, False), (torch.bfloat16, 16, False, True, False),
    (torch.float32, 16, True, False, True), (torch.float32, 12, False, False, True),
    (torch.bfloat16, 128, True, True, True)])
def test_triton_kernel_matches_the_reference(dtype, d, weight, decomposed, half):
    """Under TRITON_INTERPRET=1 (as CI runs the tests), the kernel per part into its narrow of the output; the
    decomposed norm (diffusers' RMSNorm, rounded before its bf16 weight) is as accurate computed the kernel's way;
    the half-split pairs (j, j + D/2), D/2 not a power of two included (12)."""
    from dit_passes.kernels import norm_rope_triton as k
    if not k.interpreting():
        pytest.skip("runs the Triton kernel under TRITON_INTERPRET=1")
    xs, ws, eps, cos, sin, dim = _case(dtype, d=d, weight=weight)
    ref = rms_norm_rope_reference(xs, ws, eps, cos, sin, dim, decomposed, half)
    out = torch.empty_like(ref)
    start = 0
    for x, w, e in zip(xs, ws, eps):
        n = x.shape[dim]
        c, s = cos.expand(out.shape).narrow(dim, start, n), sin.expand(out.shape).narrow(dim, start, n)
        k.rms_norm_rope_into(x, w, e, c, s, out.narrow(dim, start, n), half_split=half)
        start += n
    exact = rms_norm_rope_reference([x.double() for x in xs], [w.double() if w is not None else None for w in ws],
                                    eps, cos.double(), sin.double(), dim, half_split=half)
    _no_less_accurate(out, ref, exact, dtype)


def test_kernel_refuses_what_it_cannot_take():
    from dit_passes.kernels import norm_rope_triton as k
    from dit_passes.passes.norm_rope import MAX_D, MAX_GROUPED
    assert k.MAX_D == MAX_D and k.MAX_GROUPED == MAX_GROUPED  # the pass leaves rows the kernel would not take
    x = torch.randn(2, 3, 4, 7)
    with pytest.raises(ValueError, match="even last dim"):
        k.rms_norm_rope_into(x, None, 1e-6, x, x, torch.empty_like(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the op's Triton path)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decomposed,half", [(False, False), (True, False), (True, True)])
def test_cuda_op_matches_the_reference(dtype, decomposed, half):
    xs, ws, eps, cos, sin, dim = _case(dtype, device="cuda", d=128, parts=(512, 4096))
    out = NORM_ROPE(xs, ws, eps, cos, sin, dim, decomposed, half)
    ref = rms_norm_rope_reference(xs, ws, eps, cos, sin, dim, decomposed, half)
    exact = rms_norm_rope_reference([x.double() for x in xs], [w.double() for w in ws], eps, cos.double(),
                                    sin.double(), dim, half_split=half)
    assert out.shape == ref.shape and out.dtype == dtype
    _no_less_accurate(out, ref, exact, dtype)
    compiled = torch.compile(lambda *a: NORM_ROPE(*a), fullgraph=True)
    assert torch.equal(compiled(xs, ws, eps, cos, sin, dim, decomposed, half), out)


# ------------------------------------------------------------------- the other rotary forms (passes.rope_forms)
@pytest.mark.parametrize("family,form,dtype", [("qwenimage", "form_complex", torch.float32),
                                               ("qwenimage", "form_complex", torch.bfloat16),
                                               ("wan", "form_scatter", torch.float32),
                                               ("zimage", "form_complex", torch.float32)])
def test_complex_and_scatter_forms_fused(family, form, dtype):
    """Qwen-Image ropes q / k as complex products (``view_as_complex(y) * freqs``), Z-Image too inside an
    autocast-disabled region, Wan writes its pairs back through strided slices of an ``empty_like`` after a norm
    over all heads: every self-attention's q and k fused (Qwen: text and image parts of each, 4 per block; Wan,
    Z-Image: 2 per block; Wan's ``rope_dim`` the head size), the output the eager model's."""
    zm = build(family, redraw_zeros=True)
    model, kw = _to(zm, dtype)
    plain = compile_dit(model, passes=[], example_inputs=kw)
    c = compile_dit(model, passes=[passes.FuseNormRope()], example_inputs=kw)
    with torch.no_grad():
        ref, out = model(**kw), c(**kw)
    ref, out = ref[0] if isinstance(ref, tuple) else ref.sample, out[0] if isinstance(out, tuple) else out.sample
    ref, out = (ref[0], out[0]) if isinstance(ref, list) else (ref, out)  # Z-Image: a list of samples
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    blocks = len(getattr(model, "transformer_blocks", getattr(model, "blocks", ())))
    if family == "zimage":  # its ropes run under autocast(enabled=False): inlined; refiners and main layers
        blocks = len(model.layers) + len(model.noise_refiner) + len(model.context_refiner)
    per_block = 4 if family == "qwenimage" else 2
    counts = _counts(c._current().manager.records)
    assert counts == {"fused": per_block * blocks, "parts": per_block * blocks, form: per_block * blocks}
    ops = _nodes(c.graph, NORM_ROPE)
    assert len(ops) == counts["fused"]
    if family == "wan":  # the norm spans all heads: the op's rope_dim is the head size
        assert all(n.args[-1] == model.config.attention_head_dim for n in ops)
        assert len(_nodes(plain.graph, aten.slice_scatter.default)) == 2 * len(ops)
        assert not _nodes(c.graph, aten.slice_scatter.default)
    else:
        assert not _nodes(c.graph, aten.view_as_complex.default)


class _OtherRopes(nn.Module):
    """The complex and the scatter rotations after an RMSNorm (taken), over all heads (taken, rope_dim), in an
    autocast-disabled region (taken), and the forms the pass must leave: complex128 freqs (fp64 math), a scatter
    whose odd slot reads another cos."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.w_all = nn.Parameter(torch.randn(24))

    @staticmethod
    def complex_rope(y, freqs):
        z = torch.view_as_complex(y.float().reshape(*y.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs).flatten(3).type_as(y)

    @staticmethod
    def scatter_rope(y, c, s, c_odd=None):
        x1, x2 = y.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.empty_like(y)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * (c if c_odd is None else c_odd)
        return out.type_as(y)

    def forward(self, q, cos, sin):
        freqs = torch.polar(torch.ones_like(cos[..., 0::2]), cos[..., 0::2])      # [1, S, 1, D/2] complex64
        c, s = cos[..., 0::2], sin[..., 1::2]
        n = lambda: torch.rms_norm(q, [8], self.w, 1e-6)                          # noqa: E731
        a = self.complex_rope(n(), freqs)                                          # taken
        b = self.scatter_rope(n(), c, s)                                           # taken
        wide = torch.rms_norm(q.flatten(2), [24], self.w_all, 1e-6).unflatten(-1, (3, 8))
        d = self.scatter_rope(wide, c, s)                                          # taken: rope_dim 8
        e = self.complex_rope(n(), freqs.to(torch.complex128))                     # fp64 math: left
        f = self.scatter_rope(n(), c, s, c_odd=c * 2)                              # not a rotation: not a rope
        with torch.autocast("cuda", enabled=False):  # a region of its own in the graph (Z-Image): inlined, taken
            h = self.complex_rope(n(), freqs)
        return a, b, d, e, f, h


def test_other_forms_taken_and_left():
    """Through torch.export's functionalised graph (the one compile_dit lowers: the scatter's writes are
    ``slice_scatter``s; Dynamo's backend keeps them as in-place ``copy_``, a form the pass does not read)."""
    from dit_passes.infra.pass_base import PassContext
    from dit_passes.infra.pass_manager import PassManager
    from dit_passes.passes.cleanup import Cleanup

    m, g = _OtherRopes(), torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 8, generator=g)
    cos, sin = torch.randn(1, 6, 1, 8, generator=g), torch.randn(1, 6, 1, 8, generator=g)
    gm = torch.export.export(m, (q, cos, sin)).run_decompositions({}).module()
    manager = PassManager([Cleanup(), passes.FuseNormRope()])
    manager.run(gm, PassContext(example_inputs={"args": [q, cos, sin]}))
    with torch.no_grad():
        for out, ref in zip(gm(q, cos, sin), m(q, cos, sin)):
            assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert len(_nodes(gm.graph, NORM_ROPE)) == 4
    assert not _nodes(gm.graph, torch.ops.higher_order.wrap_with_autocast)
    assert _counts(manager.records) == {"fused": 4, "parts": 4, "form_complex": 2, "form_scatter": 2,
                                               "skipped_compute_dtype": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", [True, False])
def test_grouped_kernel_matches_the_reference(dtype, weight):
    """The grouped kernel (a norm over all heads of a token, the rope of each head: Wan) under the interpreter
    against the op's reference: bf16 bit for bit, fp32 within the reduction order's rounding."""
    from dit_passes.kernels import norm_rope_triton as K

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3 * 12, generator=g).to(dtype)
    w = torch.randn(36, generator=g).to(dtype) if weight else None
    cos, sin = torch.randn(1, 5, 1, 12, generator=g), torch.randn(1, 5, 1, 12, generator=g)
    ref = rms_norm_rope_reference([x], [w], [1e-6], cos, sin, 1, rope_dim=12)
    out = K.rms_norm_rope_grouped_into(x, w, 1e-6, cos, sin, x.new_empty(2, 5, 3, 12))
    assert out.dtype == ref.dtype and torch.allclose(out.float(), ref.float(), rtol=1e-5, atol=1e-5)
    assert not K.is_supported_grouped(x, 12, half_split=True) and not K.is_supported_grouped(x, 10)
