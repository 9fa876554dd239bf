"""Quantized-linear substitution as fx patterns: the ``aten.linear`` pattern and one replacement per quant kind.

The pattern and the replacements are plain PyTorch functions. :func:`replace_linears` traces them
(``torch.fx.symbolic_trace``) and rewrites a graph with torch.fx's subgraph rewriter
(``torch.fx.subgraph_rewriter.replace_pattern_with_filters``): every match of :func:`linear_pattern`
(or :func:`linear_pattern_no_bias`) whose linear node was selected is replaced by the traced replacement of
the kind, its tensor arguments bound to per-linear buffers of the graph module reached by ``get_attr``.

Per match (before -> after)::

    y = torch.ops.aten.linear.default(x, w, b)
    ->  qw = self.<prefix>.qweight; ws = self.<prefix>.wscale; ...; b2 = self.<prefix>.bias
        y = torch.ops.dit_passes.svdq_w4a4_linear.default(x, qw, ws, ld, lu, si, b2)

A replacement takes the pattern's ``x`` plus the quantized tensors in the order of
``QUANT_KINDS[kind].tensor_args`` (``bias`` may be absent: None). A kind with an ``inline`` chooser is written as
a graph form instead of its op where x's fake value is known: the chooser (``dispatch.py`` decides the GEMM)
returns the replacement, plain ATen ops from ``dit_passes.quant.graph_forms`` specialised on the linear's shapes,
e.g. for ``fp8_per_row`` on an H200::

    ->  qw = self.<prefix>.qweight; ws = self.<prefix>.wscale; b2 = self.<prefix>.bias
        xf = aten._to_copy(aten.reshape(x, [M, K]), dtype=float32)
        sx = aten.where.ScalarSelf(aten.eq(s, 0), 1.0, s)  where  s = aten.amax(aten.abs(xf), [1], True) / 448
        qx = aten._to_copy(aten.clamp(xf / sx, -448, 448), dtype=float8_e4m3fn)
        y = aten.view(aten._scaled_mm(qx, aten.t(qw), sx, aten.view(ws, [1, N]), b2, None, bfloat16, False), [B, S, N])

Which form each linear takes is the pass's ``forms.QuantForms`` (its arguments, e.g. ``SVDQuantW4A4(form=...)``),
resolved per linear by ``dispatch.py``. SVDQuant's kind can also be written as
``torch.ops.dit_passes.svdq_w4a8_linear.default(x, ..., b2, fold)`` (the fused W4A8 kernels; ``form="w4a8"`` /
``"w4a8_fold"``, ``dispatch.svdq_form``), or as the fp8 form with the low-rank branch in the GEMM's K
(``form="lrcat"``, ``graph_forms.svdq_lrcat_linear_form``).

A kind without an op (``w8a16`` / ``fp8_weight_only`` / ``w4a16`` / ``w4a16_lr`` / ``nvfp4_weight_only``,
weight-only int8 / fp8 / int4 / int4 + low-rank / NVFP4) is its graph form, shape-generic (on a few rows of x,
where ``weight_only_form`` asks, as a multiply-and-sum instead of ``aten.linear``,
``weight_only_forms.dequantized_linear``, or for int4 as the op ``dit_passes::w4a16_rows_linear``): the int8 or e4m3
values scaled per row (``weight_only_forms.w8a16_linear_form``), the int4 values unpacked and scaled per group
(``weight_only_forms.w4a16_linear_form``) or the e2m1 values unpacked and scaled per block of 16 and by the global scale
(``nvfp4_weight_only.nvfp4_weight_only_linear_form``), then ``aten.linear`` on the dequantized weight
(``w4a16_lr``: plus the low-rank branch, ``weight_only_forms.w4a16_lr_linear_form``).

Equal inserted nodes are merged (the forms are pure ATen ops): linears reading one activation quantize it once.
Every inserted node gets ``meta["val"]`` when the graph carries fake values; every inserted call also the replaced
node's ``nn_module_stack`` / ``dit_module_path`` / ``stack_trace`` and ``meta["dit_pattern"]`` (the name of the
pattern it replaced); the node that takes the linear's place also ``meta["dit_quant"]`` (the kind).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.subgraph_rewriter import ReplacedPatterns, replace_pattern_with_filters

import dit_passes.quant.custom_ops  # noqa: F401  (registers torch.ops.dit_passes.*)
import dit_passes.quant.lut_ops  # noqa: F401  (registers the LUT form's ops)
from dit_passes.infra.graph_utils import set_val
from dit_passes.quant import dispatch, lut_dispatch
from dit_passes.quant.forms import DEFAULT_FORMS, QuantForms
from dit_passes.quant.graph_forms import (LinearShape, fp8_linear_form, lrcat_cols, svdq_fp8_linear_form,
                                          svdq_lrcat_linear_form, svdq_nvfp4_fp8_linear_form)
from dit_passes.quant.nvfp4_weight_only import nvfp4_weight_only_linear_form
from dit_passes.quant.w4_lut import svdq_lut_linear_form
from dit_passes.quant.weight_only_forms import (w4a16_linear_form, w4a16_lr_linear_form, w4a16_rows_op_form,
                                                w8a16_linear_form)


def linear_pattern(x, weight, bias):
    return torch.ops.aten.linear.default(x, weight, bias)


def linear_pattern_no_bias(x, weight):
    return torch.ops.aten.linear.default(x, weight)


def svdq_w4a4_replacement(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
    return torch.ops.dit_passes.svdq_w4a4_linear.default(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias)


@functools.lru_cache(maxsize=None)
def svdq_w4a4_backend_replacement(backend: str) -> Callable:
    """The W4A4 op on the CUDA kernel ``backend`` names (``dispatch.OP_BACKENDS``), as a replacement."""
    def svdq_w4a4_on(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
        return torch.ops.dit_passes.svdq_w4a4_linear.default(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias,
                                                             backend)
    return svdq_w4a4_on


def _svdq_op(forms: QuantForms) -> Callable:
    backend = dispatch.op_backend(forms.form)
    return svdq_w4a4_replacement if backend == "auto" else svdq_w4a4_backend_replacement(backend)


def svdq_nvfp4_replacement(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias):
    return torch.ops.dit_passes.svdq_nvfp4_linear.default(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv,
                                                          bias)


def fp8_per_row_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.fp8_linear.default(x, qweight, wscale, bias, "per_row")


def fp8_per_tensor_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.fp8_linear.default(x, qweight, wscale, bias, "per_tensor")


def int8_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.int8_linear.default(x, qweight, wscale, bias)


def int8_per_tensor_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.int8_tensor_linear.default(x, qweight, wscale, bias)


def fp8_per_block_replacement(x, qweight, wscale, bias):
    return torch.ops.dit_passes.fp8_block_linear.default(x, qweight, wscale, bias)


def w4a16_replacement(x, qweight, wscale, bias):
    return w4a16_linear_form(x, qweight, wscale, bias)


def w4a16_lr_replacement(x, qweight, wscale, lora_down, lora_up, bias):
    return w4a16_lr_linear_form(x, qweight, wscale, lora_down, lora_up, bias)


def w8a16_replacement(x, qweight, wscale, bias):
    return w8a16_linear_form(x, qweight, wscale, bias)


def nvfp4_weight_only_replacement(x, qweight, wscale, wglobal, bias):
    return nvfp4_weight_only_linear_form(x, qweight, wscale, wglobal, bias)


@functools.lru_cache(maxsize=None)
def weight_only_rows_replacement(kind: str, has_bias: bool) -> Callable:
    """A weight-only kind's form as the multiply-and-sum over a few rows (``weight_only_forms.dequantized_linear``),
    as a replacement; ``has_bias``: whether the linear has a bias (the sum adds it itself, so an absent one is not
    read)."""
    def b(bias):
        return bias if has_bias else None

    def w8a16_rows(x, qweight, wscale, bias):
        return w8a16_linear_form(x, qweight, wscale, b(bias), rows=True)

    def w4a16_rows(x, qweight, wscale, bias):
        return w4a16_linear_form(x, qweight, wscale, b(bias), rows=True)

    def w4a16_lr_rows(x, qweight, wscale, lora_down, lora_up, bias):
        return w4a16_lr_linear_form(x, qweight, wscale, lora_down, lora_up, b(bias), rows=True)

    def nvfp4_weight_only_rows(x, qweight, wscale, wglobal, bias):
        return nvfp4_weight_only_linear_form(x, qweight, wscale, wglobal, b(bias), rows=True)

    return {"w8a16": w8a16_rows, "fp8_weight_only": w8a16_rows, "w4a16": w4a16_rows, "w4a16_lr": w4a16_lr_rows,
            "nvfp4_weight_only": nvfp4_weight_only_rows}[kind]


@functools.lru_cache(maxsize=None)
def w4a16_op_replacement(kind: str, shape: LinearShape) -> Callable:
    """An int4 weight-only kind (``w4a16`` / ``w4a16_lr``) on a few rows with the op ``dit_passes::w4a16_rows_linear``
    (``weight_only_forms.w4a16_rows_op_form``) for x of ``shape``, as a replacement."""
    def w4a16_op(x, qweight, wscale, bias):
        return w4a16_rows_op_form(x, qweight, wscale, bias, shape)

    def w4a16_lr_op(x, qweight, wscale, lora_down, lora_up, bias):
        return w4a16_lr_linear_form(x, qweight, wscale, lora_down, lora_up, bias, op_shape=shape)

    return {"w4a16": w4a16_op, "w4a16_lr": w4a16_lr_op}[kind]


def _weight_only_inline(kind: str) -> Callable:
    def choose(x_val: torch.Tensor, tensors: Dict[str, torch.Tensor], forms: QuantForms) -> Optional[Callable]:
        int4 = kind in ("w4a16", "w4a16_lr")
        form = dispatch.weight_only_form(x_val, int4, forms.weight_only_form)
        if form == "linear":
            return None
        if form == "kernel" and int4:
            n, k = tensors["qweight"].shape[0], 2 * tensors["qweight"].shape[1]
            return w4a16_op_replacement(kind, LinearShape.of(x_val, n, k, tensors.get("bias"), tensors["wscale"]))
        return weight_only_rows_replacement(kind, tensors.get("bias") is not None)
    return choose


@functools.lru_cache(maxsize=None)
def fp8_form_replacement(granularity: str, gemm: str, fast_accum: bool, shape: LinearShape,
                         act_quant: str = "graph") -> Callable:
    """The fp8 linear's graph form for one shape and GEMM, as a replacement (the same function object for equal
    arguments, so each is traced once); ``act_quant="kernel"``: its activations through the op
    ``dit_passes::fp8_quantize_rows``."""
    def fp8_form(x, qweight, wscale, bias):
        return fp8_linear_form(x, qweight, wscale, bias, shape, granularity, gemm, fast_accum, act_quant)
    return fp8_form


def _fp8_inline(granularity: str) -> Callable:
    def choose(x_val: torch.Tensor, tensors: Dict[str, torch.Tensor], forms: QuantForms) -> Callable:
        n, k = tensors["qweight"].shape
        gemm = dispatch.fp8_gemm_backend(x_val, n, k, granularity)
        shape = LinearShape.of(x_val, n, k, tensors.get("bias"), tensors["wscale"])
        fast = gemm == "scaled_mm" and dispatch.fp8_fast_accum(forms.fast_accum, x_val)
        return fp8_form_replacement(granularity, gemm, fast, shape,
                                    dispatch.fp8_act_quant(granularity, x_val, forms.act_quant))
    return choose


@functools.lru_cache(maxsize=None)
def svdq_fp8_form_replacement(gemm: str, fast_accum: bool, shape: LinearShape, expand: str = "graph") -> Callable:
    """SVDQuant's W4A8 graph form (fp8 tensor cores) for one shape and GEMM, as a replacement; ``expand="kernel"``:
    its weights expanded by the op ``dit_passes::w4_to_e4m3``."""
    def svdq_fp8_form(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
        return svdq_fp8_linear_form(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, shape, gemm, fast_accum,
                                    expand)
    return svdq_fp8_form


@functools.lru_cache(maxsize=None)
def svdq_lrcat_form_replacement(gemm: str, fast_accum: bool, shape: LinearShape, expand: str = "graph",
                                split: bool = False, act_quant: str = "graph") -> Callable:
    """SVDQuant's fp8 form with the low-rank branch in the GEMM's K (``graph_forms.svdq_lrcat_linear_form``; ``split``:
    hi / lo branch operands) for one shape and GEMM, as a replacement; ``expand="kernel"``: its B operand by the op
    ``dit_passes::w4_lrcat_to_e4m3``; ``act_quant="kernel"``: its A operand by the op
    ``dit_passes::lrcat_quantize_rows``."""
    def svdq_lrcat_form(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
        return svdq_lrcat_linear_form(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias, shape, gemm,
                                      fast_accum, expand, split, act_quant)
    return svdq_lrcat_form


def svdq_w4a8_replacement(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
    return torch.ops.dit_passes.svdq_w4a8_linear.default(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias,
                                                         False)


def svdq_w4a8_fold_replacement(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias):
    return torch.ops.dit_passes.svdq_w4a8_linear.default(x, qweight, wscale, lora_down, lora_up, smooth_inv, bias,
                                                         True)


_W4A8_REPLACEMENTS = {"w4a8": svdq_w4a8_replacement, "w4a8_fold": svdq_w4a8_fold_replacement}


def _svdq_inline(x_val: torch.Tensor, tensors: Dict[str, torch.Tensor], forms: QuantForms) -> Optional[Callable]:
    qweight = tensors["qweight"]
    form = dispatch.svdq_form(x_val, qweight, forms.form)
    if form in _W4A8_REPLACEMENTS:  # the fused W4A8 kernels' op (exact or folded group scales)
        return _W4A8_REPLACEMENTS[form]
    if form != "fp8" and form not in dispatch.LRCAT_FORMS:
        return None  # the op (QuantKind.op_for)
    n, k, r = qweight.shape[0], 2 * qweight.shape[1], tensors["lora_down"].shape[0]
    split = form == "lrcat_split"
    # lrcat's GEMM runs over K + the branch's columns
    gemm = dispatch.fp8_gemm_backend(x_val, n, k + (lrcat_cols(r, split) if form != "fp8" else 0), "per_row")
    shape = LinearShape.of(x_val, n, k, tensors.get("bias"), tensors["wscale"], rank=r)
    fast = gemm == "scaled_mm" and dispatch.fp8_fast_accum(forms.fast_accum, x_val)
    expand = dispatch.w4_expand(x_val, forms.w4_expand)
    if form == "fp8":
        return svdq_fp8_form_replacement(gemm, fast, shape, expand)
    return svdq_lrcat_form_replacement(gemm, fast, shape, expand, split,
                                       dispatch.lrcat_act_quant(x_val, forms.act_quant, forms.lrcat_act))


@functools.lru_cache(maxsize=None)
def svdq_nvfp4_fp8_form_replacement(gemm: str, fast_accum: bool, shape: LinearShape) -> Callable:
    """NVFP4 SVDQuant's exact split GEMM on fp8 tensor cores for one shape and GEMM, as a replacement."""
    def svdq_nvfp4_fp8_form(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias):
        return svdq_nvfp4_fp8_linear_form(x, qweight, wscale, wglobal, lora_down, lora_up, smooth_inv, bias, shape,
                                          gemm, fast_accum)
    return svdq_nvfp4_fp8_form


def _nvfp4_inline(x_val: torch.Tensor, tensors: Dict[str, torch.Tensor], forms: QuantForms) -> Optional[Callable]:
    qweight = tensors["qweight"]
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if dispatch.nvfp4_form(x_val, n, k, forms.form) != "fp8":
        return None
    gemm = dispatch.fp8_gemm_backend(x_val, n, 4 * k, "per_row")
    shape = LinearShape.of(x_val, n, k, tensors.get("bias"), tensors["wscale"], rank=tensors["lora_down"].shape[0])
    fast = gemm == "scaled_mm" and dispatch.fp8_fast_accum(forms.fast_accum, x_val)
    return svdq_nvfp4_fp8_form_replacement(gemm, fast, shape)


def svdq_lut_replacement(x, codes, tables, sw, c, lora_down, smooth_inv, bias):
    return torch.ops.dit_passes.svdq_lut_linear.default(x, codes, tables, sw, c, lora_down, smooth_inv, bias)


@functools.lru_cache(maxsize=None)
def svdq_lut_settings_replacement(act_quant: str, lut_act: str, planes: int) -> Callable:
    """The LUT op with the pass's settings (``dit_passes::svdq_lut_linear``'s last arguments), as a replacement."""
    def svdq_lut_with(x, codes, tables, sw, c, lora_down, smooth_inv, bias):
        return torch.ops.dit_passes.svdq_lut_linear.default(x, codes, tables, sw, c, lora_down, smooth_inv, bias,
                                                            act_quant, lut_act, planes)
    return svdq_lut_with


def _lut_op(forms: QuantForms) -> Callable:
    if (forms.act_quant, forms.lut_act, forms.lut_planes) == ("auto", "auto", None):
        return svdq_lut_replacement
    return svdq_lut_settings_replacement(forms.act_quant, forms.lut_act, forms.lut_planes or 0)


@functools.lru_cache(maxsize=None)
def svdq_lut_form_replacement(shape: LinearShape, act: str, planes: int) -> Callable:
    """SVDQuant's lookup-table form (``w4_lut.svdq_lut_linear_form``) for one shape, as a replacement; ``act``:
    how its A operand is written (``lut_dispatch.lut_act``); ``planes``: the branch's columns."""
    def svdq_lut_form(x, codes, tables, sw, c, lora_down, smooth_inv, bias):
        return svdq_lut_linear_form(x, codes, tables, sw, c, lora_down, smooth_inv, bias, shape, act, planes)
    return svdq_lut_form


def _lut_inline(x_val: torch.Tensor, tensors: Dict[str, torch.Tensor], forms: QuantForms) -> Callable:
    n, k, r = tensors["codes"].shape[0], tensors["smooth_inv"].shape[0], tensors["lora_down"].shape[0]
    shape = LinearShape.of(x_val, n, k, tensors.get("bias"), tensors["sw"], rank=r)
    return svdq_lut_form_replacement(shape, lut_dispatch.lut_act(x_val, forms.act_quant, forms.lut_act),
                                     lut_dispatch.lut_planes(forms.lut_planes))


@dataclass(frozen=True)
class QuantKind:
    """One quantized linear: its replacement function, the op it calls (None: the replacement is a graph form of
    plain ATen ops) and the names of its tensor arguments after x (the keys of the prepared weight's
    ``tensors()``; ``bias`` may be absent). ``inline``, when set: ``(x's fake value, tensors, forms) -> replacement
    or None``, the graph form to write instead of the op (None: the op). ``op_for``, when set: ``forms -> the op's
    replacement`` where the pass's settings are arguments of the op (default: ``replacement``)."""

    replacement: Callable
    op: Optional[torch._ops.OpOverload]
    tensor_args: Tuple[str, ...]
    inline: Optional[Callable[[torch.Tensor, Dict[str, torch.Tensor], QuantForms], Optional[Callable]]] = None
    op_for: Optional[Callable[[QuantForms], Callable]] = None

    def op_replacement(self, forms: QuantForms) -> Callable:
        return self.replacement if self.op_for is None else self.op_for(forms)


_8BIT_ARGS = ("qweight", "wscale", "bias")
QUANT_KINDS: Dict[str, QuantKind] = {
    "svdq_w4a4": QuantKind(svdq_w4a4_replacement, torch.ops.dit_passes.svdq_w4a4_linear.default,
                           ("qweight", "wscale", "lora_down", "lora_up", "smooth_inv", "bias"), _svdq_inline, _svdq_op),
    # SVDQuant stored for the lookup-table GEMM (w4_lut.to_lut_table; SVDQuantW4A4 on Hopper, lut_dispatch.svdq_lut)
    "svdq_lut": QuantKind(svdq_lut_replacement, torch.ops.dit_passes.svdq_lut_linear.default,
                          ("codes", "tables", "sw", "c", "lora_down", "smooth_inv", "bias"), _lut_inline, _lut_op),
    "svdq_nvfp4": QuantKind(svdq_nvfp4_replacement, torch.ops.dit_passes.svdq_nvfp4_linear.default,
                            ("qweight", "wscale", "wglobal", "lora_down", "lora_up", "smooth_inv", "bias"),
                            _nvfp4_inline),
    "fp8_per_row": QuantKind(fp8_per_row_replacement, torch.ops.dit_passes.fp8_linear.default, _8BIT_ARGS,
                             _fp8_inline("per_row")),
    "fp8_per_tensor": QuantKind(fp8_per_tensor_replacement, torch.ops.dit_passes.fp8_linear.default, _8BIT_ARGS,
                                _fp8_inline("per_tensor")),
    "int8_per_row": QuantKind(int8_replacement, torch.ops.dit_passes.int8_linear.default, _8BIT_ARGS),
    "int8_per_tensor": QuantKind(int8_per_tensor_replacement, torch.ops.dit_passes.int8_tensor_linear.default,
                                 _8BIT_ARGS),
    "fp8_per_block": QuantKind(fp8_per_block_replacement, torch.ops.dit_passes.fp8_block_linear.default, _8BIT_ARGS),
    # weight-only int8 / fp8 / int4 (the modulation linears under SVDQuant; Int8Linear / Fp8Linear with
    # weight_only=True): a graph form, shape-generic, or on a few rows the multiply-and-sum or (int4) the GEMV op
    # dit_passes::w4a16_rows_linear (dispatch.weight_only_form). fp8 per row dequantizes as int8 per row does.
    "w8a16": QuantKind(w8a16_replacement, None, _8BIT_ARGS, _weight_only_inline("w8a16")),
    "fp8_weight_only": QuantKind(w8a16_replacement, None, _8BIT_ARGS, _weight_only_inline("fp8_weight_only")),
    "w4a16": QuantKind(w4a16_replacement, None, _8BIT_ARGS, _weight_only_inline("w4a16")),
    "w4a16_lr": QuantKind(w4a16_lr_replacement, None, ("qweight", "wscale", "lora_down", "lora_up", "bias"),
                          _weight_only_inline("w4a16_lr")),
    # weight-only NVFP4 (cache-dit's nvfp4_weight_only): e2m1 values, e4m3 scales per 16, the fp32 global scale
    "nvfp4_weight_only": QuantKind(nvfp4_weight_only_replacement, None, ("qweight", "wscale", "wglobal", "bias"),
                                   _weight_only_inline("nvfp4_weight_only")),
}
PATTERNS = (linear_pattern, linear_pattern_no_bias)
_META_KEYS = ("nn_module_stack", "dit_module_path", "stack_trace")


@functools.lru_cache(maxsize=None)
def traced(fn: Callable) -> fx.GraphModule:
    """``fn`` traced by ``torch.fx.symbolic_trace`` (once per function)."""
    return fx.symbolic_trace(fn)


# A target: the linear node -> (attribute prefix of its buffers, {tensor arg name: tensor}).
Targets = Dict[fx.Node, Tuple[str, Dict[str, torch.Tensor]]]


def replace_linears(gm: fx.GraphModule, kind: str, targets: Targets, forms: QuantForms = DEFAULT_FORMS
                    ) -> List[ReplacedPatterns]:
    """Replace every ``aten.linear`` node of ``targets`` by the quantized op ``kind`` (module docstring), in the
    forms ``forms`` asks (the pass's settings).

    The tensors become buffers ``<prefix>.<name>`` of ``gm``; the original weights stay attributes (remove
    them and dead ``get_attr`` nodes afterwards to free memory). Returns the rewriter's matches, one per
    target; a target that is not an ``aten.linear`` matching the pattern is refused before any rewrite.
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"unknown quantized linear kind {kind!r}; one of {sorted(QUANT_KINDS)}")
    spec = QUANT_KINDS[kind]
    for node, (_, tensors) in targets.items():
        if node.op != "call_function" or node.target != torch.ops.aten.linear.default:
            raise ValueError(f"{node.format_node()} is not an aten.linear node")
        missing = [a for a in spec.tensor_args if a != "bias" and a not in tensors]
        if missing:
            raise KeyError(f"{kind} needs tensors {missing}; got {sorted(tensors)}")
    done: List[ReplacedPatterns] = []
    for pattern in PATTERNS:
        def selected(match, original_graph, pattern_graph) -> bool:
            return match.returning_nodes[0] in targets

        def build(match, original_graph, pattern_graph) -> fx.Graph:
            node = match.returning_nodes[0]
            prefix, tensors = targets[node]
            replacement = traced(replacement_for(spec, node, tensors, forms))
            return _replacement_graph(gm, replacement, pattern_graph, prefix, tensors, spec)

        matches = replace_pattern_with_filters(gm, traced(pattern), match_filters=[selected],
                                               replacement_callback=build)
        for m in matches:
            _finish_meta(m, pattern.__name__, kind)
        done += matches
    _share_equal_nodes(gm.graph, {n for m in done for n in m.replacements if n.op == "call_function"})
    if len(done) != len(targets):
        raise ValueError(f"{len(targets) - len(done)} selected linear node(s) did not match the aten.linear pattern")
    return done


def _frozen(v):
    return tuple(_frozen(a) for a in v) if isinstance(v, (list, tuple)) else v


def _block_of(n: fx.Node) -> str:
    """``transformer_blocks.3`` of ``transformer_blocks.3.attn.to_q`` (up to the first list index)."""
    parts = n.meta.get("dit_module_path", "").split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), len(parts) - 1)
    return ".".join(parts[:i + 1])


def _share_equal_nodes(graph: fx.Graph, inserted: set) -> int:
    """Merge inserted nodes of one block that compute the same op on the same arguments (the graph forms are pure
    ATen ops): linears reading one activation (q, k and v) then quantize it once. Never across blocks, so each
    block keeps its own program. Returns the number of nodes removed."""
    seen: Dict[tuple, fx.Node] = {}
    removed = 0
    for n in list(graph.nodes):
        if n not in inserted:
            continue
        key = (_block_of(n), n.target, _frozen(n.args), _frozen(tuple(sorted(n.kwargs.items()))))
        first = seen.setdefault(key, n)
        if first is not n:
            n.replace_all_uses_with(first)
            graph.erase_node(n)
            removed += 1
    return removed


def replacement_for(spec: QuantKind, node: fx.Node, tensors: Dict[str, torch.Tensor],
                    forms: QuantForms = DEFAULT_FORMS) -> Callable:
    """The replacement of the linear ``node``: the kind's graph form where it has one and x's fake value is known,
    else the op's (both as ``forms`` asks)."""
    x_val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if spec.inline is None or not isinstance(x_val, torch.Tensor):
        return spec.op_replacement(forms)
    return spec.inline(x_val, tensors, forms) or spec.op_replacement(forms)


def replace_linear_node(gm: fx.GraphModule, node: fx.Node, kind: str, tensors: Dict[str, torch.Tensor],
                        attr_prefix: str, forms: QuantForms = DEFAULT_FORMS) -> fx.Node:
    """:func:`replace_linears` for one node; returns the node that takes its place (the op, or the last node of
    the graph form)."""
    (match,) = replace_linears(gm, kind, {node: (attr_prefix, tensors)}, forms)
    return [n for n in match.replacements if n.op == "call_function"][-1]


def _replacement_graph(gm: fx.GraphModule, replacement: fx.GraphModule, pattern_graph: fx.Graph, prefix: str,
                       tensors: Dict[str, torch.Tensor], spec: QuantKind) -> fx.Graph:
    """The kind's traced replacement with its tensor arguments as ``get_attr`` of new buffers; its
    placeholders are the pattern's (x, weight[, bias]), as the rewriter binds them."""
    g = fx.Graph()
    inputs = [g.placeholder(n.name) for n in pattern_graph.nodes if n.op == "placeholder"]
    x_ph, *tensor_phs = [n for n in replacement.graph.nodes if n.op == "placeholder"]
    val_map: Dict[fx.Node, Optional[fx.Node]] = {x_ph: inputs[0]}
    for ph, name in zip(tensor_phs, spec.tensor_args):
        t = tensors.get(name)
        if t is None:
            val_map[ph] = None
            continue
        _register_buffer(gm, f"{prefix}.{name}", t)
        val_map[ph] = g.get_attr(f"{prefix}.{name}")
    g.output(g.graph_copy(replacement.graph, val_map))
    return g


def _finish_meta(match: ReplacedPatterns, pattern_name: str, kind: str) -> None:
    old = match.nodes_map[match.anchor]  # the replaced linear (erased, its meta still readable)
    has_val = "val" in old.meta
    for new in match.replacements:
        if new.op == "get_attr" and has_val:
            new.meta["val"] = _fake_like(old, _attr(new.graph.owning_module, new.target))
    # the rewriter lists the replacements in the order graph_copy inserted them: topological, so each node's
    # inputs have their values before set_val runs it
    calls = [n for n in match.replacements if n.op == "call_function"]
    for new in calls:
        new.meta.update({k: old.meta[k] for k in _META_KEYS if k in old.meta})
        new.meta["dit_pattern"] = pattern_name
        if has_val:
            set_val(new)
    calls[-1].meta["dit_quant"] = kind


def _attr(gm: fx.GraphModule, target: str) -> torch.Tensor:
    mod = gm
    for p in target.split("."):
        mod = getattr(mod, p)
    return mod


def _register_buffer(gm: fx.GraphModule, target: str, t: torch.Tensor) -> None:
    *parents, leaf = target.split(".")
    mod = gm
    for p in parents:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if hasattr(mod, leaf) and leaf not in mod._buffers:
        raise ValueError(f"{target} already exists on the graph module and is not a buffer")
    mod.register_buffer(leaf, t)


def _fake_like(node: fx.Node, t: torch.Tensor):
    """A fake tensor for ``t`` in the fake mode of the graph's values."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([node.meta["val"]])
    return mode.from_tensor(t, static_shapes=True) if mode is not None else t
