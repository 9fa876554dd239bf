"""The propagation driver the three rule tables share (TP, sequence, VAE-P): one ``Placement`` per value
(a rule table's dataclass with a ``dim``), :class:`Propagation` walking the graph in order and
recording inserted nodes / counts, and the rules that are the same for every placement: where a dim
goes through ops that do not touch it (:func:`moved_dim`), broadcasting agreement (:func:`agree`,
:func:`aligned_dim`), the one view-mapping rule (:func:`view_dims`), cuts at segment boundaries
(:func:`segment_cut`), split sizes, view size rewriting, one (uneven, segment-major) all-gather, and
``meta["val"]`` recomputed for what changed.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from ..infra.graph_utils import copy_meta, set_val
from . import op_classes as oc
from .attention import even_shard_sizes

aten, c10d = oc.aten, oc.c10d


class Touches(Exception):
    """The op acts on the sharded dim itself (the rule table decides what that means)."""


class Placement:
    """Mixin of the rule tables' frozen placement dataclasses (each has a ``dim`` field)."""

    def with_dim(self, dim: int):
        return dataclasses.replace(self, dim=dim)


def val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def shape(a: fx.Node) -> Tuple[int, ...]:
    return tuple(int(s) for s in val(a).shape)


def is_tensor(a: Any) -> bool:
    return isinstance(val(a), torch.Tensor)


def arg(n: fx.Node, i: int, name: str, default: Any) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def map_args(args, fn):
    if isinstance(args, (list, tuple)):
        return type(args)(map_args(a, fn) for a in args)
    if isinstance(args, dict):
        return {k: map_args(v, fn) for k, v in args.items()}
    return fn(args)


def reduction_dims(n: fx.Node) -> Tuple[List[int], bool]:
    """(reduced dims of argument 0, keepdim) of a :data:`~op_classes.REDUCTIONS` node."""
    at = oc.REDUCTIONS[n.target][0]
    nd = val(n.args[0]).dim()
    dims = arg(n, at, "dim", None)
    dims = list(range(nd)) if dims in (None, []) else [int(d) % nd for d in ([dims] if isinstance(dims, int) else dims)]
    kw_only = n.target in (aten.var.correction, aten.std.correction)
    return dims, bool(n.kwargs.get("keepdim", False) if kw_only else arg(n, at + 1, "keepdim", False))


def moved_dim(n: fx.Node, dim: int) -> int:
    """Where dim ``dim`` of argument 0 is in ``n``'s output(s), for ops that move it without reading
    across it; raises :class:`Touches` when ``n`` reduces, slices, splits or mixes along ``dim``, and
    ``KeyError`` for an op outside these classes."""
    t, args, nd = n.target, n.args, val(n.args[0]).dim()
    if t in oc.LIKE_ARG0 or t in oc.ELEMENTWISE_COLLECTIVES:
        return dim
    if t is aten.permute.default:
        return [int(p) % nd for p in args[1]].index(dim)
    if t is aten.transpose.int:
        a, b = (int(v) % nd for v in args[1:3])
        return b if dim == a else a if dim == b else dim
    if t is aten.unsqueeze.default:
        return dim + (int(args[1]) % (nd + 1) <= dim)
    if t in oc.REDUCTIONS:
        dims, keep = reduction_dims(n)
        if dim in dims:
            raise Touches("reduction over the sharded dim")
        return dim if keep else dim - sum(d < dim for d in dims)
    drops = (aten.select.int, aten.unbind.int, aten.squeeze.dim)  # remove their dim argument
    if t in oc.SOFTMAX or t in drops or t in (aten.slice.Tensor, aten.narrow.default):
        d = int(arg(n, 1, "dim", 0)) % nd
        if d == dim:
            raise Touches(f"{'softmax over' if t in oc.SOFTMAX else 'indexing along'} the sharded dim")
        return dim - (d < dim and t in drops)
    if t in oc.SPLITS:
        if int(arg(n, 2, "dim", 0)) % nd == dim:
            raise Touches("split along the sharded dim")
        return dim
    if t is oc.LINEAR:
        if dim == nd - 1:
            raise Touches("linear over the sharded dim")
        return dim
    if t in oc.LAYER_NORMS or t is aten.rms_norm.default:
        if dim >= nd - len(args[1]):
            raise Touches("normalisation over the sharded dim")
        return dim
    if t is aten.repeat.default:  # (x, repeats): leading repeats add dims; GQA repeats K/V heads this way
        lead = len(args[1]) - nd
        if int(args[1][lead + dim]) != 1:
            raise Touches("repeat along the sharded dim")
        return dim + lead
    if t is aten.repeat_interleave.self_int:  # (x, repeats, dim=None): no dim flattens x first
        d = arg(n, 2, "dim", None)
        if d is None or int(d) % nd == dim:
            raise Touches("repeat_interleave along the sharded dim")
        return dim
    raise KeyError(t)


def broadcast_dim(n: fx.Node, a: fx.Node, dim: int) -> int:
    """Output dim of ``n`` that input ``a``'s dim ``dim`` is aligned with under broadcasting."""
    return dim + val(n).dim() - val(a).dim()


def resize_view(n: fx.Node, k: int, local: int) -> Optional[tuple]:
    """``n``'s arguments with the size of output dim ``k`` set to ``local`` (view / reshape / unflatten /
    expand; a ``-1`` stays), or None when nothing needs rewriting."""
    x, t = n.args[0], n.target
    if t in oc.SIZE_VIEWS or t is aten.expand.default:
        sizes = list(n.args[1])
        if sizes[k] == -1 or sizes[k] == local:
            return None
        sizes[k] = local
        return (x, sizes) + tuple(n.args[2:])
    if t is aten.unflatten.int:
        d, sizes = int(n.args[1]) % val(x).dim(), list(n.args[2])
        if not d <= k < d + len(sizes) or sizes[k - d] == -1:
            return None
        sizes[k - d] = local
        return (x, n.args[1], sizes)
    return None


def split_sizes(n: fx.Node, full: int) -> Tuple[int, ...]:
    """Piece sizes of a :data:`~op_classes.SPLITS` node applied to a dim of ``full`` elements."""
    a = n.args[1]
    if n.target is aten.chunk.default or isinstance(a, int):
        c = -(-full // int(a)) if n.target is aten.chunk.default else int(a)
        return tuple([c] * (full // c) + ([full % c] if full % c else []))
    return tuple(int(s) for s in a)


def split_dim(n: fx.Node) -> int:
    return int(arg(n, 2, "dim", 0)) % val(n.args[0]).dim()


def segment_cut(lengths: Sequence[int], cuts: Sequence[int]) -> Optional[List[int]]:
    """Indices into the boundaries of consecutive segments of ``lengths`` at the cut points ``cuts``
    (a later cut takes the last of equal boundaries); None when a cut falls inside a segment."""
    bounds = list(itertools.accumulate(lengths, initial=0))
    if any(c not in bounds for c in cuts):
        return None
    return [bounds.index(c) if not i else len(bounds) - 1 - bounds[::-1].index(c) for i, c in enumerate(cuts)]


def segment_runs(lengths: Sequence[int], world: int, rank: int) -> List[Tuple[int, int]]:
    """``(start, length)`` on the full dim of rank ``rank``'s piece of each segment of ``lengths``: every
    segment split by :func:`~dit_passes.parallel.attention.even_shard_sizes`, a shard the pieces in order."""
    runs, base = [], 0
    for n in lengths:
        sizes = even_shard_sizes(n, world)
        runs.append((base + sum(sizes[:rank]), sizes[rank]))
        base += n
    return runs


def view_dims(src: Sequence[int], dst: Sequence[int], dim: int, cuts: Sequence[int]):
    """The one view-mapping rule: output dims ``e`` of a row-major reshape ``src -> dst`` on which the
    pieces of input ``dim`` between ``cuts`` stay whole slabs (the dims before ``e`` keep the product of
    those before ``dim``; the product of those after ``e`` divides every cut, counted in elements),
    each with the cuts along ``e``, innermost candidates last."""
    pre, inner = math.prod(src[:dim]), math.prod(src[dim + 1:])
    for e in range(len(dst)):
        step = math.prod(dst[e + 1:])
        if math.prod(dst[:e]) == pre and all(c * inner % step == 0 for c in cuts):
            yield e, [c * inner // step for c in cuts]


def agree(n: fx.Node, place_of: Callable[[Any], Any], inputs: Sequence[Any], error: Callable[[str], Exception]):
    """The placement of a broadcasting op's output: every placed input's, moved to the output's dims
    (they must be equal, else ``error``); None when no input is placed."""
    nd, ref = val(n).dim(), None
    for a in inputs:
        p = place_of(a)
        if p is not None:
            p = p.with_dim(p.dim + nd - val(a).dim())
            if ref is not None and p != ref:
                raise error(f"operands sharded differently ({ref} vs {p})")
            ref = p
    return ref


def aligned_dim(n: fx.Node, a: Any, dim: int) -> Optional[int]:
    """The dim of tensor operand ``a`` aligned with output dim ``dim`` of broadcasting op ``n``, None
    when ``a`` is not a tensor or is broadcast (size 1 or absent) along it."""
    if not is_tensor(a):
        return None
    j = dim - val(n).dim() + val(a).dim()
    return j if j >= 0 and shape(a)[j] != 1 else None


def memory_order(t: torch.Tensor) -> Tuple[int, ...]:
    """The dims of ``t`` from outermost to innermost in memory (stride order; ties by position)."""
    stride = t.stride()
    return tuple(sorted(range(len(stride)), key=lambda d: (-stride[d], d)))


def same_shapes(a, b, strides: bool = False) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tuple(a.shape) == tuple(b.shape) and (not strides or a.stride() == b.stride())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_shapes(x, y, strides) for x, y in zip(a, b))
    return a is None and b is None


class PropagationError(RuntimeError):
    """An op of the rewritten graph fails on its new (local) fake inputs: the rewrite would crash there."""

    def __init__(self, node: fx.Node, error: Exception):
        self.node, self.error = node, error
        path = node.meta.get("dit_module_path", "") or "<top level>"
        super().__init__(f"node '{node.name}' ({node.target}, module {path}) fails on its rewritten inputs: "
                         f"{type(error).__name__}: {' '.join(str(error).split())}")


def repropagate(g: fx.Graph, touched: Set[fx.Node], shape_fns: Optional[Dict[fx.Node, Callable]] = None,
                changed: Sequence[fx.Node] = (), strides: bool = False) -> None:
    """Recompute ``meta["val"]`` (local shapes) of the ``touched`` nodes and of every node an input of
    which changed shape (``changed``: nodes, e.g. resharded parameters, already changed); ``strides``: a
    changed layout (same shape) counts as a change too, so that a view the old layout allowed is checked
    again. Raises :class:`PropagationError` naming the first node that fails."""
    shape_fns, changed = shape_fns or {}, set(changed)
    for n in g.nodes:
        if n.op != "call_function" or n.meta.get("dit_no_val"):
            continue
        if n in touched or any(a in changed for a in n.all_input_nodes):
            old = n.meta.get("val")
            try:
                set_val(n, shape_fns.get(n))
            except (RuntimeError, ValueError, TypeError, IndexError) as e:  # the op refuses its fake inputs
                raise PropagationError(n, e) from e
            if not same_shapes(old, n.meta["val"], strides):
                changed.add(n)


class Propagation:
    """Placements of the values of one graph and the nodes the rewrite inserted (see the module doc)."""

    def __init__(self, gm: fx.GraphModule, group_name: str, world: int, rank: int):
        self.gm, self.g = gm, gm.graph
        self.group, self.world, self.rank = group_name, world, rank
        self.place: Dict[fx.Node, Any] = {}
        self.inserted: Set[fx.Node] = set()
        self.counts: collections.Counter = collections.Counter()
        self.vals_now = False  # True: emitted nodes get their meta["val"] at once, not from repropagate()

    def placed(self, a: Any) -> Any:
        """The placement of ``a`` (None: replicated, or not a node)."""
        return self.place.get(a) if isinstance(a, fx.Node) else None

    def emit(self, target, args, kwargs=None, like: Optional[fx.Node] = None) -> fx.Node:
        """A new call at the current insertion point, with ``like``'s module path (and its own
        ``meta["val"]`` now if ``vals_now``; otherwise :func:`repropagate` computes it)."""
        node = self.g.call_function(target, tuple(args), kwargs or {})
        if like is not None:
            copy_meta(node, like)
        self.inserted.add(node)
        return set_val(node) if self.vals_now else node

    def walk(self, nodes: Sequence[fx.Node], rule: Callable[[fx.Node], Any]) -> None:
        """``rule(n)`` for each call of ``nodes`` (in order) that reads a placed value; a non-None
        result is ``n``'s placement."""
        for n in nodes:
            if n.op != "call_function" or n in self.inserted or not any(a in self.place for a in n.all_input_nodes):
                continue
            out = rule(n)
            if out is not None:
                self.place[n] = out

    def all_reduce(self, x: fx.Node, like: fx.Node, op: str = "sum") -> fx.Node:
        r = self.emit(c10d.all_reduce.default, (x, op, self.group), like=like)
        return self.emit(c10d.wait_tensor.default, (r,), like=like)

    def all_gather(self, x: fx.Node, dim: int, sizes: Sequence[int], like: fx.Node,
                   runs: Optional[Sequence[Tuple[int, int]]] = None) -> fx.Node:
        """The full value of ``x`` (rank ``r`` holds ``sizes[r]`` along ``dim``): one
        ``all_gather_into_tensor`` of the shards padded to the largest, then the pieces in order;
        ``runs`` (default: every rank's whole shard) lists ``(start, length)`` within each shard, all
        ranks' piece of a run before the next run (a value made of segments, each sharded)."""
        big, mine, emit = max(sizes), sizes[self.rank], self.emit
        y = x
        if mine < big:
            pad = [0, 0] * (val(x).dim() - 1 - dim) + [0, big - mine]
            y = emit(aten.constant_pad_nd.default, (y, pad, 0.0), like=like)
        y = emit(aten.contiguous.default, (y,), like=like)
        y = emit(c10d.all_gather_into_tensor.default, (y, self.world, self.group), like=like)
        y = emit(c10d.wait_tensor.default, (y,), like=like)
        n0, pieces = big if dim == 0 else int(val(x).shape[0]), []  # each rank's rows in the gathered dim 0
        for start, length in runs or [(0, None)]:
            for j, size in enumerate(sizes):
                p = emit(aten.slice.Tensor, (y, 0, j * n0, (j + 1) * n0), like=like)
                stop = size if length is None else start + length
                if start or stop < big:
                    p = emit(aten.slice.Tensor, (p, dim, start, stop), like=like)
                pieces.append(p)
        return emit(aten.cat.default, (pieces, dim), like=like)
