"""Rules of tensor parallelism for zero-padded values (planned by :mod:`~dit_passes.parallel.tp_plan`; the
padded heads' proof is :mod:`~dit_passes.parallel.tp_heads`).

A padded :class:`~dit_passes.parallel.tp_sharding.ShardSpec` holds each segment's ``real`` size rounded up to
``segments`` (zeros at the end of each); rank ``r`` holds the ``r``-th chunk of each padded segment. Here:

* views: ``(B, S, H*D) -> (B, S, H, D)`` moves the padding to the heads dim (``H`` real of ``H'`` padded),
  the reverse merges it back; a fused ``(B, S, 3*H*D) -> (B, S, 3, H, D)`` unstacks the segments first. A view
  that merges dims in front of the padded one, or cuts a padded unit (a head), is refused;
* statistics across the padded dim (an RMSNorm over ``H*D``, a decomposed one's ``mean`` / ``sum``) only where
  the plan proved the padded part exactly zero: the local sums then hold the real elements' own, and a mean
  divides by the REAL count; a LayerNorm (its centred second moment would count the zeros) or a max across the
  padded dim is refused;
* a replicated operand with the full extent of the padded dim (a norm's weight and bias over ``H*D``) is sliced
  to the rank's chunk and zero-padded alike (:func:`local_operand`), where the caller proves zeros safe.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.fx as fx

from . import op_classes as oc
from .propagate import moved_dim, resize_view, Touches
from .tp_weights import ShardingError, shard_pieces

aten = oc.aten


def _padded_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int, real: int, padded: int, tp: int):
    """(output dim, its padded size, its real size) of a row-major view ``in_shape -> out_shape`` (full, real
    sizes) whose input dim ``d`` holds ``real`` elements padded to ``padded``: the outermost output dim that keeps
    the padded units (a head of ``D`` when splitting ``H*D``, a row of ``D`` when merging ``(H, D)``) whole on
    every rank, else ShardingError."""
    pre = math.prod(in_shape[:d])
    ks = [k for k in range(len(out_shape)) if math.prod(out_shape[:k]) == pre]
    # size-1 dims let several output dims share the prefix (a batch of 1 in front of 1 real head): the one behind
    # the unchanged leading dims is the dim the next ops read as this one (the outermost, the batch, was taken)
    ks.sort(key=lambda k: list(out_shape[:k]) != list(in_shape[:d]))
    for k in ks:
        size = out_shape[k]
        if real % size == 0:  # split (or kept): size units of real // size elements each
            unit = real // size
            whole = any(math.prod(out_shape[k + 1:j]) == unit for j in range(k + 1, len(out_shape) + 1))
            if whole and padded % unit == 0 and (padded // unit) % tp == 0:
                return k, padded // unit, size
        elif size % real == 0:  # merge: each element of dim d takes the following dims' size // real elements
            unit = size // real
            if any(math.prod(in_shape[d + 1:j]) == unit for j in range(d + 1, len(in_shape) + 1)):
                return k, padded * unit, size
    raise ShardingError(f"view {list(in_shape)} -> {list(out_shape)} of a zero-padded dim ({real} of {padded} "
                        f"real) merges dims before it into it or cuts through its padded units")


def view(rules, n: fx.Node, sx):
    """The spec of a view of padded ``sx`` (see the module docstring), the view's sizes made local."""
    in_shape, out_shape = [int(s) for s in n.args[0].meta["val"].shape], [int(s) for s in n.meta["val"].shape]
    real, segs, tp = sx.real_segments, sx.segments, rules.tp
    if len(segs) == 1:
        k, padded, size = _padded_dim(in_shape, out_shape, sx.dim, real[0], segs[0], tp)
        spec = type(sx)(k, (padded,), (size,))
    elif len(set(real)) == 1 and len(set(segs)) == 1:  # equal fused segments unstacked into a dim of their count
        count, pre = len(segs), math.prod(in_shape[:sx.dim])
        stack = next((e for e in range(len(out_shape)) if math.prod(out_shape[:e]) == pre
                      and out_shape[e] == count), None)
        if stack is None:
            if out_shape == in_shape:
                return sx
            raise ShardingError(f"a view of {count} zero-padded segments {list(real)} that does not unstack them")
        inner = in_shape[:sx.dim] + [count, real[0]] + in_shape[sx.dim + 1:]
        k, padded, size = _padded_dim(inner, out_shape, sx.dim + 1, real[0], segs[0], tp)
        if k <= stack:
            raise ShardingError(f"a view of {count} zero-padded segments that does not keep them apart")
        spec = type(sx)(k, (padded,), (size,))
    else:
        raise ShardingError(f"a view of unequal zero-padded segments {list(real)} -> {list(segs)}")
    new = resize_view(n, spec.dim, spec.full // tp)
    if new is not None:
        n.args = new
        rules.counts["views"] += 1
    return spec


def check_statistics(rules, n: fx.Node, sx) -> None:
    """A reduction or norm of padded ``sx``: fine when it keeps the padded dim (per head) or sums across it
    where the padded part is proven zero; ShardingError otherwise (see the module docstring)."""
    t, x = n.target, n.args[0]
    if t in oc.REDUCTIONS:
        try:
            moved_dim(n, sx.dim)
            return
        except Touches:
            across = True
    else:  # (a LayerNorm or RMSNorm: its normalised shape is argument 1)
        across = sx.dim >= x.meta["val"].dim() - len(n.args[1])
    if not across:
        return
    if t is aten.layer_norm.default:
        return  # tp_norms.layer_norm takes each rank's moments over its real elements only
    if t not in (aten.rms_norm.default, aten.sum.dim_IntList, aten.mean.dim):
        raise ShardingError(f"{t} across a zero-padded dim (heads padded to divide by tp={rules.tp}): its "
                            f"statistics would count the padding; only LayerNorm, RMSNorm and sum / mean are exact "
                            f"there")
    if x not in rules.zero:
        raise ShardingError(f"{t} across a zero-padded dim whose padded part is not provably zero")


def mean_divisor(sx, tp: int) -> float:
    """What the all-reduced sum of the ranks' local means is divided by to give the mean over the real
    elements: ``tp`` unpadded, ``real / local`` padded (the local means count the padding, which is zero)."""
    return tp if not sx.padded else sum(sx.real_segments) / (sx.full // tp)


def check_attention(n: fx.Node, specs, padded) -> None:
    """SDPA ``n`` with zero-padded heads: q, k and v padded alike (head ``h`` attends with head ``h``), a replicated
    one with the real head count (sliced and zero-padded alike by the rule), or one replicated head broadcast over
    the q heads; ShardingError otherwise."""
    real = sum(padded.real_segments)
    alike = [s == padded if s is not None else int(a.meta["val"].shape[1]) in (1, real)
             for a, s in zip(n.args[:3], specs)]
    if not all(alike):
        got = [(s.segments, s.real_segments) if s else "replicated" for s in specs]
        raise ShardingError(f"attention with zero-padded heads needs q, k, v padded alike (or one kv head); got "
                            f"(padded, real) heads {got}")


def attention_mask(rules, n: fx.Node, mask: fx.Node, dim: int, padded) -> fx.Node:
    """The rank's heads of a replicated per-head mask of SDPA ``n`` whose heads are zero-padded: the padded
    heads attend to every key (additive 0, boolean True), so they stay finite; the out projection drops them."""
    heads = int(mask.meta["val"].shape[dim])
    if heads != sum(padded.real_segments):
        raise ShardingError(f"attention mask {mask.name} has {heads} heads, the padded q {list(padded.real)}")
    return local_operand(rules, mask, dim, padded.with_dim(dim), n, mask.meta["val"].dtype == torch.bool)


def local_operand(rules, x: fx.Node, dim: int, spec, before: fx.Node, value=0) -> fx.Node:
    """Rank ``rank``'s chunk of replicated ``x`` along ``dim`` (its full real extent), each segment padded
    with ``value`` as ``spec`` (zeros: a norm's weight or bias over padded heads, a RoPE table over H*D)."""
    nd, parts = x.meta["val"].dim(), []
    with rules.g.inserting_before(before):
        for start, length, zeros in shard_pieces(spec.real_segments, rules.rank, rules.tp, spec.segments):
            piece = rules.emit(aten.slice.Tensor, (x, dim, start, start + length), like=before)
            if zeros:
                piece = rules.emit(aten.constant_pad_nd.default,
                                   (piece, [0, 0] * (nd - 1 - dim) + [0, zeros], value), like=before)
            parts.append(piece)
        rules.counts["slices"] += 1
        return parts[0] if len(parts) == 1 else rules.emit(aten.cat.default, (parts, dim), like=before)


__all__ = ["attention_mask", "check_attention", "check_statistics", "local_operand", "mean_divisor", "view"]
