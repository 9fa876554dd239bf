"""Quantized graphs under ``torch.compile(fullgraph=True)`` (CPU, ``aot_eager``).

For each quantization pass: the graph compiles whole (``compile_dit(..., torch_compile={...})``) and per block
(``passes.RegionalCompile``) with no graph break (``fullgraph=True`` raises on one; the counting backend sees
exactly one frame per compiled graph / template), the quantized arithmetic is inside the compiled graphs (not
left eager around them), and the outputs equal the uncompiled quantized graph's. Every quantized custom op
passes ``torch.library.opcheck`` (schema, fake implementation, AOT dispatch with dynamic shapes).

Tiny zoo Flux with hidden size 64 (2 heads x 32) so that W4A4 (K % 64 == 0) takes every block linear; SVDQuant's
AdaLN modulation linears are a weight-only int4 graph form (W4A16_LR by default, W4A16 on request; plain ATen ops),
compiled with the rest.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dit_passes import compile_dit, passes
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import Fp8Linear, Int8Linear, SVDQuantW4A4
from dit_passes.quant import prepare_fp8, prepare_int8, prepare_svdquant
from dit_passes.quant.fp8_block import prepare_fp8_block

torch.set_num_threads(1)

FLUX64 = dict(attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))
METHODS = {  # name -> the pass (its form an argument)
    "int8": lambda: Int8Linear(),
    "fp8_per_row": lambda: Fp8Linear("per_row"),
    "fp8_per_tensor": lambda: Fp8Linear("per_tensor"),
    "svdq_w4a4": lambda: SVDQuantW4A4(rank=8, dynamic=True),  # the custom op (reference W4A4 on CPU)
    "svdq_w4a8_fp8": lambda: SVDQuantW4A4(rank=8, dynamic=True, form="fp8"),  # graph form
    # the fused W4A8 kernels' op (its reference on CPU)
    "svdq_w4a8_fused": lambda: SVDQuantW4A4(rank=8, dynamic=True, form="w4a8"),
    "svdq_w4a16_mod": lambda: SVDQuantW4A4(rank=8, dynamic=True, modulation="w4a16"),
    # modulation="w4a16_lr" is the default: "svdq_w4a4" above is that configuration (its modulation linears' W4A16_LR
    # form in the compiled graphs / templates), so it has no case of its own (it was one, the same pass twice)
}
QUANT_OPS = {torch.ops.dit_passes.svdq_w4a4_linear.default, torch.ops.dit_passes.fp8_linear.default,
             torch.ops.dit_passes.int8_linear.default, torch.ops.dit_passes.svdq_w4a8_linear.default}
LOW_BIT = (torch.float8_e4m3fn, torch.int8, torch.uint8)
NIBBLES = torch.ops.aten.bitwise_right_shift.Tensor_Scalar  # the high nibble's unpack (int4.int4_values)


def _int8_dequant(n: torch.fx.Node) -> bool:
    """A cast of an int8 tensor to float: the weight-only int8 form's dequantization (the int8 linear is an op)."""
    src = n.args[0] if n.target is torch.ops.aten._to_copy.default and n.args else None
    val = src.meta.get("val", src.meta.get("example_value")) if isinstance(src, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.int8


def quantized_nodes(graph: torch.fx.Graph) -> int:
    """Nodes of a graph that compute quantized arithmetic: a quantized-linear op, a cast to a low-bit dtype (the
    activation quantization of the fp8 graph forms, plain ATen ops), an int4 unpack (the weight-only int4 form, and
    the W4A8 form's weight expansion, the weight-only int4 forms of SVDQuant's modulation linears) or an int8 weight's
    dequantization (their weight-only int8 form)."""
    return sum(1 for n in graph.nodes if n.op == "call_function"
               and (n.target in QUANT_OPS or n.target is NIBBLES or n.kwargs.get("dtype") in LOW_BIT
                    or _int8_dequant(n)))


def block_linears(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) and "blocks." in p for p, m in model.named_modules())


def _run(module, kw):
    with torch.no_grad():
        return module(**kw)[0]


def _lowered(zm, kw, method, passes_after=(), **compile_kw):
    """compile_dit(...) of ``method`` lowered now."""
    make = METHODS[method]
    # keep_original: every case quantizes the same model again
    return compile_dit(zm.model, passes=[make(), *passes_after], example_inputs=kw, keep_original=True,
                       **compile_kw)


def _replaced(compiled) -> int:
    return next(r.result.counts["replaced"] for r in compiled._current().manager.records if r.name != "cleanup")


@pytest.fixture(scope="module")
def flux():
    zm = build("flux", **FLUX64)
    return zm, zm.make_inputs()


@pytest.fixture(scope="module")
def uncompiled(flux):
    """{method: (output, replaced linears, quantized nodes)} of the uncompiled quantized graphs."""
    zm, kw = flux
    out = {}
    for name in METHODS:
        c = _lowered(zm, kw, name)
        out[name] = (_run(c, kw), _replaced(c), quantized_nodes(c.graph_module.graph))
    return out


# per_tensor and the SVDQuant fp8 form (the larger graph): regional only, to keep the file under a minute.
# Backend "eager": what this test asserts is Dynamo's (one frame, no break, every quantized node in its graph; the
# counter records the graph Dynamo hands the backend, the same under aot_eager). Every quantized linear is a block's,
# and test_regional_compile_fullgraph runs each method's blocks through aot_eager.
@pytest.mark.parametrize("method", ["int8", "fp8_per_row", "svdq_w4a4", "svdq_w4a8_fused", "svdq_w4a16_mod"])
def test_whole_graph_compiles_fullgraph(flux, uncompiled, method):
    zm, kw = flux
    ref, replaced, quantized = uncompiled[method]
    assert replaced == block_linears(zm.model) and quantized > 0  # every block linear, the AdaLN ones included
    cnt = CompileCounterWithBackend("eager")
    c = _lowered(zm, kw, method, torch_compile={"backend": cnt, "fullgraph": True})
    out = _run(c, kw)
    assert cnt.frame_count == 1 and len(cnt.graphs) == 1  # one graph, no break
    assert quantized_nodes(cnt.graphs[0].graph) == quantized  # all the quantized arithmetic is compiled
    if method.startswith("svdq_w4a"):  # the AdaLN modulation linears' weight-only forms are in the one graph
        adaln = [p for p, m in zm.model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "blocks." in p and p.endswith(".linear")]  # norm*.linear
        nodes = cnt.graphs[0].graph.nodes
        int8, int4 = sum(_int8_dequant(n) for n in nodes), sum(n.target is NIBBLES for n in nodes)
        assert (int8, int4) == (0, len(adaln)) and adaln  # int4 unpacks: W4A16 or the default W4A16_LR
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    _run(c, kw)
    assert cnt.frame_count == 1  # no recompilation


@pytest.mark.parametrize("method", METHODS)
def test_regional_compile_fullgraph(flux, uncompiled, method):
    zm, kw = flux
    ref, _, quantized = uncompiled[method]
    cnt = CompileCounterWithBackend("aot_eager")
    c = _lowered(zm, kw, method, [passes.RegionalCompile(backend=cnt)])
    out = _run(c, kw)
    counts = next(r.result.counts for r in c._current().manager.records if r.name == "regional_compile")
    assert counts["regions"] == 4 and counts["templates"] == 2  # 2 double + 2 single blocks, one template each kind
    assert cnt.frame_count == 2  # one frame per template: no graph break inside a block
    # all the quantized arithmetic runs inside the compiled templates (each template stands for two blocks)
    assert 2 * sum(quantized_nodes(g.graph) for g in cnt.graphs) == quantized
    assert quantized_nodes(c.graph_module.graph) == 0  # none left in the eager graph around the templates
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_w4a8_setting_writes_the_fused_op(flux, uncompiled):
    """``form="w4a8"``: every W4A4 linear becomes ``dit_passes::svdq_w4a8_linear`` (exact group
    scales), the modulation linears keep their weight-only form; W4A8's output is not W4A4's."""
    zm, kw = flux
    c = _lowered(zm, kw, "svdq_w4a8_fused")
    ops = [n for n in c.graph_module.graph.nodes if n.target is torch.ops.dit_passes.svdq_w4a8_linear.default]
    adaln = [p for p, m in zm.model.named_modules()
             if isinstance(m, torch.nn.Linear) and "blocks." in p and p.endswith(".linear")]
    assert len(ops) == block_linears(zm.model) - len(adaln) and all(n.args[-1] is False for n in ops)
    assert not torch.equal(uncompiled["svdq_w4a8_fused"][0], uncompiled["svdq_w4a4"][0])


def _op_cases():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 128, generator=g), torch.randn(48, generator=g), torch.randn(2, 5, 128, generator=g)
    s = prepare_svdquant(w, b, rank=4, smooth="weight")
    f, ft, i = prepare_fp8(w, b), prepare_fp8(w, b, "per_tensor"), prepare_int8(w, b)
    it, fb = prepare_int8(w, b, "per_tensor"), prepare_fp8_block(w, b, block=16)
    return {
        "svdq_w4a4": (torch.ops.dit_passes.svdq_w4a4_linear.default,
                      (x, s.qweight, s.wscale, s.lora_down, s.lora_up, s.smooth_inv, s.bias)),
        "svdq_w4a4_no_bias": (torch.ops.dit_passes.svdq_w4a4_linear.default,
                              (x, s.qweight, s.wscale, s.lora_down, s.lora_up, s.smooth_inv, None)),
        "svdq_w4a8": (torch.ops.dit_passes.svdq_w4a8_linear.default,
                      (x, s.qweight, s.wscale, s.lora_down, s.lora_up, s.smooth_inv, s.bias, False)),
        "svdq_w4a8_fold_no_bias": (torch.ops.dit_passes.svdq_w4a8_linear.default,
                                   (x, s.qweight, s.wscale, s.lora_down, s.lora_up, s.smooth_inv, None, True)),
        "fp8_per_row": (torch.ops.dit_passes.fp8_linear.default, (x, f.qweight, f.wscale, f.bias, "per_row")),
        "fp8_per_tensor": (torch.ops.dit_passes.fp8_linear.default, (x, ft.qweight, ft.wscale, None, "per_tensor")),
        "int8": (torch.ops.dit_passes.int8_linear.default, (x, i.qweight, i.wscale, i.bias)),
        "int8_per_tensor": (torch.ops.dit_passes.int8_tensor_linear.default, (x, it.qweight, it.wscale, it.bias)),
        "fp8_per_block": (torch.ops.dit_passes.fp8_block_linear.default, (x, fb.qweight, fb.wscale, fb.bias)),
    }


@pytest.mark.parametrize("case", list(_op_cases()))
def test_quantized_custom_ops_pass_opcheck(case):
    op, args = _op_cases()[case]
    # opcheck's schema test compares inputs with arithmetic that fp8 tensors lack: the other checks for those
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if case.startswith("fp8") else \
        ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)  # raises on a missing or wrong fake implementation
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == (2, 5, 48) and fake.dtype == args[0].dtype
