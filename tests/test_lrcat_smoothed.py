"""The lrcat A operand from a smoothed activation and its down projection (``dit_passes::lrcat_quantize_smoothed``,
``lrcat_act="mm"``): the row kernel against its specification (``graph_forms.lrcat_smoothed_activation``)
byte for byte under TRITON_INTERPRET=1, the specification against the documented arithmetic, the op through
``opcheck`` and ``torch.compile``, the setting writing it into the SVDQuant graph (the "mm" form beside the other
A-operand forms: tests/test_lrcat_act.py), and on an sm_89+ GPU the kernel on FLUX's shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dit_passes import compile_dit  # noqa: E402
from dit_passes.kernels import lrcat_act_triton as K  # noqa: E402
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.passes.quantize import SVDQuantW4A4  # noqa: E402
from dit_passes.quant import dispatch  # noqa: E402
from dit_passes.quant.fp8_int8 import quantize_fp8_act  # noqa: E402
from dit_passes.quant.graph_forms import lrcat_c, lrcat_smoothed_activation  # noqa: E402
from dit_passes.quant.svdquant import relative_error  # noqa: E402

OP = torch.ops.dit_passes.lrcat_quantize_smoothed.default
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _inputs(m, k, r, dtype, seed=0):
    """A smoothed activation with outlier channels and a zero token, its down projection in x.dtype (as a GEMM
    returns it), c of lora_down rows of norm ~1."""
    g = torch.Generator().manual_seed(seed)
    xd = (torch.randn(m, k, generator=g) * (1 + 8 * (torch.rand(k, generator=g) > 0.97))).to(dtype)
    xd[min(2, m - 1)] = 0
    ld = (torch.randn(r, k, generator=g) * k ** -0.5).to(dtype)
    return xd, xd @ ld.t(), lrcat_c(ld, k)


def _bytes(t):
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("m,k,r,split,dtype", [(9, 320, 8, False, torch.float32), (9, 320, 8, True, torch.bfloat16),
                                               (4, 512, 32, True, torch.float32), (3, 96, 20, False, torch.bfloat16)])
def test_kernel_equals_specification_bit_for_bit(m, k, r, split, dtype):
    """K not a power of two (320, 96), ranks padded to 16 / 32 / 64 columns (split: 3R), a zero token."""
    xd, h, c = _inputs(m, k, r, dtype)
    a, sx = K.lrcat_quantize_smoothed(xd.to(DEV), h.to(DEV), c.to(DEV), split)
    a_ref, sx_ref = lrcat_smoothed_activation(xd, h, c, m, r, split)
    assert a.shape == a_ref.shape == (m, k + (-(-r * (3 if split else 1) // 16) * 16)) and sx.shape == (m, 1)
    assert torch.equal(sx.cpu(), sx_ref) and torch.equal(_bytes(a), _bytes(a_ref))


def test_specification_is_the_documented_arithmetic():
    """qx / sx: the per-token e4m3 quantization of xd's values; the branch h / (sx * c) as [hi | lo | hi | 0]."""
    xd, h, c = _inputs(12, 192, 8, torch.bfloat16, seed=1)
    a, sx = lrcat_smoothed_activation(xd, h, c, 12, 8, True)
    qx, sx_want = quantize_fp8_act(xd.float(), "per_row")
    hs = h.float() / (sx_want * c)
    hi = hs.to(torch.float8_e4m3fn)
    lo = (hs - hi.float()).to(torch.float8_e4m3fn)
    assert torch.equal(sx, sx_want) and torch.equal(_bytes(a[:, :192]), _bytes(qx))
    want = torch.cat([hi, lo, hi], 1).view(torch.uint8)
    assert torch.equal(_bytes(a[:, 192:216]), want) and not a[:, 216:].float().any()


def test_op_opcheck_compile_and_errors():
    xd, h, c = _inputs(16, 128, 8, torch.bfloat16, seed=2)
    for split in (False, True):
        torch.library.opcheck(torch.ops.dit_passes.lrcat_quantize_smoothed, (xd, h, c, split))
        fn = torch.compile(lambda t: OP(t * 2, h, c, split), fullgraph=True, backend="aot_eager")
        got, want = fn(xd), lrcat_smoothed_activation(xd * 2, h, c, 16, 8, split)
        assert torch.equal(got[1], want[1]) and torch.equal(_bytes(got[0]), _bytes(want[0]))
    with pytest.raises(ValueError, match=r"h must be a float \[16, R\]"):
        OP(xd, h[:4], c, False)
    with pytest.raises(ValueError, match="c must be fp32"):
        OP(xd, h, c.double(), False)
    with pytest.raises(ValueError, match="xd must be a 2-D"):
        OP(xd[None], h, c, False)
    assert not K.smoothed_supported(torch.zeros(2, K.SINGLE_MAX + 64, device=DEV))  # the reference takes it


def test_setting_writes_the_op_into_the_lrcat_graph():
    """``lrcat_act`` left at ``auto`` (``mm``), with the A-operand kernels asked for: one op per W4A8 linear, the
    output close to the two-kernel op's (``stats``); a bad value is an error naming the setting."""
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()

    def make(lrcat_act="auto"):
        return [SVDQuantW4A4(rank=8, dynamic=True, modulation="w8a16", form="lrcat_split", act_quant="kernel",
                             lrcat_act=lrcat_act)]
    two_kernels = compile_dit(zm.model, passes=make("stats"), example_inputs=kw, keep_original=True)
    mm = compile_dit(zm.model, passes=make(), example_inputs=kw, keep_original=True)
    nodes = list(mm.graph_module.graph.nodes)
    w4 = sum(n.meta.get("dit_quant") == "svdq_w4a4" for n in nodes)
    assert w4 > 0 and sum(n.target is OP for n in nodes) == w4
    assert not any(n.target is OP for n in two_kernels.graph_module.graph.nodes)
    with torch.no_grad():
        out, ref, base = mm(**kw)[0], two_kernels(**kw)[0], zm.model(**kw)[0]
    assert relative_error(out, ref) < 0.2 * relative_error(ref, base)
    with pytest.raises(ValueError, match="lrcat_act must be one of"):
        dispatch.lrcat_act_quant(torch.zeros(2, 64), "auto", "fused")
    with pytest.raises(ValueError, match="lrcat_act must be one of"):
        SVDQuantW4A4(rank=8, dynamic=True, form="lrcat_split", lrcat_act="fused")


@pytest.mark.skipif(not CUDA_FP8, reason="needs an sm_89+ GPU (the hardware e4m3 cast)")
@pytest.mark.parametrize("k", [3072, 12288, 15360])
def test_cuda_kernel_on_flux_shapes(k):
    """FLUX.1-dev's linear inputs (4608 tokens), ranks 32 and 128 (a fused linear's): the reference's bytes."""
    for r, split in ((32, False), (32, True), (128, True)):
        xd, h, c = _inputs(4608, k, r, torch.bfloat16, seed=4)
        assert K.smoothed_supported(xd.cuda())
        a, sx = OP(xd.cuda(), h.cuda(), c.cuda(), split)
        a_ref, sx_ref = lrcat_smoothed_activation(xd, h, c, 4608, r, split)
        assert torch.equal(sx.cpu(), sx_ref) and torch.equal(_bytes(a), _bytes(a_ref))
