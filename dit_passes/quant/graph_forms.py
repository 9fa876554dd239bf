"""Quantized linears as plain ATen functions: what the quantize passes write into the graph in place of an opaque
custom op, so that ``torch.compile`` sees the activation quantization (Inductor fuses it into the kernel that
produces the activation) and the GEMM (``aten._scaled_mm``, bias in its epilogue).

Every function here calls ``torch.ops.aten.*`` overloads only and takes its shapes as Python constants
(:class:`LinearShape`), so ``torch.fx.symbolic_trace`` of it yields ATen ``call_function`` nodes, the form of the
captured graph, and calling it eagerly runs the very same arithmetic (which is how the CPU tests check it).
Which GEMM runs (``"scaled_mm"``: ``torch._scaled_mm`` on fp8 tensor cores; ``"reference"``: the dequantized
matmul in fp32, any device) is decided by ``dispatch.py`` when the graph is written.

fp8 linear, :func:`fp8_linear_form` (the numerics of ``fp8_int8.fp8_linear_reference``)::

    xf = float(x.reshape(M, K))
    sx = amax|xf| / 448 per token [M, 1] ("per_row") or over all of x [] ("per_tensor"); a zero scale becomes 1
    qx = e4m3(clamp(xf * (1 / sx), -448, 448))     # act_quant="kernel" (per_row): both lines are one op,
                                                    # dit_passes::fp8_quantize_rows(x [M, K]) (one Triton kernel)
    "scaled_mm":  y = _scaled_mm(qx, qweight.T, sx, wscale [1, N], bias, out_dtype=x.dtype, use_fast_accum)
    "reference":  y = x.dtype(float(qx) @ float(qweight).T * sx * wscale + float(bias))
    y.view(*lead, N)

SVDQuant weights on fp8 tensor cores, :func:`svdq_fp8_linear_form` (W4A8: the stored SVDQuant tensors, the
activations per token in e4m3 instead of per 64-group in int4)::

    xs = float(x.reshape(M, K)) * smooth_inv
    sx, qx = the per-token e4m3 quantization of xs (as above)
    w8, sw = w4_to_e4m3(qweight, wscale)     # once per call: int4 * group scale, rescaled per row, rounded to e4m3
                                              # expand="kernel": the op dit_passes::w4_to_e4m3 (one Triton kernel
                                              # on CUDA, the same bytes; dispatch.w4_expand)
    y = GEMM(qx, sx, w8, sw, bias)            # as above, out in x.dtype
    y = y + x.dtype(xs) @ lora_down.T @ lora_up.T     # low-rank branch in the activation dtype (addmm: one rounding)

SVDQuant with the low-rank branch folded into the GEMM's K ("lrcat"), :func:`svdq_lrcat_linear_form`: one
``_scaled_mm`` over [qx | qh] and [w8 | u8], the per-token sx and per-row sw shared by both parts, so no separate
low-rank mm / addmm and no extra passes over the [M, N] output; the branch pays with e4m3 precision::

    xs, sx, qx as above
    c[r]  = sqrt(K) * ||lora_down[r, :]||_2          # |h[m, r]| <= ||xs[m]||_2 ||lora_down[r]||_2 <= amax|xs[m]| c[r]
    sw[n] = max(8 * max_g wscale[n, g], max_r |lora_up[n, r] * c[r]|) / 448      (lrcat_row_scale)
    h  = x.dtype(xs) @ lora_down.T                                                # [M, R]
    qh = e4m3(clamp(h / (sx * c), -448, 448))       # |h / (sx c)| <= 448 by the bound: no overflow
    w8 = e4m3(clamp(q * (wscale / sw), -448, 448))  # as w4_to_e4m3, with the shared row scale
    u8 = e4m3(clamp(lora_up * c / sw, -448, 448))
    y  = GEMM([qx | qh | 0], sx, [w8 | u8 | 0], sw, bias)     # K + R_pad columns (R_pad: R up to a multiple of 16)

``split=True`` (``form="lrcat_split"``) gives the branch ~8 significant bits back for 3R columns:
each branch operand v is rounded twice, ``hi = e4m3(v)``, ``lo = e4m3(v - hi)``, and
``A = [qx | qh_hi | qh_lo | qh_hi]``, ``B = [w8 | u_hi | u_hi | u_lo]`` sum hi*hi + lo*hi + hi*lo (the dropped
lo*lo and the second roundings are ~2**-8 relative). 3R = 96 columns are 3% more MMA work at K = 3072, <1% at
12288 / 15360.

(``c`` is the branch's scale on the lora_down side: the bound holds for the smoothed activations xs that lora_down
reads.) ``c`` and ``sw`` are derived from the stored tensors per call: c in the graph (a [R, K] reduction), sw with
B (an [N, K/64 + R] reduction; ``expand="kernel"``: inside the op ``dit_passes::w4_lrcat_to_e4m3``, which writes B
and sw in one pass). The A operand [qx | qh] and sx are :func:`lrcat_activation` (``act_quant="kernel"``: the op
``dit_passes::lrcat_quantize_rows``, one kernel reading x once, h kept in fp32 instead of rounded to x.dtype).

NVFP4 SVDQuant on fp8 tensor cores, :func:`svdq_nvfp4_fp8_linear_form` (the numerics of
``nvfp4.nvfp4_linear_reference``: every product exact, only the accumulation order differs)::

    xs = float(x.reshape(M, K)) * smooth_inv
    vx, sx, gx = nvfp4_quantize(xs, per row)                  # e2m1 values, e4m3 scales per 16, fp32 [M, 1]
    A = [x_hi | x_hi | x_lo | x_lo]   B = [w_hi | w_lo | w_hi | w_lo]    # e4m3 [M, 4K], [N, 4K] (nvfp4.py)
    y = GEMM(A, 8 * gx, B, 8 * wglobal per row, bias)         # as above, out in x.dtype
    y = y + x.dtype(xs) @ lora_down.T @ lora_up.T

:func:`w4_to_e4m3`: ``sw[n] = 8 * max_g wscale[n, g] / 448`` maps the largest possible value (|q| <= 8) to e4m3's
largest, and ``w8[n, k] = e4m3(q[n, k] * (wscale[n, k // 64] / sw[n]))`` is the one new rounding: e4m3 keeps 4
significant bits, an int4 times a group-scale ratio needs up to 3 + 24 (the fp32 ratio). The other differences from
the W4A4 reference are the activations (e4m3 per token: finer than int4 per group of 64) and the low-rank product
rounded to the activation dtype before it is added.

The weight-only forms (int4, int4 with a low-rank branch, int8 / fp8 weights; the modulation linears under
SVDQuant) are in ``weight_only_forms.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .fp8_int8 import FP8_DTYPE, FP8_MAX
from .int4 import GROUP_SIZE, int4_values
from .nvfp4 import SPLIT_SHIFT, e2m1_decode, nvfp4_fp8_operand, nvfp4_quantize, unpack_fp4

aten = torch.ops.aten
GEMMS = ("scaled_mm", "reference")
ACT_QUANTS = ("graph", "kernel")  # fp8_quantize_x
LRCAT_ACTS = (*ACT_QUANTS, "mm")  # svdq_lrcat_linear_form
W4_EXPANDS = ("graph", "kernel")  # expand_w4
_F32 = torch.float32
W4_MAX = 8.0  # largest |int4| value: -8


@dataclass(frozen=True)
class LinearShape:
    """The constants a form is specialised on: x's leading dims, K, N, x's dtype (the output's), whether there is
    a bias and whether it goes into ``_scaled_mm``'s epilogue (a bf16 / fp16 bias of the output dtype; otherwise
    it is added in fp32 after the GEMM), whether the weight scale needs a cast to fp32, the rank of a low-rank
    branch (SVDQuant; 0: none)."""

    lead: Tuple[int, ...]
    k: int
    n: int
    dtype: torch.dtype
    has_bias: bool = False
    bias_in_epilogue: bool = False
    cast_wscale: bool = False
    rank: int = 0

    @classmethod
    def of(cls, x: torch.Tensor, n: int, k: int, bias: Optional[torch.Tensor], wscale: torch.Tensor,
           rank: int = 0) -> "LinearShape":
        """The shape of a linear [K -> N] on ``x`` (a real or fake tensor) with this bias and weight scale; the
        weight scale is per row (fp8: needs fp32) or per group (SVDQuant: cast by :func:`w4_to_e4m3`)."""
        epilogue = bias is not None and bias.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
        return cls(tuple(int(d) for d in x.shape[:-1]), int(k), int(n), x.dtype, bias is not None, epilogue,
                   wscale.dtype != _F32 and wscale.dim() <= 1, int(rank))

    @property
    def m(self) -> int:
        out = 1
        for d in self.lead:
            out *= d
        return out


def _rows(x: torch.Tensor, shape: LinearShape) -> torch.Tensor:
    return x if len(shape.lead) == 1 else aten.reshape.default(x, [shape.m, shape.k])


def _unrows(y: torch.Tensor, shape: LinearShape) -> torch.Tensor:
    return y if len(shape.lead) == 1 else aten.view.default(y, [*shape.lead, shape.n])


def fp8_quantize(xf: torch.Tensor, per_row: bool,
                 amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (e4m3 [M, K], fp32 scale [M, 1] per token, or [] over the tensor); ``amax``: max |xf| (of
    the scale's shape) where the graph has it already."""
    if amax is None:
        a = aten.abs.default(xf)
        amax = aten.amax.default(a, [1], True) if per_row else aten.amax.default(a)
    scale = aten.div.Tensor(amax, FP8_MAX)
    scale = aten.where.ScalarSelf(aten.eq.Scalar(scale, 0), 1.0, scale)
    # one division per token, then a multiplication per element (fp8_int8.quantize_fp8_act)
    q = aten.clamp.default(aten.mul.Tensor(xf, aten.reciprocal.default(scale)), -FP8_MAX, FP8_MAX)
    return aten._to_copy.default(q, dtype=FP8_DTYPE), scale


def fp8_quantize_x(x2d: torch.Tensor, per_row: bool, act_quant: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in its dtype -> :func:`fp8_quantize` of its fp32 values, as ATen ops (``act_quant="graph"``) or
    as the op ``dit_passes::fp8_quantize_rows`` (``"kernel"``, per_row only: one Triton kernel on CUDA reading x
    once, the same numbers; ``dispatch.fp8_act_quant``)."""
    if act_quant == "kernel" and per_row:
        out = torch.ops.dit_passes.fp8_quantize_rows.default(x2d)
        return out[0], out[1]
    if act_quant not in ACT_QUANTS:
        raise ValueError(f"fp8 activation quantization must be one of {ACT_QUANTS}, got {act_quant!r}")
    return fp8_quantize(aten._to_copy.default(x2d, dtype=_F32), per_row)


def fp8_gemm(qx: torch.Tensor, sx: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
             bias: Optional[torch.Tensor], shape: LinearShape, per_row: bool, gemm: str,
             fast_accum: bool = False) -> torch.Tensor:
    """[M, N] in ``shape.dtype`` = (qx [M, K] * sx) @ (qweight [N, K] * wscale).T + bias, through ``gemm``."""
    ws = aten._to_copy.default(wscale, dtype=_F32) if shape.cast_wscale else wscale
    if gemm == "scaled_mm":
        sw = aten.view.default(ws, [1, shape.n]) if per_row else ws
        epi = bias if shape.bias_in_epilogue else None
        # qweight [N, K] row-major: its transpose is the column-major [K, N] operand cuBLASLt / CUTLASS want
        y = aten._scaled_mm.default(qx, aten.t.default(qweight), sx, sw, epi, None, shape.dtype, fast_accum)
        if shape.has_bias and epi is None:
            y = aten._to_copy.default(aten.add.Tensor(aten._to_copy.default(y, dtype=_F32),
                                                      aten._to_copy.default(bias, dtype=_F32)), dtype=shape.dtype)
        return y
    if gemm != "reference":
        raise ValueError(f"fp8 GEMM must be one of {GEMMS}, got {gemm!r}")
    acc = aten.mm.default(aten._to_copy.default(qx, dtype=_F32),
                          aten.t.default(aten._to_copy.default(qweight, dtype=_F32)))
    if per_row:
        acc = aten.mul.Tensor(aten.mul.Tensor(acc, sx), ws)
    else:
        acc = aten.mul.Tensor(acc, aten.mul.Tensor(sx, aten.view.default(ws, [])))
    if shape.has_bias:
        acc = aten.add.Tensor(acc, aten._to_copy.default(bias, dtype=_F32))
    return aten._to_copy.default(acc, dtype=shape.dtype)


def fp8_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: Optional[torch.Tensor],
                    shape: LinearShape, granularity: str, gemm: str, fast_accum: bool = False,
                    act_quant: str = "graph") -> torch.Tensor:
    """The fp8 linear x [*lead, K] -> [*lead, N] (module docstring); ``bias`` is read only if ``shape.has_bias``;
    ``act_quant``: the activations' quantization as ATen ops or the row-quantization op (:func:`fp8_quantize_x`)."""
    per_row = granularity == "per_row"
    qx, sx = fp8_quantize_x(_rows(x, shape), per_row, act_quant)
    y = fp8_gemm(qx, sx, qweight, wscale, bias if shape.has_bias else None, shape, per_row, gemm, fast_accum)
    return _unrows(y, shape)


def w4_to_e4m3(qweight: torch.Tensor, wscale: torch.Tensor, n: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 [N, K/2] (even k in the low nibble) and bf16 group scales [N, K/64] -> (e4m3 [N, K],
    fp32 row scale [N]) with ``float(e4m3) * sw[n] ~= q * wscale`` (module docstring)."""
    ws = aten._to_copy.default(wscale, dtype=_F32)                                  # [N, G]
    sw = aten.div.Tensor(aten.mul.Tensor(aten.amax.default(ws, [1], True), W4_MAX), FP8_MAX)   # [N, 1]
    return _w4_over(qweight, ws, sw, n, k), aten.view.default(sw, [n])


def _w4_over(qweight: torch.Tensor, ws: torch.Tensor, sw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """e4m3 [N, K] of ``q * (ws / sw)`` (ws fp32 [N, G] group scales, sw fp32 [N, 1] row scale), clamped to e4m3's
    range: the one rounding both expansions make."""
    q = aten.view.default(int4_values(qweight, _F32), [n, k // GROUP_SIZE, GROUP_SIZE])
    ratio = aten.unsqueeze.default(aten.div.Tensor(ws, sw), 2)                      # [N, G, 1]
    w = aten.clamp.default(aten.mul.Tensor(q, ratio), -FP8_MAX, FP8_MAX)
    return aten._to_copy.default(aten.view.default(w, [n, k]), dtype=FP8_DTYPE)


def expand_w4(qweight: torch.Tensor, wscale: torch.Tensor, n: int, k: int,
              expand: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`w4_to_e4m3` as ATen ops (``expand="graph"``) or as the op ``dit_passes::w4_to_e4m3`` (``"kernel"``:
    one bandwidth-bound Triton kernel on CUDA, the same bytes; ``dispatch.w4_expand``)."""
    if expand == "kernel":
        out = torch.ops.dit_passes.w4_to_e4m3.default(qweight, wscale)
        return out[0], out[1]
    if expand not in W4_EXPANDS:
        raise ValueError(f"the int4 weight expansion must be one of {W4_EXPANDS}, got {expand!r}")
    return w4_to_e4m3(qweight, wscale, n, k)


def svdq_fp8_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                         lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor],
                         shape: LinearShape, gemm: str, fast_accum: bool = False,
                         expand: str = "graph") -> torch.Tensor:
    """SVDQuant's stored tensors on fp8 tensor cores (module docstring): x [*lead, K] -> [*lead, N]; ``expand``:
    the weight expansion as ATen ops or the op (:func:`expand_w4`)."""
    xs = aten.mul.Tensor(aten._to_copy.default(_rows(x, shape), dtype=_F32), smooth_inv)
    qx, sx = fp8_quantize(xs, per_row=True)
    w8, sw = expand_w4(qweight, wscale, shape.n, shape.k, expand)
    y = fp8_gemm(qx, sx, w8, sw, bias if shape.has_bias else None, shape, True, gemm, fast_accum)
    if shape.rank:
        lora_act = aten.mm.default(aten._to_copy.default(xs, dtype=shape.dtype), aten.t.default(lora_down))
        y = aten.addmm.default(y, lora_act, aten.t.default(lora_up))
    return _unrows(y, shape)


def lrcat_cols(r: int, split: bool = False) -> int:
    """The columns appended to K by :func:`svdq_lrcat_linear_form`: r (``split``: 3r, the hi / lo parts) rounded up to
    a multiple of 16 (``_scaled_mm`` wants K + cols % 16 == 0; the padding columns are zeros in both operands)."""
    return -(-r * (3 if split else 1) // 16) * 16


def _hi_lo(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 v (|v| <= 448) -> (e4m3(v), e4m3(v - e4m3(v))): the second rounding leaves ~8 significant bits."""
    hi = aten._to_copy.default(v, dtype=FP8_DTYPE)
    return hi, aten._to_copy.default(aten.sub.Tensor(v, aten._to_copy.default(hi, dtype=_F32)), dtype=FP8_DTYPE)


def _branch_cols(v: torch.Tensor, rows: int, r: int, split: bool, activation: bool) -> torch.Tensor:
    """The branch's e4m3 columns of one operand from its fp32 values v [rows, R] (clamped): [v8] or, split, [hi | lo |
    hi] (activations, A) / [hi | hi | lo] (weights, B), so that the products sum to hi*hi + lo*hi + hi*lo; zero
    columns up to :func:`lrcat_cols`."""
    if split:
        hi, lo = _hi_lo(v)
        out = aten.cat.default([hi, lo, hi] if activation else [hi, hi, lo], 1)
    else:
        out = aten._to_copy.default(v, dtype=FP8_DTYPE)
    width = r * (3 if split else 1)
    pad = lrcat_cols(r, split) - width
    # constant_pad_nd has no e4m3 kernel on every device: pad an fp32 zero block and cast it
    return out if not pad else aten.cat.default([out, aten._to_copy.default(
        aten.new_zeros.default(v, [rows, pad]), dtype=FP8_DTYPE)], 1)


def lrcat_c(lora_down: torch.Tensor, k: int) -> torch.Tensor:
    """The branch scale of the lrcat design, fp32 [R]: ``c[r] = sqrt(K) * ||lora_down[r]||_2`` (a zero row: 1)."""
    ld = aten._to_copy.default(lora_down, dtype=_F32)
    c = aten.mul.Tensor(aten.sqrt.default(aten.sum.dim_IntList(aten.mul.Tensor(ld, ld), [1])), float(k) ** 0.5)
    return aten.where.ScalarSelf(aten.eq.Scalar(c, 0), 1.0, c)


def lrcat_row_scale(wscale: torch.Tensor, lora_up: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The lrcat row scale, fp32 [N]: ``sw[n] = max(8 * max_g wscale[n, g], max_r |lora_up[n, r] * c[r]|) / 448``."""
    luc = aten.mul.Tensor(aten._to_copy.default(lora_up, dtype=_F32), c)                        # [N, R]
    wmax = aten.mul.Tensor(aten.amax.default(aten._to_copy.default(wscale, dtype=_F32), [1]), W4_MAX)
    return aten.div.Tensor(aten.maximum.default(wmax, aten.amax.default(aten.abs.default(luc), [1])), FP8_MAX)


def lrcat_scales(wscale: torch.Tensor, lora_down: torch.Tensor, lora_up: torch.Tensor,
                 k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(c fp32 [R], sw fp32 [N]) of the lrcat design (:func:`lrcat_c`, :func:`lrcat_row_scale`)."""
    c = lrcat_c(lora_down, k)
    return c, lrcat_row_scale(wscale, lora_up, c)


def lrcat_activation(x2d: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor,
                     m: int, r: int, dtype: torch.dtype, split: bool,
                     h_in_fp32: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat A operand e4m3 [M, K + cols] = [qx | qh | 0] (``split``: [qx | hi | lo | hi | 0]) and the per-token
    scale sx fp32 [M, 1] of x [M, K] (module docstring). ``h_in_fp32``: h = x.dtype(xs) @ lora_down.T accumulated
    and kept in fp32 (the specification of ``dit_passes::lrcat_quantize_rows``, whose kernel holds h in fp32
    registers), else rounded to x.dtype (one mm in x.dtype, the graph form). ``m``, ``r``, ``dtype``: x's rows,
    lora_down's rows and x's dtype as constants (the form is traced)."""
    xs = aten.mul.Tensor(aten._to_copy.default(x2d, dtype=_F32), smooth_inv)
    qx, sx = fp8_quantize(xs, per_row=True)
    xd = aten._to_copy.default(xs, dtype=dtype)
    if h_in_fp32:
        ld = aten._to_copy.default(aten._to_copy.default(lora_down, dtype=dtype), dtype=_F32)
        h = aten.mm.default(aten._to_copy.default(xd, dtype=_F32), aten.t.default(ld))
    else:
        h = aten.mm.default(xd, aten.t.default(lora_down))                                            # [M, R]
    return _lrcat_operand(qx, sx, h, c, m, r, split), sx


def lrcat_smoothed_activation(xd: torch.Tensor, h: torch.Tensor, c: torch.Tensor, m: int, r: int,
                              split: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat A operand and sx (as :func:`lrcat_activation`) from the smoothed activation xd = x.dtype(x *
    smooth_inv) [M, K] and its down projection h = xd @ lora_down.T [M, R] (the specification of
    ``dit_passes::lrcat_quantize_smoothed``): qx is quantized from xd's values, not from the fp32 product."""
    qx, sx = fp8_quantize(aten._to_copy.default(xd, dtype=_F32), per_row=True)
    return _lrcat_operand(qx, sx, h, c, m, r, split), sx


def _lrcat_operand(qx, sx, h, c, m: int, r: int, split: bool) -> torch.Tensor:
    hs = aten.clamp.default(aten.div.Tensor(aten._to_copy.default(h, dtype=_F32), aten.mul.Tensor(sx, c)),
                            -FP8_MAX, FP8_MAX)
    return aten.cat.default([qx, _branch_cols(hs, m, r, split, activation=True)], 1)


def lrcat_weight(qweight: torch.Tensor, wscale: torch.Tensor, lora_up: torch.Tensor, c: torch.Tensor, n: int, k: int,
                 r: int, expand: str = "graph", split: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat B operand e4m3 [N, K + cols] = [w8 | u8 | 0] and its row scale sw fp32 [N] (:func:`lrcat_row_scale`):
    ``w8[n, k] = e4m3(q * (wscale[n, k // 64] / sw[n]))``, ``u[n, r] = clamp(lora_up[n, r] * c[r] / sw[n], -448,
    448)`` as e4m3 (``split``: [hi | hi | lo] of it); ``expand="kernel"``: the op ``dit_passes::w4_lrcat_to_e4m3``
    (one Triton kernel on CUDA, the same bytes)."""
    if expand == "kernel":
        out = torch.ops.dit_passes.w4_lrcat_to_e4m3.default(qweight, wscale, lora_up, c, split)
        return out[0], out[1]
    if expand not in W4_EXPANDS:
        raise ValueError(f"the int4 weight expansion must be one of {W4_EXPANDS}, got {expand!r}")
    sw = lrcat_row_scale(wscale, lora_up, c)
    sw2 = aten.view.default(sw, [n, 1])
    w8 = _w4_over(qweight, aten._to_copy.default(wscale, dtype=_F32), sw2, n, k)
    u = aten.div.Tensor(aten.mul.Tensor(aten._to_copy.default(lora_up, dtype=_F32), c), sw2)
    u8 = _branch_cols(aten.clamp.default(u, -FP8_MAX, FP8_MAX), n, r, split, activation=False)
    return aten.cat.default([w8, u8], 1), sw


def svdq_lrcat_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                           lora_up: torch.Tensor, smooth_inv: torch.Tensor, bias: Optional[torch.Tensor],
                           shape: LinearShape, gemm: str, fast_accum: bool = False, expand: str = "graph",
                           split: bool = False, act_quant: str = "graph") -> torch.Tensor:
    """SVDQuant's stored tensors on fp8 tensor cores with the low-rank branch in the GEMM's K (module docstring,
    lrcat; ``split``: the branch's operands as e4m3 hi / lo pairs, 3R columns): x [*lead, K] -> [*lead, N];
    ``act_quant="kernel"``: the A operand by the op ``dit_passes::lrcat_quantize_rows`` (two Triton kernels on CUDA;
    h kept in fp32, :func:`lrcat_activation`); ``"mm"``: the smoothed activation in x.dtype (which Inductor writes in
    its producer), h by ``aten.mm`` (cuBLAS), the rest by ``dit_passes::lrcat_quantize_smoothed`` (one row pass,
    :func:`lrcat_smoothed_activation`)."""
    r = shape.rank
    if r == 0:  # no branch to fold
        return svdq_fp8_linear_form(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, shape, gemm, fast_accum,
                                    expand)
    c = lrcat_c(lora_down, shape.k)
    if act_quant == "kernel":
        out = torch.ops.dit_passes.lrcat_quantize_rows.default(_rows(x, shape), smooth_inv, lora_down, c, split)
        a8, sx = out[0], out[1]
    elif act_quant == "mm":
        xd = aten._to_copy.default(aten.mul.Tensor(aten._to_copy.default(_rows(x, shape), dtype=_F32), smooth_inv),
                                   dtype=shape.dtype)
        h = aten.mm.default(xd, aten.t.default(lora_down))
        out = torch.ops.dit_passes.lrcat_quantize_smoothed.default(xd, h, c, split)
        a8, sx = out[0], out[1]
    elif act_quant == "graph":
        a8, sx = lrcat_activation(_rows(x, shape), smooth_inv, lora_down, c, shape.m, r, shape.dtype, split,
                                  h_in_fp32=False)
    else:
        raise ValueError(f"the lrcat A operand's form must be one of {LRCAT_ACTS}, got {act_quant!r}")
    b8, sw = lrcat_weight(qweight, wscale, lora_up, c, shape.n, shape.k, r, expand, split)
    y = fp8_gemm(a8, sx, b8, sw, bias if shape.has_bias else None, shape, True, gemm, fast_accum)
    return _unrows(y, shape)


def svdq_nvfp4_fp8_linear_form(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wglobal: torch.Tensor,
                               lora_down: torch.Tensor, lora_up: torch.Tensor, smooth_inv: torch.Tensor,
                               bias: Optional[torch.Tensor], shape: LinearShape, gemm: str,
                               fast_accum: bool = False) -> torch.Tensor:
    """NVFP4 SVDQuant's stored tensors on fp8 tensor cores, exact products (module docstring): x [*lead, K] ->
    [*lead, N]."""
    xs = aten.mul.Tensor(aten._to_copy.default(_rows(x, shape), dtype=_F32), smooth_inv)
    vx, sx, gx = nvfp4_quantize(xs, True, (shape.m, shape.k))
    a8 = nvfp4_fp8_operand(vx, sx, False, (shape.m, shape.k))
    b8 = nvfp4_fp8_operand(e2m1_decode(unpack_fp4(qweight)), wscale, True, (shape.n, shape.k))
    # each operand carries a 2**-3: its row scales carry the 2**3 back
    sa = aten.mul.Tensor(gx, 1.0 / SPLIT_SHIFT)
    sb = aten.repeat.default(aten.mul.Tensor(aten._to_copy.default(wglobal, dtype=_F32), 1.0 / SPLIT_SHIFT),
                             [shape.n])
    y = fp8_gemm(a8, sa, b8, sb, bias if shape.has_bias else None, shape, True, gemm, fast_accum)
    if shape.rank:
        lora_act = aten.mm.default(aten._to_copy.default(xs, dtype=shape.dtype), aten.t.default(lora_down))
        y = aten.addmm.default(y, lora_act, aten.t.default(lora_up))
    return _unrows(y, shape)
