"""Zero-padded attention heads: the proof, before anything is rewritten, that padding a q / k / v / qkv
projection whose head count does not divide by tp with whole zero heads is exact.

A padded projection gets zero weight rows and zero bias for the extra heads of each segment (``H`` heads of
``D`` rounded up to a multiple of ``tp``), so each rank's chunk is whole heads; the attention output
projection gets zero input columns for them. The padded heads then contribute exactly 0 provided that, from
the projection to the output projection, they

* stay finite (``0 * x`` is 0 only for finite ``x``): every op keeps them finite; a reciprocal, ``rsqrt`` or
  divisor of them needs them provably positive (a per-head RMSNorm's ``rsqrt(mean(x^2) + eps)``);
* never mix with the real heads: the ops re-index (views splitting ``H*D -> (H, D)`` and back, transposes,
  permutes, repeats along other dims or of 1, an index of tokens, splits of fused segments, concatenations
  along the sequence), act per element (RoPE, scales) or per head (norms over ``D``), or attend (SDPA: head
  ``h`` of the output reads head ``h`` of q, k, v; a q / k / v computed from replicated values, e.g. one kv
  head repeated to the q heads, is sliced to the rank's heads and zero-padded alike, a single head broadcast);
* or leave the region whole: a context region (``wrap_with_autocast``, Z-Image's RoPE) reads the value
  all-gathered with its padded heads dropped, as the rules gather a divisible shard there;
* are exactly zero where statistics run across heads (an RMSNorm, or its decomposition, over ``H*D``): the sum
  of squares is then the real heads' own, and the rule divides by the real feature count.

:func:`head_region` walks the dataflow with a three-valued state per value (``ZERO``: exactly 0 at the padded
heads, ``POSITIVE``: finite and > 0, ``FINITE``) and refuses any other op; which dim holds the heads, and that
operands are broadcast over it, is checked by the rules (:mod:`~dit_passes.parallel.tp_sharding`) while they
place every value, before the graph runs: an operand with a full heads extent or a mask per head is refused.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch.fx as fx

from . import op_classes as oc
from .propagate import arg, val

aten = oc.aten
ZERO, POSITIVE, FINITE = "zero", "positive", "finite"

# ops that only re-index, copy or cast: the padded heads' state passes through
_MOVES = (oc.RESHAPES | oc.COMPLEX_VIEWS | oc.LIKE_ARG0 | oc.COPIES | oc.SPLITS | oc.EXPANDS
          | {aten.transpose.int, aten.permute.default, aten.select.int, aten.unbind.int, aten.slice.Tensor,
             aten.cat.default, aten.stack.default, aten.slice_scatter.default, aten.repeat.default, operator.getitem})
# reductions a collective completes (sum, mean, max, min): a per-head one keeps the padded heads' state
_REDUCE = {t for t, (_, collective) in oc.REDUCTIONS.items() if collective}


@dataclasses.dataclass
class HeadRegion:
    values: Dict[fx.Node, str]          # value -> state of its padded heads (ZERO / POSITIVE / FINITE)
    outs: List[fx.Node]                 # linears reading it as their input (the row-parallel output projections)
    attentions: List[fx.Node]           # the SDPA nodes it feeds
    gathered: List[fx.Node] = dataclasses.field(default_factory=list)  # context regions (autocast) reading it:
    # the rules all-gather it there and drop the padded heads, as they gather a divisible shard there

    @property
    def zero(self) -> Set[fx.Node]:
        return {v for v, s in self.values.items() if s == ZERO}


class HeadPaddingError(ValueError):
    """Why padding the heads could leak into the real ones (the plan turns it into a PassError)."""


def _combine(states: Iterable[str]) -> str:
    states = set(states)
    return states.pop() if len(states) == 1 else FINITE


def _scalar(a) -> Optional[float]:
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _pointwise_state(u: fx.Node, ins: Dict[fx.Node, str]) -> str:
    """The state of an elementwise op's padded heads from its region inputs' (``ins``)."""
    t, s = u.target, list(ins.values())
    others = [a for a in u.args if isinstance(a, fx.Node) and a not in ins]
    scalars = [_scalar(a) for a in u.args[1:] if not isinstance(a, fx.Node)]
    if t in (aten.mul.Tensor, aten.mul.Scalar):
        return ZERO if ZERO in s else POSITIVE if set(s) == {POSITIVE} and not others and \
            all(c is not None and c > 0 for c in scalars) else FINITE
    if t in (aten.neg.default, aten.pow.Tensor_Scalar, aten.abs.default, aten.relu.default, aten.silu.default,
             aten.gelu.default, aten.tanh.default):
        if t is aten.pow.Tensor_Scalar and s == [POSITIVE]:
            return POSITIVE
        return ZERO if s == [ZERO] and (t is not aten.pow.Tensor_Scalar or float(u.args[1]) > 0) else FINITE
    if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
        alpha = _scalar(u.kwargs.get("alpha", 1))
        if others or alpha is None:
            return FINITE
        sign = -1 if t in (aten.sub.Tensor, aten.sub.Scalar) else 1
        plus = [c * alpha * sign for c in scalars if c is not None]  # what is added to the padded heads
        if set(s) <= {ZERO} and all(c == 0 for c in plus):
            return ZERO
        if set(s) <= {ZERO, POSITIVE} and sign * alpha > 0 and all(c > 0 for c in plus):
            return POSITIVE if plus or POSITIVE in s else ZERO
        return FINITE
    return FINITE


def _reduced_extent(u: fx.Node) -> int:
    """Elements a reduction or norm combines for each output element."""
    shape = [int(d) for d in val(u.args[0]).shape]
    if u.target in (aten.rms_norm.default, aten.layer_norm.default):
        return math.prod(int(d) for d in u.args[1])
    dims = arg(u, 1, "dim", None)
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    return math.prod(shape[int(d) % len(shape)] for d in dims)


def _step(u: fx.Node, ins: Dict[fx.Node, str], head_dim: int) -> str:
    """The state of ``u``'s padded heads, or HeadPaddingError when they could turn non-finite or leak."""
    t, s = u.target, list(ins.values())
    if t in _MOVES:
        return _combine(s)
    if t in (aten.index.Tensor, aten.repeat_interleave.self_int):  # copies of elements along some dim: the rules
        # keep them only along a dim other than the heads (an identity repeat along the heads), else gather: refused
        if list(ins) != [u.args[0]]:
            raise HeadPaddingError(f"{u.name} ({t}) indexes with them")
        return ins[u.args[0]]
    if t in oc.FINITE_POINTWISE:
        if t is aten.pow.Tensor_Scalar and float(u.args[1]) < 0 and s != [POSITIVE]:
            raise HeadPaddingError(f"{u.name} raises them to a negative power")
        return _pointwise_state(u, ins)
    if t in oc.INVERSES:
        if s != [POSITIVE]:
            raise HeadPaddingError(f"{u.name} ({t}) takes them where they are not provably positive")
        return POSITIVE
    if t is aten.div.Tensor:
        if len(u.args) > 1 and u.args[1] in ins and ins[u.args[1]] != POSITIVE:
            raise HeadPaddingError(f"{u.name} divides by them where they are not provably positive")
        return ZERO if u.args[0] in ins and ins[u.args[0]] == ZERO else FINITE
    if t in _REDUCE or t in (aten.rms_norm.default, aten.layer_norm.default):
        zero_in = ins.get(u.args[0]) == ZERO  # (a LayerNorm's moments skip the padding: tp_norms)
        if _reduced_extent(u) > head_dim and not zero_in and t is not aten.layer_norm.default:
            raise HeadPaddingError(f"{u.name} ({t}) may combine them across heads, and they are not provably "
                                   f"zero there")
        if t is aten.layer_norm.default:
            return ZERO if zero_in and arg(u, 3, "bias", None) is None else FINITE
        return _combine(s)
    if t in oc.MATMULS:  # per head when the heads are a batch dim of both (the rules check which dim)
        return ZERO if ZERO in s else FINITE
    if t in oc.PADS:
        value = arg(u, 2, "value", 0) if t is aten.constant_pad_nd.default else arg(u, 3, "value", 0)
        return ins[u.args[0]] if (value or 0) == 0 else FINITE
    if t is oc.SDPA:
        q, k, v = u.args[:3]
        hq, hk = int(val(q).shape[1]), int(val(k).shape[1])
        if hq != hk and hk != 1:
            raise HeadPaddingError(f"attention {u.name} has {hq} q heads and {hk} kv heads (GQA): padding q "
                                   f"heads would break the q-to-kv head mapping")
        for name, a in (("q", q), ("k", k), ("v", v)):
            heads = int(val(a).shape[1])
            if a not in ins and heads not in (1, hq):
                raise HeadPaddingError(f"attention {u.name}: {name} has {heads} heads, not the {hq} q heads nor one "
                                       f"to broadcast")
        # an input outside the region (computed from replicated values: Lumina-Next's one kv head repeated to the
        # q heads, or q / k gathered before an autocast region) is sliced to the rank's heads and zero-padded
        # alike by the rule (tp_padded.local_operand); a single head is broadcast over the q heads as it is
        if v in ins:
            return ins[v]
        return ZERO if int(val(v).shape[1]) == hq and hq > 1 else FINITE
    raise HeadPaddingError(f"{u.name} ({t}) reads them before the output projection")


def head_region(starts: Iterable[fx.Node], head_dim: int) -> HeadRegion:
    """The values carrying the padded heads of the projections ``starts`` (all ZERO there) up to the linears
    reading them as input, with each value's state; HeadPaddingError naming the first op that could leak them.
    ``head_dim``: per-head size, to tell a norm over one head from one across heads."""
    starts = list(starts)
    region = HeadRegion({s: ZERO for s in starts}, [], [])
    reached, todo = set(starts), list(starts)
    while todo:  # the values the padded heads reach, up to the linears reading them
        v = todo.pop()
        for u in v.users:
            if u.op == "output":
                raise HeadPaddingError(f"{v.name} reaches the graph output")
            if u.target in oc.VALUE_FREE or (u.target in oc.META_ARG1 and u.args[0] is not v):
                continue  # reads only a shape or dtype
            if u.target is oc.LINEAR:
                if u.args[0] is not v:
                    raise HeadPaddingError(f"{u.name} reads them as a weight")
                if u not in region.outs:
                    region.outs.append(u)
            elif u.target in oc.CONTEXT_WRAPPERS:  # the rules gather its operand and drop the padded heads
                if u not in region.gathered:
                    region.gathered.append(u)
            elif u not in reached:
                reached.add(u)
                todo.append(u)
    for u in starts[0].graph.nodes:  # in graph order: a value's region inputs have their state already
        if u in reached and u not in region.values:
            ins = {a: region.values[a] for a in u.all_input_nodes if a in region.values}
            region.values[u] = _step(u, ins, head_dim)
            if u.target is oc.SDPA:
                region.attentions.append(u)
    if not region.outs:
        raise HeadPaddingError("no linear reads them")
    return region


def attention_head_dim(linear: fx.Node) -> Optional[int]:
    """The head size of the attention(s) a projection feeds (q's last dim at the SDPA its output reaches before
    any linear, else the view that splits its heads), None when neither is found."""
    seen, todo, dims = {linear}, [linear], set()
    while todo:
        for u in todo.pop().users:
            if u.target is oc.SDPA:
                dims.add(int(val(u.args[0]).shape[-1]))
            elif u not in seen and u.op == "call_function" and u.target is not oc.LINEAR:
                seen.add(u)
                todo.append(u)
    if len(dims) > 1:
        raise HeadPaddingError(f"it feeds attentions of head sizes {sorted(dims)}")
    return dims.pop() if dims else _split_head_dim(linear)


def _split_head_dim(linear: fx.Node) -> Optional[int]:
    """The head size of an attention other than SDPA (Sana's linear attention): the inner size of the first
    view that splits the projection's features ``F -> (H, F // H)``, followed through transposes and casts."""
    v, dim = linear, val(linear).dim() - 1
    while True:
        users = [u for u in v.users if u.op == "call_function" and u.target not in oc.VALUE_FREE]
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in oc.RESHAPES:
            src, dst = [int(d) for d in val(v).shape], [int(d) for d in val(u).shape]
            k = next((k for k in range(len(dst)) if math.prod(dst[:k]) == math.prod(src[:dim]) and dst[k] != 1), None)
            split = k is not None and 1 < dst[k] < src[dim] and src[dim] % dst[k] == 0
            return src[dim] // dst[k] if split else None
        if u.target in oc.LIKE_ARG0:
            pass
        elif u.target is aten.transpose.int:
            a, b = (int(d) % val(v).dim() for d in u.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif u.target is aten.permute.default:
            dim = [int(p) % val(v).dim() for p in u.args[1]].index(dim)
        else:
            return None
        v = u


def padded_head_segments(segments: Tuple[int, ...], head_dim: int, tp: int) -> Tuple[int, ...]:
    """Each segment of whole heads rounded up to whole heads on every rank (a multiple of ``tp * head_dim``); a
    segment whose heads divide, or that is not whole heads but divides by tp (the MLP part of a fused
    projection), is kept; HeadPaddingError for one that neither divides nor is whole heads."""
    out = []
    for s in segments:
        if s % head_dim == 0 and (s // head_dim) % tp:
            out.append(-(-s // (tp * head_dim)) * tp * head_dim)
        elif s % tp == 0:
            out.append(s)
        else:
            raise HeadPaddingError(f"a segment of {s} features is neither whole heads of {head_dim} nor "
                                   f"divisible by tp={tp}")
    return tuple(out)


__all__ = ["FINITE", "HeadPaddingError", "HeadRegion", "POSITIVE", "ZERO", "attention_head_dim", "head_region",
           "padded_head_segments"]
