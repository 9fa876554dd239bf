"""The int4 weight-only GEMV on a few rows (``dit_passes::w4a16_rows_linear``, kernels/w4a16_rows_triton.py): the
kernel against its specification (``weight_only_forms.w4a16_linear_form(rows=True)``) under TRITON_INTERPRET=1 up to
fp32 summation order, the op through ``opcheck`` and ``torch.compile(fullgraph=True)``, ``weight_only_form="kernel"``
writing the op for FLUX's W4A16-LR modulation linears with the output unchanged, and on a GPU FLUX's modulation
shapes.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from dit_passes import compile_dit  # noqa: E402
from dit_passes.kernels import w4a16_rows_triton as K  # noqa: E402
from dit_passes.models.zoo import build  # noqa: E402
from dit_passes.passes.quantize import SVDQuantW4A4  # noqa: E402
from dit_passes.quant.weight_only_forms import w4a16_linear_form  # noqa: E402
from dit_passes.quant.w4a16 import prepare_w4a16  # noqa: E402

OP = torch.ops.dit_passes.w4a16_rows_linear.default
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))


def _case(m, k, n, dtype, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    q = prepare_w4a16((torch.randn(n, k, generator=g) * 0.05).to(dtype),
                      torch.randn(n, generator=g).to(dtype) if with_bias else None)
    return x, q.qweight, q.wscale, q.bias


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("layout", ["flat", "grouped"])
def test_kernel_equals_the_rows_form(m, dtype, with_bias, layout):
    """K = 192 (96 bytes: a full and a partial chunk of 64 flat, of 2 groups grouped), N = 40 (a partial row block);
    both layouts the autotuner chooses between."""
    x, qw, ws, b = _case(m, 192, 40, dtype, with_bias)
    want = w4a16_linear_form(x, qw, ws, b, rows=True)
    config = dict(bn=8, warps=4, bb=64) if layout == "flat" else dict(bn=8, warps=4, gc=2)
    got = K.w4a16_rows_linear(*(t.to(DEV) if t is not None else None for t in (x, qw, ws, b)), config=config).cpu()
    assert got.dtype == dtype and got.shape == (m, 40)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of sums that differ by fp32 summation order: at most one step apart
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()
    assert not torch.equal(got, torch.zeros_like(got))


def test_op_opcheck_compile_and_errors():
    x, qw, ws, b = _case(2, 128, 24, torch.bfloat16, True, seed=1)
    for bias in (b, None):
        torch.library.opcheck(torch.ops.dit_passes.w4a16_rows_linear, (x, qw, ws, bias))
        fn = torch.compile(lambda t: OP(t * 2, qw, ws, bias), fullgraph=True, backend="aot_eager")
        assert torch.equal(fn(x), w4a16_linear_form(x * 2, qw, ws, bias, rows=True))
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[N, 64\] and wscale \[N, 2\]"):
        OP(x, qw[:, :32], ws, b)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        OP(x[None], qw, ws, b)
    with pytest.raises(ValueError, match=r"needs a 2-D float x of 1..4 rows"):
        K.w4a16_rows_linear(torch.zeros(5, 128, dtype=torch.bfloat16, device=DEV), qw.to(DEV), ws.to(DEV), None)


def test_kernel_setting_writes_the_op_for_the_modulation_linears():
    zm = build("flux", **FLUX64)
    kw = zm.make_inputs()

    def lowered(setting):
        return compile_dit(zm.model, passes=[SVDQuantW4A4(rank=8, dynamic=True, modulation="w4a16_lr",
                                                          weight_only_form=setting)],
                           example_inputs=kw, keep_original=True)

    kernel, linear = lowered("kernel"), lowered("linear")
    nodes = list(kernel.graph_module.graph.nodes)
    adaln = sum(n.meta.get("dit_quant") == "w4a16_lr" for n in nodes)
    assert adaln > 0 and sum(n.target is OP for n in nodes) == adaln
    assert not any(n.target is OP for n in linear.graph_module.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(kernel(**kw)[0], linear(**kw)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n", [18432, 9216])
def test_cuda_kernel_on_flux_modulation_shapes(m, n):
    x, qw, ws, b = _case(m, 3072, n, torch.bfloat16, True, seed=2)
    want = w4a16_linear_form(x, qw, ws, b, rows=True)
    got = OP(x.cuda(), qw.cuda(), ws.cuda(), b.cuda()).cpu()
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-5).all()
