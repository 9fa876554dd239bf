"""Distributed norms of tensor parallelism: a norm whose normalised dims include the sharded hidden, rewritten so
that each rank normalises its slice with statistics over the whole hidden.

* RMSNorm: the local sum of squares, one all-reduce, division by the full count (``aten.rms_norm``'s order).
* LayerNorm: each rank's mean and M2 (sum of squared deviations from its own mean, two-pass like
  ``aten.layer_norm``), one all-gather of the pair, then the exact parallel combination
  ``mean = avg(mean_r)``, ``M2 = sum(M2_r) + n_local * sum((mean_r - mean)^2)`` (no E[x^2] - E[x]^2
  cancellation), ``(x - mean) * rsqrt(M2 / N + eps)`` and the rank's slice of weight and bias. Before / after
  (rank 0 of 2, ``q`` sharded over its 32 features)::

      layer_norm: "f32[1, 16, 32]" = aten.layer_norm(q, [32], norm_q.weight, norm_q.bias, 1e-05)

      mean: "f32[1, 16, 1]" = aten.mean.dim(q, [2], True)                  # q: f32[1, 16, 16]
      m2 = aten.sum.dim_IntList(aten.mul(q - mean, q - mean), [2], True)
      stats: "f32[4, 1, 16, 1]" = wait_tensor(all_gather_into_tensor(stack([mean, m2]), 2, group))
      ... mean over ranks, M2 combined, rsqrt(M2 / 32 + eps) ...
      y = (q - mean_all) * rstd * norm_q.weight[0:16] + norm_q.bias[0:16]

Low-precision inputs are normalised in fp32 and cast back, as the ATen kernels do.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx

from . import op_classes as oc
from . import tp_padded
from .propagate import arg

aten, c10d = oc.aten, oc.c10d


def _first_norm_dim(n: fx.Node) -> int:
    return n.args[0].meta["val"].dim() - len(n.args[1])


def _finish(rules, n: fx.Node, y: fx.Node, sx) -> None:
    y.meta["val"] = n.meta["val"]  # full shape until repropagate(); later rules read it
    n.replace_all_uses_with(y)
    rules.g.erase_node(n)
    rules.place[y] = sx
    if n in rules.zero:  # (padded heads: zero in, zero out)
        rules.zero.add(y)


def _affine(rules, n: fx.Node, y: fx.Node, sx, first: int, weight, bias) -> fx.Node:
    """``y * weight + bias`` with this rank's slice of the (replicated) affine parameters."""
    wd = sx.dim - first
    part = sx.with_dim(wd)

    def piece(t: fx.Node) -> fx.Node:  # padded heads (an RMSNorm over H*D): zero weight there, they stay zero
        return tp_padded.local_operand(rules, t, wd, part, n) if part.padded else rules._local(t, wd, part, n)
    if weight is not None:
        y = rules.emit(aten.mul.Tensor, (y, piece(weight)), like=n)
    if bias is not None:
        y = rules.emit(aten.add.Tensor, (y, piece(bias)), like=n)
    return y


def rms_norm(rules, n: fx.Node, sx) -> Optional[object]:
    """``aten.rms_norm`` over a sharded input: local when the sharded dim is not normalised (per-head norms)."""
    x, shape = n.args[0], list(n.args[1])
    weight, eps = arg(n, 2, "weight", None), arg(n, 3, "eps", None)
    xv, first = x.meta["val"], _first_norm_dim(n)
    if sx.dim < first:
        return sx
    low = xv.dtype in (torch.float16, torch.bfloat16)
    eps = torch.finfo(torch.float32 if low else xv.dtype).eps if eps is None else eps
    emit = rules.emit
    with rules.g.inserting_before(n):
        xf = emit(aten._to_copy.default, (x,), {"dtype": torch.float32}, like=n) if low else x
        ss = emit(aten.sum.dim_IntList, (emit(aten.pow.Tensor_Scalar, (xf, 2), like=n),
                                         list(range(first, xv.dim())), True), like=n)
        ms = emit(aten.div.Tensor, (rules.all_reduce(ss, n), math.prod(int(s) for s in shape)), like=n)
        r = emit(aten.rsqrt.default, (emit(aten.add.Tensor, (ms, eps), like=n),), like=n)
        y = emit(aten.type_as.default, (emit(aten.mul.Tensor, (xf, r), like=n), x), like=n)
        y = _affine(rules, n, y, sx, first, weight, None)
    _finish(rules, n, y, sx)
    rules.counts["norm_all_reduce"] += 1
    return None


def layer_norm(rules, n: fx.Node, sx) -> Optional[object]:
    """``aten.layer_norm`` over a sharded input (see the module docstring)."""
    x, shape = n.args[0], [int(s) for s in n.args[1]]
    weight, bias, eps = arg(n, 2, "weight", None), arg(n, 3, "bias", None), arg(n, 4, "eps", 1e-5)
    xv, first = x.meta["val"], _first_norm_dim(n)
    if sx.dim < first:
        return sx
    tp, emit, dims = rules.tp, rules.emit, list(range(first, xv.dim()))
    low = xv.dtype in (torch.float16, torch.bfloat16)
    stat_shape = [int(s) for s in xv.shape[:first]] + [1] * len(shape)
    with rules.g.inserting_before(n):
        xf = emit(aten._to_copy.default, (x,), {"dtype": torch.float32}, like=n) if low else x
        mean = emit(aten.mean.dim, (xf, dims, True), like=n)
        dev = emit(aten.sub.Tensor, (xf, mean), like=n)
        m2 = emit(aten.sum.dim_IntList, (emit(aten.mul.Tensor, (dev, dev), like=n), dims, True), like=n)
        stats = emit(aten.stack.default, ([mean, m2],), like=n)
        stats = emit(c10d.all_gather_into_tensor.default, (stats, tp, rules.group), like=n)
        stats = emit(aten.view.default, (emit(c10d.wait_tensor.default, (stats,), like=n), [tp, 2] + stat_shape),
                     like=n)
        means = emit(aten.select.int, (stats, 1, 0), like=n)
        m2s = emit(aten.select.int, (stats, 1, 1), like=n)
        mean_all = emit(aten.mean.dim, (means, [0]), like=n)
        spread = emit(aten.sub.Tensor, (means, mean_all), like=n)
        spread = emit(aten.sum.dim_IntList, (emit(aten.mul.Tensor, (spread, spread), like=n), [0]), like=n)
        local_count = math.prod(shape) // tp
        m2_all = emit(aten.add.Tensor, (emit(aten.sum.dim_IntList, (m2s, [0]), like=n),
                                        emit(aten.mul.Tensor, (spread, local_count), like=n)), like=n)
        var = emit(aten.div.Tensor, (m2_all, math.prod(shape)), like=n)
        rstd = emit(aten.rsqrt.default, (emit(aten.add.Tensor, (var, eps), like=n),), like=n)
        y = emit(aten.mul.Tensor, (emit(aten.sub.Tensor, (xf, mean_all), like=n), rstd), like=n)
        if low:
            y = emit(aten.type_as.default, (y, x), like=n)
        y = _affine(rules, n, y, sx, first, weight, bias)
    _finish(rules, n, y, sx)
    rules.counts["norm_all_gather"] += 1
    return None
