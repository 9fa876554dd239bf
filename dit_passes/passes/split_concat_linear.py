"""SplitConcatLinear: a linear over a concatenation becomes one GEMM per part, summed; no concatenated copy.

Why: ``linear(cat([a, b], -1), w, bias)`` first copies a and b into one buffer the GEMM then reads. FLUX's
single-stream block does this with its attention output and its MLP's hidden state, 4608 x 15360 bf16 (141 MB)
per block, 38 times a step (with ``FuseLinearGelu``, the step without that copy on an H100:
bench/results/quant_step_epilogues_h100.json). Since
``cat([a, b]) @ w.T == a @ w[:, :ka].T + b @ w[:, ka:].T``, each part can be read where it already is: the weight's
column slices are views (same storage, leading dimension K), which cuBLAS reads without a copy (Inductor passes
them to the GEMM as reinterpreted views, and feeds the first product to the second GEMM as its C operand).

Contract: phase ``EPILOGUES`` (after ``QUANTIZE``: only plain linears are left to split; a quantized one keeps its
one GEMM). Matches ``aten.linear(aten.cat(parts, dim=last), w[, bias])`` where the concatenation's only readers
are such linears, w is 2-D with K = the parts' total width, and every slice starts 16-byte aligned (cuBLAS's fast
path needs aligned pointers; others are left, counted). The linear may read the concatenation through a chain of
reshapes (view, reshape, _unsafe_view, flatten, unsqueeze, squeeze) that each keep the last dim's size: a
row-major reshape that keeps the last dim only regroups the leading dims, so column j of the result is column j
of the concatenation; each part then gets the chain's leading dims (one ``aten.reshape`` per part, a view where
the part's strides allow one, from the shapes in ``meta["val"]``). A chain that changes the last dim, or has
symbolic shapes, is left, counted. Holds each weight once: the slices are views of the same attribute. Exact up
to the order of the K sum (fp32: ~1e-7 relative).

Before (a FLUX single-stream block)::

    cat_14 = aten.cat.default([flatten_8, gelu_4], 2)                      # [1, 4608, 3072 + 12288]
    linear_38 = aten.linear.default(cat_14, proj_out_weight, proj_out_bias)

After::

    slice_1 = aten.slice.Tensor(proj_out_weight, 1, 0, 3072)
    linear_a = aten.linear.default(flatten_8, slice_1, proj_out_bias)
    slice_2 = aten.slice.Tensor(proj_out_weight, 1, 3072, 15360)
    linear_b = aten.linear.default(gelu_4, slice_2)
    add = aten.add.Tensor(linear_a, linear_b)

Through a reshape of the leading dims (Wan2.2-TI2V's timestep embedding, a timestep per token)::

    cat_3 = aten.cat.default([slice_7, slice_8], -1)                      # [32, 16 + 16]
    view_10 = aten.view.default(cat_3, [1, 32, 32])
    linear = aten.linear.default(view_10, linear_1_weight, linear_1_bias)

After::

    reshape_a = aten.reshape.default(slice_7, [1, 32, 16])
    slice_1 = aten.slice.Tensor(linear_1_weight, 1, 0, 16)
    linear_a = aten.linear.default(reshape_a, slice_1, linear_1_bias)
    reshape_b = aten.reshape.default(slice_8, [1, 32, 16])
    slice_2 = aten.slice.Tensor(linear_1_weight, 1, 16, 32)
    linear_b = aten.linear.default(reshape_b, slice_2)
    add = aten.add.Tensor(linear_a, linear_b)

``counts``: ``split`` (linears), ``parts`` and ``skipped_<reason>`` (``shared_cat``, ``not_last_dim``,
``unaligned``, ``symbolic_width``, ``not_plain``, ``view_last_dim``: a reshape between the concatenation and the
linear changes the last dim; ``symbolic_view``: one has a symbolic size).
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..infra.graph_utils import copy_meta, set_val
from ..infra.pass_base import Pass, PassContext, PassResult, skipped_summary
from ..infra.phases import Phase

aten = torch.ops.aten
_ALIGN_BYTES = 16
# reshapes of a contiguous order: one keeping the last dim only regroups the leading dims
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims)


class SplitConcatLinear(Pass):
    """Write ``linear(cat(parts, -1), w, b)`` as ``linear(part_0, w[:, :k0], b) + linear(part_1, w[:, k0:k1]) ...``."""

    name = "split_concat_linear"
    phase = Phase.EPILOGUES
    invalidates = ("structure",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        g = gm.graph
        split, parts, skipped = 0, 0, {}
        for n in list(g.nodes):
            found = _concat_under(n)
            if found is None:  # not a linear over a concatenation
                continue
            cat, chain = found
            why = _why_not(n, cat, chain)
            if why is not None:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            w = n.args[1]
            bias = n.args[2] if len(n.args) > 2 else None
            lead = list(n.args[0].meta["val"].shape[:-1])  # the leading dims the linear reads (after the views)
            start, terms = 0, []
            with g.inserting_before(n):
                for i, part in enumerate(cat.args[0]):
                    val = part.meta["val"]
                    width = val.shape[-1]
                    if list(val.shape[:-1]) != lead:
                        # the chain's leading-dim reshape, per part: a view where the part's strides allow one
                        # (reshape copies only a part that cannot be viewed, as the original view of the cat didn't)
                        part = g.call_function(aten.reshape.default, (part, lead + [width]))
                        copy_meta(part, n)
                        set_val(part)
                    cols = g.call_function(aten.slice.Tensor, (w, 1, start, start + width))
                    with_bias = (bias,) if i == 0 and bias is not None else ()  # the bias once, on the first part
                    lin = g.call_function(aten.linear.default, (part, cols) + with_bias)
                    terms.append(lin)
                    for new in (cols, lin):
                        copy_meta(new, n)
                        set_val(new)
                    start += width
                out = terms[0]
                for t in terms[1:]:
                    out = g.call_function(aten.add.Tensor, (out, t))
                    copy_meta(out, n)
                    set_val(out)
            n.replace_all_uses_with(out)
            g.erase_node(n)
            for dead in (*chain, cat):  # nearest the linear first: each is read only by the one before it
                if dead.users:
                    break
                g.erase_node(dead)
            split, parts = split + 1, parts + len(terms)
        g.lint()
        ctx.recompile_at_end(gm)
        left, left_text = skipped_summary(skipped, "left")
        report = (f"{split} linears over a concatenation as {parts} GEMMs on its parts" if split
                  else "no linear over a concatenation") + left_text
        if not split:  # said, not only recorded: a pass asked for that found nothing is worth knowing
            warnings.warn(f"{self.name} rewrote nothing: {report}", stacklevel=2)
        return PassResult(split > 0, {"split": split, "parts": parts, **left}, report)


def _is_view(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS


def _concat_under(n: fx.Node) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """For a linear whose input is a concatenation, directly or through a chain of reshapes: (the concatenation,
    the chain nearest the linear first); None for anything else."""
    if n.op != "call_function" or n.target is not aten.linear.default or not n.args:
        return None
    x, chain = n.args[0], []
    while _is_view(x):
        chain.append(x)
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is aten.cat.default):
        return None
    return x, chain


def _chain_why_not(chain: Sequence[fx.Node]) -> Optional[str]:
    """None when every reshape of the chain keeps the last dim (so the columns the weight's slices meet are the
    parts' columns, whatever the leading dims become), else the counted reason."""
    for v in chain:
        shapes = [getattr(x, "meta", {}).get("val") for x in (v, v.args[0])]
        if not all(isinstance(t, torch.Tensor) for t in shapes):
            return "not_plain"
        if not all(isinstance(d, int) for t in shapes for d in t.shape):
            return "symbolic_view"  # a per-part shape would guard on a dynamic size
        if shapes[0].dim() == 0 or shapes[1].dim() == 0 or shapes[0].shape[-1] != shapes[1].shape[-1]:
            return "view_last_dim"  # the concatenated dim is merged, split or moved: no column slice reads it
    return None


def _only_split_readers(node: fx.Node) -> bool:
    """Whether every reader of ``node`` is a linear taking it as input, or a reshape keeping the last dim whose
    readers are such (so no reader needs the concatenation written)."""
    for u in node.users:
        if _is_view(u) and u.args[0] is node:
            if _chain_why_not([u]) is not None or not _only_split_readers(u):
                return False
        elif u.op != "call_function" or u.target is not aten.linear.default or u.args[0] is not node:
            return False
    return True


def _why_not(n: fx.Node, cat: fx.Node, chain: Sequence[fx.Node]) -> Optional[str]:
    """None for a linear over a concatenation (through ``chain``) this pass splits, else the counted reason."""
    parts: List[fx.Node] = list(cat.args[0])
    vals = [getattr(p, "meta", {}).get("val") for p in parts]
    w = n.args[1] if len(n.args) > 1 else None
    wval = w.meta.get("val") if isinstance(w, fx.Node) else None
    if n.kwargs or not isinstance(wval, torch.Tensor) or wval.dim() != 2 or len(parts) < 2 or \
            not all(isinstance(v, torch.Tensor) and v.dtype == wval.dtype for v in vals):
        return "not_plain"
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim not in (-1, vals[0].dim() - 1):
        return "not_last_dim"
    why = _chain_why_not(chain)
    if why is not None:
        return why
    if not _only_split_readers(cat):
        return "shared_cat"  # the concatenation is written anyway for its other readers
    widths = [v.shape[-1] for v in vals]
    if not all(isinstance(x, int) for x in (*widths, wval.shape[1])):
        return "symbolic_width"  # a slice bound would guard on a dynamic size
    if sum(widths) != wval.shape[1]:
        return "not_plain"
    item = wval.element_size()
    starts = [sum(widths[:i]) for i in range(len(widths))]
    if any((s * item) % _ALIGN_BYTES for s in starts) or (wval.shape[1] * item) % _ALIGN_BYTES:
        return "unaligned"
    return None


__all__ = ["SplitConcatLinear"]
