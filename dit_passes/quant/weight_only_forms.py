"""Weight-only quantized linears as plain ATen functions (the AdaLN modulation linears under SVDQuant, cache-dit's
``int8_weight_only`` / ``float8_weight_only``): what the quantize passes write into the graph, as the forms of
``graph_forms.py`` (the same conventions: ``torch.ops.aten.*`` overloads only, traced into the captured graph,
run eagerly by the CPU tests).

Weight-only int4 linear, :func:`w4a16_linear_form` (the AdaLN modulation linears under SVDQuant: their input is one
conditioning row per sample, so the GEMV is bound by reading the weight, and quantizing that row would add error
for no speed). The stored tensors are the weight half of W4A4 (``int4.quantize_weight_w4``: int4 per row and group
of 64 along K, bf16 group scales); the activations stay in x.dtype::

    w = x.dtype(float(int4 values of qweight) * float(wscale) per group)    # [N, K]; exact in fp32
    y = linear(x, w, bias)

The product of an int4 value (<= 4 significant bits) and a bf16 scale (8) is exact in fp32, so in fp32 the form is
the linear of the dequantized weight (``int4.dequantize_weight_w4``) bit for bit; in bf16 the weight takes one more
rounding (2**-9 relative, far below the int4 step). Shape-generic (no constants): the op replaces any linear.

Weight-only int4 with a low-rank branch, :func:`w4a16_lr_linear_form` (``w4a16.prepare_w4a16_lr``: the int4 part
is the residual after SVDQuant's rank-r branch)::

    y = w4a16_linear_form(x, qweight, wscale, bias) + linear(linear(x, lora_down), lora_up)   # branch in x.dtype

In fp32 it is that sum over the fp32 dequantized residual bit for bit. Shape-generic.

Weight-only int8 linear, :func:`w8a16_linear_form` (SVDQuant's ``modulation="w8a16"``; ``w8a16.py``):
int8 weights per output row, fp32 row scales, the activations in x.dtype::

    w = x.dtype(float(qweight) * float(wscale)[:, None])                   # [N, K]
    y = linear(x, w, bias)

In fp32 it is the linear of ``w8a16.dequantize_w8a16`` bit for bit (the same one product per element); in bf16
the weight takes one rounding (2**-9 relative). Shape-generic like the int4 form. The same form serves weight-only
fp8 (cache-dit's ``float8_weight_only``: qweight e4m3 [N, K], wscale fp32 [N], ``fp8_int8.prepare_fp8`` per row).

The weight-only forms on a few rows (``rows=True``, :func:`dequantized_linear`; chosen by
``dispatch.weight_only_form``, e.g. for the modulation linears' one conditioning row per sample): the linear as the
same products summed in fp32 by one reduction, which Inductor fuses with the dequantization, reading the packed
weight once where the linear writes a dequantized [N, K] copy for cuBLAS to read again::

    y = x.dtype(sum_k(float(x)[..., None, :] * float(x.dtype(w))) + float(bias))       # [..., N]

(FLUX's W4A16 modulation linears hold a quarter of its weights and see one row each: a bandwidth-bound GEMV, where a
dequantized copy doubles the bytes moved; :func:`w4a16_rows_op_form` writes the op ``dit_passes::w4a16_rows_linear``,
one Triton GEMV pass over the packed weight, instead: the GPU default, the form that reads each packed byte once.) In fp32 it equals the linear up to summation order; in bf16 it rounds once, as the
linear's fp32 accumulation does.
"""
from __future__ import annotations

from typing import Optional

import torch

from .graph_forms import LinearShape, _rows, _unrows
from .int4 import GROUP_SIZE, int4_values

aten = torch.ops.aten
_F32 = torch.float32


def dequantized_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                       rows: bool = False) -> torch.Tensor:
    """``linear(x, x.dtype(w), bias)`` of a dequantized weight w [N, K]; ``rows``: as a multiply-and-sum in fp32
    (module docstring: for a few rows of x, so that the dequantization fuses into the reduction)."""
    wx = aten.type_as.default(w, x)
    if not rows:
        return aten.linear.default(x, wx, bias)
    prod = aten.mul.Tensor(aten.unsqueeze.default(aten._to_copy.default(x, dtype=_F32), -2),
                           aten._to_copy.default(wx, dtype=_F32))                            # [..., N, K]
    return _summed_rows(prod, bias, x)


def _summed_rows(prod: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The rows form's end: fp32 products [..., N, K'] summed over K', the bias added in fp32, rounded to x.dtype."""
    y = aten.sum.dim_IntList(prod, [-1])
    if bias is not None:
        y = aten.add.Tensor(y, aten._to_copy.default(bias, dtype=_F32))
    return aten.type_as.default(y, x)


def w4a16_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                      bias: Optional[torch.Tensor], rows: bool = False) -> torch.Tensor:
    """Weight-only int4 linear (module docstring): x [..., K], qweight uint8 [N, K/2], wscale [N, K/64], bias [N] or
    None -> [..., N] in x.dtype."""
    ws = aten.reshape.default(aten._to_copy.default(wscale, dtype=_F32), [-1, 1])            # [N * G, 1]
    if rows:
        return _int4_rows_linear(x, qweight, ws, bias)
    q = int4_values(qweight, _F32)                                                           # [N, K]
    w = aten.view_as.default(aten.mul.Tensor(aten.view.default(q, [-1, GROUP_SIZE]), ws), q)  # group-major rows
    return dequantized_linear(x, w, bias)


def _int4_rows_linear(x: torch.Tensor, qweight: torch.Tensor, ws: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The int4 weight-only linear as a multiply-and-sum (``dequantized_linear(rows=True)``) over the packed bytes'
    two nibble planes, x's even and odd columns apart: the values never interleaved back into k order, which would
    make Inductor write the planes out before the reduction instead of reading the packed bytes in it. ``ws``: the
    fp32 group scales as [N * K/64, 1]."""
    half = GROUP_SIZE // 2                                                                   # a group's bytes
    xf = aten.unflatten.int(aten._to_copy.default(x, dtype=_F32), -1, [-1, 2])            # [..., K/2, 2]
    acc = None
    for plane, col in ((aten.bitwise_and.Scalar(qweight, 15), 0),
                       (aten.bitwise_right_shift.Tensor_Scalar(qweight, 4), 1)):         # even k: the low nibble
        q = aten.sub.Tensor(aten._to_copy.default(aten.bitwise_xor.Scalar(plane, 8), dtype=_F32), 8)   # [N, K/2]
        w = aten.view_as.default(aten.mul.Tensor(aten.view.default(q, [-1, half]), ws), q)
        w = aten._to_copy.default(aten.type_as.default(w, x), dtype=_F32)                  # x.dtype(w), as the linear
        term = aten.mul.Tensor(aten.unsqueeze.default(aten.select.int(xf, -1, col), -2), w)  # [..., N, K/2]
        acc = term if acc is None else aten.add.Tensor(acc, term)
    return _summed_rows(acc, bias, x)


def w4a16_rows_op_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: Optional[torch.Tensor],
                       shape: LinearShape) -> torch.Tensor:
    """The int4 weight-only linear on a few rows as the op ``dit_passes::w4a16_rows_linear`` (its reference: the
    ``rows=True`` form; CUDA: one GEMV pass over the packed weight), x [*shape.lead, K] -> [*shape.lead, N]."""
    y = torch.ops.dit_passes.w4a16_rows_linear.default(_rows(x, shape), qweight, wscale,
                                                       bias if shape.has_bias else None)
    return _unrows(y, shape)


def w4a16_lr_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                         lora_up: torch.Tensor, bias: Optional[torch.Tensor], rows: bool = False,
                         op_shape: Optional[LinearShape] = None) -> torch.Tensor:
    """Weight-only int4 of the residual plus the low-rank branch (module docstring): x [..., K], qweight uint8
    [N, K/2], wscale [N, K/64], lora_down [r, K], lora_up [N, r], bias [N] or None -> [..., N] in x.dtype;
    ``op_shape``: the int4 part as :func:`w4a16_rows_op_form` for x of that shape."""
    lora_act = aten.linear.default(x, aten.type_as.default(lora_down, x))                   # [..., r]
    branch = aten.linear.default(lora_act, aten.type_as.default(lora_up, x))               # [..., N]
    main = (w4a16_rows_op_form(x, qweight, wscale, bias, op_shape) if op_shape is not None
            else w4a16_linear_form(x, qweight, wscale, bias, rows))
    return aten.add.Tensor(main, branch)


def w8a16_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                      bias: Optional[torch.Tensor], rows: bool = False) -> torch.Tensor:
    """Weight-only int8 / fp8 linear (module docstring): x [..., K], qweight int8 or e4m3 [N, K], wscale [N], bias [N]
    or None -> [..., N] in x.dtype."""
    ws = aten.unsqueeze.default(aten._to_copy.default(wscale, dtype=_F32), 1)              # [N, 1]
    w = aten.mul.Tensor(aten._to_copy.default(qweight, dtype=_F32), ws)                    # [N, K]
    return dequantized_linear(x, w, bias, rows)
