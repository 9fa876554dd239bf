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
from .tp_weights import ShardingError, shard_pieces
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


def _rank_units(sx, tp: int):
    """Real elements along the sharded dim on each rank: ``full / tp`` each, or with padded heads the real part
    of each rank's chunk."""
    if not sx.padded:
        return [sx.full // tp] * tp
    if len(sx.segments) != 1:
        raise ShardingError(f"a LayerNorm over {len(sx.segments)} zero-padded segments {list(sx.real_segments)}")
    return [sum(k for _, k, _ in shard_pieces(sx.real_segments, r, tp, sx.segments)) for r in range(tp)]


def _local_moments(rules, n: fx.Node, xf: fx.Node, dims, sx, units: int):
    """This rank's (mean, M2) over its real elements (``units`` along the sharded dim): with padded heads its
    chunk's real part (the padding is at its end), zeros for a chunk of padding only (weighted 0 when combined)."""
    emit = rules.emit
    if units == 0:
        zero = emit(aten.mul.Tensor, (emit(aten.sum.dim_IntList, (xf, dims, True), like=n), 0), like=n)
        return zero, zero
    if units < sx.full // rules.tp:
        xf = emit(aten.slice.Tensor, (xf, sx.dim, 0, units), like=n)
    mean = emit(aten.mean.dim, (xf, dims, True), like=n)
    dev = emit(aten.sub.Tensor, (xf, mean), like=n)
    return mean, emit(aten.sum.dim_IntList, (emit(aten.mul.Tensor, (dev, dev), like=n), dims, True), like=n)


def _weighted_combination(rules, n: fx.Node, means: fx.Node, m2_sum: fx.Node, counts):
    """Mean and M2 over all real elements from the ranks' own (``means`` stacked along dim 0) when the ranks
    hold different counts: ``mean = sum(n_r * mean_r) / N``, ``M2 = sum(M2_r) + sum(n_r * (mean_r - mean)^2)``."""
    emit, total = rules.emit, sum(counts)
    rank_means = [(emit(aten.select.int, (means, 0, r), like=n), c) for r, c in enumerate(counts) if c]
    mean_all = None
    for m, c in rank_means:
        term = emit(aten.mul.Tensor, (m, c / total), like=n)
        mean_all = term if mean_all is None else emit(aten.add.Tensor, (mean_all, term), like=n)
    m2_all = m2_sum
    for m, c in rank_means:
        d = emit(aten.sub.Tensor, (m, mean_all), like=n)
        m2_all = emit(aten.add.Tensor, (m2_all, emit(aten.mul.Tensor, (emit(aten.mul.Tensor, (d, d), like=n), c),
                                                     like=n)), like=n)
    return mean_all, m2_all


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
        units = _rank_units(sx, tp)
        counts = [u * math.prod(shape) // sum(sx.real_segments) for u in units]  # normalised elements per rank
        mean, m2 = _local_moments(rules, n, xf, dims, sx, units[rules.rank])
        stats = emit(aten.stack.default, ([mean, m2],), like=n)
        stats = emit(c10d.all_gather_into_tensor.default, (stats, tp, rules.group), like=n)
        stats = emit(aten.view.default, (emit(c10d.wait_tensor.default, (stats,), like=n), [tp, 2] + stat_shape),
                     like=n)
        means = emit(aten.select.int, (stats, 1, 0), like=n)
        m2s = emit(aten.select.int, (stats, 1, 1), like=n)
        m2_all = emit(aten.sum.dim_IntList, (m2s, [0]), like=n)
        if not sx.padded:
            mean_all = emit(aten.mean.dim, (means, [0]), like=n)
            spread = emit(aten.sub.Tensor, (means, mean_all), like=n)
            spread = emit(aten.sum.dim_IntList, (emit(aten.mul.Tensor, (spread, spread), like=n), [0]), like=n)
            m2_all = emit(aten.add.Tensor, (m2_all, emit(aten.mul.Tensor, (spread, counts[0]), like=n)), like=n)
        else:
            mean_all, m2_all = _weighted_combination(rules, n, means, m2_all, counts)
        var = emit(aten.div.Tensor, (m2_all, math.prod(shape)), like=n)
        rstd = emit(aten.rsqrt.default, (emit(aten.add.Tensor, (var, eps), like=n),), like=n)
        y = emit(aten.mul.Tensor, (emit(aten.sub.Tensor, (xf, mean_all), like=n), rstd), like=n)
        if low:
            y = emit(aten.type_as.default, (y, x), like=n)
        y = _affine(rules, n, y, sx, first, weight, bias)
    _finish(rules, n, y, sx)
    rules.counts["norm_all_gather"] += 1
    return None
