"""SVDQuant's lookup-table form (``quant/w4_lut.py``, the CUTLASS kernel ``kernels/w4a8_lut_cutlass.cu``): the tables
against SVDQuant's stored tensors (the main weights' values are the expansion design's bytes, the branch's digit planes
reconstruct lora_up on an int8 grid), the kernel layout's shuffle, the A operand kernel's branch planes byte for byte
(TRITON_INTERPRET=1 on CPU), the ops (``opcheck``, ``torch.compile``), ``form="lut"`` writing the form
into a FLUX graph with the original weights gone, and on a Hopper GPU the kernel against its reference on FLUX's shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dit_passes import compile_dit  # noqa: E402
from dit_passes.kernels import lrcat_act_triton  # noqa: E402
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.passes.quantize import SVDQuantW4A4  # noqa: E402
from dit_passes.quant import lut_dispatch, w4_lut  # noqa: E402
from dit_passes.quant.graph_forms import LinearShape, _w4_over, svdq_lrcat_linear_form  # noqa: E402
from dit_passes.quant.svdquant import prepare_svdquant, relative_error  # noqa: E402
from test_lrcat import _case as lrcat_case  # noqa: E402 - the tests folder is on sys.path (pytest's rootdir)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _case(dtype=torch.float32, k=256, n=192, rank=32, seed=0, branch_scale=1.0):
    """test_lrcat's linear (outlier input channels, SVDQuant PTQ on its activations); ``branch_scale`` enlarges
    lora_up: rows whose branch sets the row scale."""
    x, w, b, q = lrcat_case(dtype, k, n, rank, seed)
    if branch_scale != 1.0:
        q.lora_up = (q.lora_up.float() * branch_scale).to(dtype)
    return x, w, b, q


@pytest.mark.parametrize("branch_scale", [1.0, 300.0])
def test_tables_hold_svdquant_values(branch_scale):
    """The main weights decode to e4m3(q * wscale / sw), the expansion design's bytes under the LUT's row scale; the
    branch decodes to 16 s [uh | ul | uh] (one table; A's planes are [hi | hi / 16 | lo]) with s a power of two <= 2
    and s (16 uh + ul) within half a step of u; the tables' entries are symmetric (code q >= 1 reads -T[8 - q])."""
    _, _, _, q = _case(branch_scale=branch_scale)
    lw = w4_lut.prepare_lut(q.qweight, q.wscale, q.lora_down, q.lora_up)
    k, r = q.K, q.rank
    values = w4_lut.decode(lw.codes, lw.tables)                                     # [N, K + C]
    assert tuple(values.shape) == (q.N, k + w4_lut.branch_cols(r))
    main = _w4_over(q.qweight, q.wscale.float(), lw.sw[:, None], q.N, k).float()
    assert torch.equal(values[:, :k], main)
    u = q.lora_up.float() * lw.c / lw.sw[:, None]
    assert u.abs().max() <= 448 / w4_lut.HEADROOM * (1 + 1e-6)
    uh, ul, s = w4_lut.branch_digits(u)
    assert s.max() <= 2 and torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert uh.abs().max() <= 8 and ul.abs().max() <= 8
    assert (s[:, None] * (16 * uh + ul) - u).abs().max() <= s.max() / 2 * (1 + 1e-6)
    # [uh | ul | uh] through one table 16 s (A's second plane is hi / 16), zeros up to a whole K-group
    assert torch.equal(values[:, k:k + 3 * r], 16 * s[:, None] * torch.cat([uh, ul, uh], 1))
    assert not values[:, k + 3 * r:].any()
    if branch_scale > 1:  # the branch set the row scale of some rows, and their digits use the whole grid
        assert (u.abs().amax(1) > 200).any()


def test_shuffle_is_a_permutation_and_round_trips():
    codes = torch.randint(0, 16, (48, 192), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    idx = w4_lut.shuffle_index(48, 192)
    assert torch.equal(idx.sort().values, torch.arange(48 * 192))
    assert torch.equal(w4_lut.unshuffle_codes(w4_lut.shuffle_codes(codes)), codes)
    # one thread's 16 codes are contiguous: rows r, r + 8 and k quads +0 / +16 of thread 0
    first = idx.reshape(48, 192)
    assert sorted(first[[0, 8]][:, [0, 1, 2, 3, 16, 17, 18, 19]].reshape(-1).tolist()) == list(range(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lut_linear_error_beside_lrcat(dtype):
    """Against the exact linear the LUT form's error is lrcat_split's (both keep ~8 bits of the branch's operands; the
    int4 weights dominate the error): within 5%, below lrcat's (its branch e4m3 x e4m3); with two planes between the
    two; the whole-linear op equals its graph form over the planes asked for (two by default)."""
    x, w, b, q = _case(dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    lw = w4_lut.prepare_lut(q.qweight, q.wscale, q.lora_down, q.lora_up)
    out = w4_lut.lut_linear_reference(x, lw, q.lora_down, q.smooth_inv, q.bias)
    shape = LinearShape.of(x, q.N, q.K, q.bias, q.wscale, rank=q.rank)
    e_lut = relative_error(out, ref)
    e_lrcat, e_split = (relative_error(svdq_lrcat_linear_form(
        x, q.qweight, q.wscale, q.lora_down, q.lora_up, q.smooth_inv, q.bias, shape, "reference", split=split), ref)
        for split in (False, True))
    assert 0 < e_lut < e_lrcat and e_lut < 1.05 * e_split, (e_lut, e_lrcat, e_split)
    # two planes: the stored operand's prefix against [qx | hi | hi16]: h in e4m3, between lrcat's and lrcat_split's
    # error (measured 0.051-0.055 against 0.055-0.059 and 0.044-0.049)
    lshape = LinearShape.of(x, q.N, q.K, q.bias, lw.sw, rank=q.rank)
    two = w4_lut.svdq_lut_linear_form(x, lw.codes, lw.tables, lw.sw, lw.c, q.lora_down, q.smooth_inv, q.bias, lshape,
                                      "graph", 2)
    assert e_split < relative_error(two, ref) < e_lrcat
    for planes, form in ((0, two), (3, out), (2, two)):  # 0: the default
        op = torch.ops.dit_passes.svdq_lut_linear.default(x, lw.codes, lw.tables, lw.sw, lw.c, q.lora_down,
                                                           q.smooth_inv, q.bias, "auto", "auto", planes)
        assert torch.equal(op, form), planes


@pytest.mark.parametrize("r,planes", [(32, 3), (20, 3), (96, 3), (32, 2), (20, 2), (96, 2)])
def test_act_kernel_planes_byte_for_byte(r, planes):
    """The row kernel's planes layouts ([hi | hi / 16 | lo | 0], [hi | hi / 16 | 0]) equal ``lut_smoothed_activation``
    byte for byte."""
    g = torch.Generator().manual_seed(r)
    xd = (torch.randn(8, 256, generator=g) * 3).to(torch.bfloat16).to(lrcat_act_triton_device())
    h = (torch.randn(8, r, generator=g) * 50).to(xd.device)
    c = (torch.rand(r, generator=g) * 10 + 1).to(xd.device)
    a, sx = lrcat_act_triton.lrcat_quantize_smoothed(xd, h, c, planes=planes)
    # the reference on the CPU: IEEE division, as the kernel's
    ra, rsx = w4_lut.lut_smoothed_activation(xd.cpu(), h.cpu(), c.cpu(), 8, r, planes)
    assert torch.equal(a.view(torch.uint8).cpu(), ra.view(torch.uint8)) and torch.equal(sx.view(-1).cpu(), rsx)


def _lowrank_case(dtype, m, k, r, exact: bool, seed=0):
    """xd, its amax, lora_down, c. ``exact``: integers / 4 against small integers, so every fp32 sum of h is exact
    in any order (the kernel's split and chunk order then meets the reference's mm byte for byte)."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        xd = (torch.randint(-8, 9, (m, k), generator=g).float() / 4).to(dtype)
        ld = torch.randint(-4, 5, (r, k), generator=g).float().to(dtype)
    else:
        xd = (torch.randn(m, k, generator=g) * 3).to(dtype)
        ld = (torch.randn(r, k, generator=g) * k ** -0.5).to(dtype)
    xd[3] = 0  # a zero token: scale 1, not 0 / 0
    dev = lrcat_act_triton_device()
    xd, ld = xd.to(dev), ld.to(dev)
    return xd, w4_lut.token_amax(xd), ld, (torch.rand(r, generator=g) * 10 + 1).to(dev)


@pytest.mark.parametrize("dtype,r,planes,split", [(torch.bfloat16, 32, 3, 0), (torch.bfloat16, 96, 2, 256),
                                                  (torch.bfloat16, 20, 3, 512), (torch.float32, 20, 2, 256)])
def test_lowrank_kernel_byte_for_byte(dtype, r, planes, split):
    """``dit_passes::lut_quantize_lowrank``'s kernel (the down projection inside, K in splits) equals
    ``lut_lowrank_activation`` byte for byte where h's sums are exact; the op's reference is that function."""
    from dit_passes.kernels import lut_act_triton
    xd, amax, ld, c = _lowrank_case(dtype, 40, 640, r, exact=True)
    a, sx = lut_act_triton.lut_quantize_lowrank(xd, amax, ld, c, planes, split)
    ra, rsx = w4_lut.lut_lowrank_activation(xd.cpu(), amax.cpu(), ld.cpu(), c.cpu(), 40, r, planes)
    assert a.shape == (40, 640 + w4_lut.branch_cols(r, planes))
    assert torch.equal(a.view(torch.uint8).cpu(), ra.view(torch.uint8)) and torch.equal(sx.cpu(), rsx)
    oa, osx = torch.ops.dit_passes.lut_quantize_lowrank(xd.cpu(), amax.cpu(), ld.cpu(), c.cpu(), planes)
    assert torch.equal(oa.view(torch.uint8), ra.view(torch.uint8)) and torch.equal(osx, rsx)


def test_lowrank_kernel_on_random_values_and_against_the_rows_form():
    """On random values: qx and sx byte for byte, the branch's columns up to h's summation order (an e4m3 step on a
    few); its hi + lo nearer the exact h than the rows form's (whose mm rounds h to bf16)."""
    from dit_passes.kernels import lut_act_triton
    xd, amax, ld, c = _lowrank_case(torch.bfloat16, 48, 768, 32, exact=False, seed=1)
    a, sx = lut_act_triton.lut_quantize_lowrank(xd, amax, ld, c, 3)
    ra, rsx = w4_lut.lut_lowrank_activation(xd.cpu(), amax.cpu(), ld.cpu(), c.cpu(), 48, 32, 3)
    a = a.cpu()
    assert torch.equal(a[:, :768].view(torch.uint8), ra[:, :768].view(torch.uint8)) and torch.equal(sx.cpu(), rsx)
    diff = a[:, 768:].float() != ra[:, 768:].float()
    assert diff.float().mean() < 0.02
    assert ((a[:, 768:].float() - ra[:, 768:].float()).abs() <= ra[:, 768:].float().abs() / 8 + 2 ** -9).all()
    # the branch's hi + lo against the exact hs: closer than the rows form's (h rounded to bf16 by its mm)
    xf, c = xd.cpu().float(), c.cpu()
    hs = (xf @ ld.cpu().float().t()) / (rsx[:, None] * c)
    rows, _ = w4_lut.lut_smoothed_activation(xd.cpu(), (xd @ ld.t()).cpu(), c, 48, 32, 3)
    kept = [relative_error(op[:, 768:800].float() + op[:, 832:864].float(), hs) for op in (a, rows)]
    assert kept[0] < 0.5 * kept[1] < 2e-3, kept


def test_lut_act_setting():
    """``lut_act`` picks the A operand's op where the kernels run (``fp8_act_quant``'s ``kernel``); the graph form
    stays the graph form; a bad value is named."""
    x = torch.zeros(2, 64)
    assert lut_dispatch.lut_act(x, "kernel") == "kernel"
    assert lut_dispatch.lut_act(x, "kernel", "lowrank") == "lowrank"
    assert lut_dispatch.lut_act(x, "graph", "lowrank") == "graph"
    with pytest.raises(ValueError, match="lut_act must be one of"):
        lut_dispatch.lut_act(x, "graph", "fused")
    with pytest.raises(ValueError, match="lut_act must be one of"):
        SVDQuantW4A4(rank=8, dynamic=True, form="lut", lut_act="fused")


def test_lowrank_op_checks():
    xd, amax, ld, c = (t.cpu() for t in _lowrank_case(torch.bfloat16, 16, 128, 8, exact=False))
    torch.library.opcheck(torch.ops.dit_passes.lut_quantize_lowrank, (xd, amax, ld, c, 3))
    with pytest.raises(ValueError, match="amax must be fp32"):
        torch.ops.dit_passes.lut_quantize_lowrank(xd, amax[:4], ld, c, 3)
    with pytest.raises(ValueError, match="lora_down must be a float"):
        torch.ops.dit_passes.lut_quantize_lowrank(xd, amax, ld[:, :64], c, 3)
    with pytest.raises(ValueError, match="planes must be one of"):
        torch.ops.dit_passes.lut_quantize_lowrank(xd, amax, ld, c, 1)


def lrcat_act_triton_device() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) else "cpu"


def test_ops_opcheck_compile_and_errors():
    x, _, _, q = _case(torch.bfloat16, k=128, n=32, rank=8)
    lw = w4_lut.prepare_lut(q.qweight, q.wscale, q.lora_down, q.lora_up)
    x2d = x.reshape(-1, 128)
    xd = (x2d.float() * q.smooth_inv).to(x.dtype)
    h = xd @ q.lora_down.t()
    torch.library.opcheck(torch.ops.dit_passes.lut_quantize_smoothed, (xd, h, lw.c, 3))
    a8, sx = torch.ops.dit_passes.lut_quantize_smoothed(xd, h, lw.c, 3)
    # test_schema compares the inputs before / after by arithmetic CPU ATen lacks for e4m3 (a8): the others run
    torch.library.opcheck(torch.ops.dit_passes.w4a8_lut_gemm, (lw.codes, lw.tables, a8, lw.sw, sx, q.bias, x.dtype),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    shape = LinearShape.of(x, q.N, q.K, q.bias, lw.sw, rank=q.rank)
    args = (lw.codes, lw.tables, lw.sw, lw.c, q.lora_down, q.smooth_inv, q.bias, shape)
    want = w4_lut.svdq_lut_linear_form(x, *args, "graph")
    assert torch.equal(w4_lut.svdq_lut_linear_form(x, *args, "kernel"), want)
    fn = torch.compile(lambda t: w4_lut.svdq_lut_linear_form(t, *args, "kernel"), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x), want)
    # the lowrank op's form (h inside in fp32, not rounded to x's dtype): within that rounding
    assert 0 < relative_error(w4_lut.svdq_lut_linear_form(x, *args, "lowrank"), want) < 1e-2
    with pytest.raises(ValueError, match="tables uint8"):
        torch.ops.dit_passes.w4a8_lut_gemm(lw.codes, lw.tables[:1], a8, lw.sw, sx, q.bias, x.dtype)
    with pytest.raises(ValueError, match="c must be fp32"):
        torch.ops.dit_passes.lut_quantize_smoothed(xd, h, lw.c.double(), 3)
    with pytest.raises(ValueError, match="planes must be one of"):
        torch.ops.dit_passes.lut_quantize_smoothed(xd, h, lw.c, 4)


def test_backend_lut_writes_the_form_and_drops_the_int4_tables():
    """``SVDQuantW4A4(form="lut")``: every W4A4 linear of a FLUX graph becomes the LUT form (the GEMM op, no
    ``_scaled_mm`` / addmm), its buffers are codes / tables / sw / c (no qweight, wscale or lora_up kept), and the
    output is close to the lrcat_split form's on the same stored tensors."""
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    passes = lambda form: [SVDQuantW4A4(rank=8, dynamic=True, modulation="w8a16", form=form)]  # noqa: E731
    lut = compile_dit(zm.model, passes=passes("lut"), example_inputs=kw, keep_original=True)
    gm = lut.graph_module
    nodes = [n for n in gm.graph.nodes if n.meta.get("dit_quant") == "svdq_lut"]
    gemms = [n for n in gm.graph.nodes if n.target is torch.ops.dit_passes.w4a8_lut_gemm.default]
    assert nodes and len(gemms) == len(nodes)
    assert not any(n.meta.get("dit_quant") == "svdq_w4a4" for n in gm.graph.nodes)
    buffers = {name for name, _ in gm.named_buffers()}
    prefixes = {name[:-len(".codes")] for name in buffers if name.endswith(".codes")}
    assert len(prefixes) == len(nodes)
    for p in prefixes:
        assert {f"{p}.{t}" for t in ("tables", "sw", "c", "lora_down", "smooth_inv")} <= buffers
        assert not {f"{p}.{t}" for t in ("qweight", "wscale", "lora_up")} & buffers
    split = compile_dit(zm.model, passes=passes("lrcat_split"), example_inputs=kw, keep_original=True)
    with torch.no_grad():
        out, ref, exact = lut(**kw)[0], split(**kw)[0], zm.model(**kw)[0]
    assert 0 < relative_error(out, ref) < 0.02
    assert relative_error(out, exact) < 1.1 * relative_error(ref, exact)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (the CUTLASS mixed-input kernel)")
@pytest.mark.parametrize("k,n", [(3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072)])
def test_cuda_lut_gemm_on_flux_shapes(k, n):
    """Every tile config of the kernel equals the reference GEMM up to bf16 output rounding and summation order, on
    FLUX's shapes (4608 tokens); the library's layout offsets equal ``shuffle_index``."""
    from dit_passes.kernels import w4a8_lut_cutlass as L
    if not L.is_available():
        pytest.skip("the LUT library does not build here (nvcc / nvidia-cutlass)")
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = (torch.randn(4608, k, device="cuda", generator=g)).to(torch.bfloat16)
    w = ((torch.rand(n, k, device="cuda", generator=g) * 2 - 1) * k ** -0.5).to(torch.bfloat16)
    b = ((torch.rand(n, device="cuda", generator=g) * 2 - 1) * k ** -0.5).to(torch.bfloat16)
    q = prepare_svdquant(w, b, act_absmax=x.float().abs().amax(0), rank=32, smooth="act", dtype=torch.bfloat16)
    lw = w4_lut.prepare_lut(q.qweight, q.wscale, q.lora_down, q.lora_up)
    a8, sx = w4_lut.lut_activation(x, q.smooth_inv, q.lora_down, lw.c, x.dtype, 4608, 32)
    ref = w4_lut.lut_gemm_reference(lw.codes, lw.tables, a8, lw.sw, sx, q.bias, torch.bfloat16).float()
    for config in L.CONFIGS:
        out = L.lut_gemm(lw.codes, lw.tables, a8, lw.sw, sx, q.bias, config)
        assert relative_error(out.float(), ref) < 4e-3, config
    assert torch.equal(L.shuffle_offsets(n, k + 128), w4_lut.shuffle_index(n, k + 128).long())
    # two planes: the kernel on the stored operand's prefix (views) equals the reference GEMM on the same prefix
    a2, sx2 = w4_lut.lut_activation(x, q.smooth_inv, q.lora_down, lw.c, x.dtype, 4608, 32, "kernel", 2)
    codes2, tables2 = w4_lut.weight_prefix(lw.codes, lw.tables, n, a2.shape[1])
    ref2 = w4_lut.lut_gemm_reference(codes2, tables2, a2, lw.sw, sx2, q.bias, torch.bfloat16).float()
    assert relative_error(L.lut_gemm(codes2, tables2, a2, lw.sw, sx2, q.bias).float(), ref2) < 4e-3
    # the lowrank op's A operand against its specification on the CPU (IEEE division by 448, as the kernel's; CUDA
    # ATen divides by a scalar as a multiplication by its reciprocal, an ulp off in some rows): qx and sx byte for
    # byte, the branch up to h's summation order
    xd = (x.float() * q.smooth_inv).to(x.dtype)
    amax = w4_lut.token_amax(xd)
    la, lsx = torch.ops.dit_passes.lut_quantize_lowrank(xd, amax, q.lora_down, lw.c, 2)
    ra, rsx = w4_lut.lut_lowrank_activation(xd.cpu(), amax.cpu(), q.lora_down.cpu(), lw.c.cpu(), 4608, 32, 2)
    la = la.view(torch.uint8).cpu()
    assert torch.equal(la[:, :k], ra.view(torch.uint8)[:, :k]) and torch.equal(lsx.cpu(), rsx)
    assert (la[:, k:] != ra.view(torch.uint8)[:, k:]).float().mean() < 0.01
    exact = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert relative_error(torch.ops.dit_passes.svdq_lut_linear(x, lw.codes, lw.tables, lw.sw, lw.c, q.lora_down,
                                                               q.smooth_inv, q.bias).float(), exact) < 0.1


def test_library_header_patch(tmp_path):
    """The one relaxation the LUT library needs (two k-blocks a tile instead of four: SVDQuant's K-group of 64 is the
    tile's K), applied to a copy of the header; another CUTLASS's header is refused by name."""
    from dit_passes.kernels import cutlass_build as B
    from dit_passes.kernels import w4a8_lut_cutlass as L
    ((header, patches),) = L.LIBRARY.patches
    inc = tmp_path / "include"
    (inc / header).parent.mkdir(parents=True)
    body = '#pragma once\n    static_assert(K_BLOCK_MAX >= 4, "Consider increasing TileShapeK");\n'
    (inc / header).write_text(body)
    out = B.patched_header(str(inc), header, patches)
    assert "W4A8_LUT_PATCHED_SM90_MIXED_INPUT" in out and "K_BLOCK_MAX >= 2" in out and ">= 4" not in out
    (inc / header).write_text(body.replace(">= 4", ">= 8"))
    with pytest.raises(B.CutlassUnavailable, match="cannot patch"):
        B.patched_header(str(inc), header, patches)


def test_stored_form_converts_what_the_layout_takes():
    """With the LUT form asked for, a W4A4 table becomes the LUT kind (its int4 tables dropped) where N is a multiple of
    16; a linear of 24 outputs keeps W4A4's tables and kind; other kinds are left alone."""
    _, _, _, q32 = _case(n=32, k=64, rank=8)
    _, _, _, q24 = _case(n=24, k=64, rank=8)
    tables = {"a": q32.tensors(), "b": q24.tensors(), "c": {"qweight": torch.zeros(16, 8), "wscale": torch.ones(16)}}
    kinds = SVDQuantW4A4(rank=8, dynamic=True, form="lut").stored_form(tables, {"a": "svdq_w4a4", "b": "svdq_w4a4", "c": "w8a16"})
    assert kinds == {"a": "svdq_lut", "b": "svdq_w4a4", "c": "w8a16"}
    assert "codes" in tables["a"] and "qweight" not in tables["a"] and "qweight" in tables["b"]


def test_load_writes_the_lut_form(tmp_path):
    """A saved SVDQuant checkpoint (the canonical int4 tables) loaded where the LUT form is asked for is written as
    that form, equal to quantizing in place with it."""
    import dit_passes
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()
    from dit_passes.quant.forms import QuantForms
    made = compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation="w8a16",
                                                      serialize_to=str(tmp_path), form="lut")], example_inputs=kw,
                       keep_original=True)
    loaded = dit_passes.load(zm.model, str(tmp_path), example_inputs=kw, keep_original=True,
                             forms=QuantForms(form="lut"))
    kinds = [n.meta.get("dit_quant") for n in loaded.graph_module.graph.nodes if n.meta.get("dit_quant")]
    assert kinds.count("svdq_lut") > 0 and "svdq_w4a4" not in kinds
    with torch.no_grad():
        assert torch.equal(loaded(**kw)[0], made(**kw)[0])
