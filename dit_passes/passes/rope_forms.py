"""The rotary embeddings :class:`~dit_passes.passes.norm_rope.FuseNormRope` recognises besides the real
``y * cos + rotate(y) * sin``: what each computes, found by dataflow, and the proof that it is the op's rotation.

The op (``dit_passes::rms_norm_rope``) rotates each interleaved pair ``(a, b) = (y[2j], y[2j+1])`` as::

    out[2j]   = a * cos[2j]   + (-b) * sin[2j]
    out[2j+1] = b * cos[2j+1] +   a  * sin[2j+1]          (in fp32, rounded once to y's dtype)

**complex** (Qwen-Image, Z-Image: diffusers' ``use_real=False``)::

    z   = view_as_complex(reshape(y or to(y, f32), [..., D/2, 2]))
    out = flatten(view_as_real(z * freqs), -2)            (then a cast back to y's dtype; a view / reshape for flatten)

``(a + ib)(c + id) = (ac - bd) + i(bc + ad)``: the op's rotation with ``cos[2j] = cos[2j+1] = c_j = real(freqs)`` and
``sin[2j] = sin[2j+1] = d_j = imag(freqs)``, each component two fp32 products and one sum, as the op computes
them (``ac - bd`` is ``ac + (-b)d`` exactly). Where PyTorch's complex kernel contracts a product and a sum into one
FMA the two differ by one rounding of the component. Taken only for complex64 (fp32 parts); freqs in complex128
computes in fp64 and is left (``compute_dtype``).

**scatter** (Wan: pairs split by ``unbind``, written back into an ``empty_like`` through strided slices)::

    x1, x2 = unbind(reshape(y, [..., D/2, 2]), -1)
    out = empty_like(y); out[..., 0::2] = x1 * c - x2 * s; out[..., 1::2] = x1 * s + x2 * c

(functionalised: ``slice_scatter(slice_scatter(empty_like(y), copy(slice(..), even), d, 0, end, 2), copy(..), d, 1,
end, 2)``, either slot first, the products in any order). The op's rotation with ``cos[2j] = cos[2j+1] = c_j`` and
``sin[2j] = sin[2j+1] = s_j``, provided the even and the odd slot read the same ``c`` and the same ``s`` (checked: the
same nodes) and compute in fp32; the copy rounds to y's dtype as the op does. Bit for bit.

Both give per-pair tables (``D/2`` wide); the pass widens them to the op's per-element tables with
``repeat_interleave(t, 2, -1)`` (small: the tables broadcast over batch and heads).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten
VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unflatten.int)
_END = (None, 9223372036854775807)


@dataclasses.dataclass(frozen=True)
class Rotation:
    """A rotary embedding of y found in the graph."""
    y: fx.Node                  # the rotated value (before any upcast)
    end: fx.Node                # the rotation's last node (its value: the rotated y, in fp32 or y's dtype)
    nodes: frozenset            # the rotation's nodes, end included, y not
    cos: fx.Node                # per-pair tables (D/2 wide), or the complex freqs for form "complex"
    sin: Optional[fx.Node]
    form: str                   # "complex" or "scatter"
    fp32: bool                  # computes in fp32 (else: left, compute_dtype)


def call_to(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def shape_of(n) -> Optional[Tuple[int, ...]]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype_of(n) -> Optional[torch.dtype]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def uncast(n) -> Tuple[object, Optional[torch.dtype]]:
    """(source, dtype) of a plain dtype cast (``to``, ``_to_copy`` with only a dtype, ``type_as``); (n, None) else."""
    if call_to(n, aten.to.dtype) and len(n.args) == 2 and not n.kwargs:
        return n.args[0], n.args[1]
    if call_to(n, aten._to_copy.default) and len(n.args) == 1 and set(n.kwargs) == {"dtype"}:
        return n.args[0], n.kwargs["dtype"]
    if call_to(n, aten.type_as.default) and len(n.args) == 2 and not n.kwargs and dtype_of(n.args[1]) is not None:
        return n.args[0], dtype_of(n.args[1])
    return n, None


def _pairs_of(view) -> Optional[fx.Node]:
    """y when ``view`` is a row-major view of y to ``[..., D/2, 2]``."""
    if not call_to(view, *VIEWS):
        return None
    y, vs = view.args[0], shape_of(view)
    ys = shape_of(y)
    if ys is None or vs is None or not ys or ys[-1] % 2 or vs != ys[:-1] + (ys[-1] // 2, 2):
        return None
    return y


def complex_rotation(end) -> Optional[Rotation]:
    """The complex form (module docstring) ending at ``end``, the flatten (or view) of ``view_as_real``."""
    if not call_to(end, aten.flatten.using_ints, *VIEWS):
        return None
    vr = end.args[0]
    if not call_to(vr, aten.view_as_real.default) or len(vr.users) != 1:
        return None
    prod = vr.args[0]
    if not (call_to(prod, aten.mul.Tensor) and len(prod.args) == 2 and not prod.kwargs and len(prod.users) == 1):
        return None
    for z, freqs in (prod.args, prod.args[::-1]):
        if not (call_to(z, aten.view_as_complex.default) and isinstance(freqs, fx.Node) and len(z.users) == 1):
            continue
        view = z.args[0]
        y32 = _pairs_of(view)
        if y32 is None or len(view.users) != 1:
            continue
        y, cast = uncast(y32)
        ys, zs, fs = shape_of(y), shape_of(z), shape_of(freqs)
        if shape_of(end) != ys or fs is None or torch.broadcast_shapes(fs, zs) != zs or shape_of(prod) != zs:
            continue
        rank = len(ys)
        if call_to(end, aten.flatten.using_ints):  # flatten(vr, rank - 1): the pairs back into the last dim
            start = end.args[1] if len(end.args) > 1 else 0
            stop = end.args[2] if len(end.args) > 2 else -1
            if start % (rank + 1) != rank - 1 or stop % (rank + 1) != rank:
                continue
        # the upcast read by the rotation, or by the cast back that names it for its dtype (``type_as(out,
        # x.float())``: Z-Image in fp32, where ``float()`` is x itself)
        if cast is not None and any(u is not view and not (call_to(u, aten.type_as.default) and u.args[1] is y32)
                                    for u in y32.users):
            continue
        nodes = {end, vr, prod, z, view} | ({y32} if cast is not None else set())
        fp32 = dtype_of(prod) == torch.complex64 and dtype_of(y32) == torch.float32
        return Rotation(y, end, frozenset(nodes), freqs, None, "complex", fp32)
    return None


def _strided_slot(s, dim: int) -> Optional[Tuple[fx.Node, int]]:
    """(base, start) when s is ``slice(base, dim, start, end, 2)`` covering base's dim from start with step 2."""
    if not (call_to(s, aten.slice.Tensor) and not s.kwargs and len(s.args) == 5):
        return None
    base, d, start, stop, step = s.args
    rank = len(shape_of(base) or ())
    if not rank or d % rank != dim or step != 2 or start not in (0, 1) or stop not in _END:
        return None
    return base, start


def _products(n, op) -> Optional[Tuple[Tuple[fx.Node, fx.Node], Tuple[fx.Node, fx.Node], set]]:
    """((a, b), (c, d), nodes) when n is ``op(a * b, c * d)`` with every part a node."""
    if not (call_to(n, op) and len(n.args) == 2 and not n.kwargs):
        return None
    p, q = n.args
    if not all(call_to(m, aten.mul.Tensor) and len(m.args) == 2 and not m.kwargs and len(m.users) == 1
               and all(isinstance(a, fx.Node) for a in m.args) for m in (p, q)):
        return None
    return tuple(p.args), tuple(q.args), {n, p, q}


def _factor(pair, x) -> Optional[fx.Node]:
    """The other factor of the product ``pair`` when one of its factors is x."""
    a, b = pair
    return b if a is x else a if b is x else None


def scatter_rotation(end) -> Optional[Rotation]:
    """The scatter form (module docstring) ending at ``end``, the second ``slice_scatter``."""
    if not (call_to(end, aten.slice_scatter.default) and len(end.args) == 6 and not end.kwargs):
        return None
    ys = shape_of(end)
    if not ys or ys[-1] % 2:
        return None
    last = len(ys) - 1
    slots, nodes, base = {}, {end}, end
    for _ in range(2):  # the two scatters, outermost first
        if not call_to(base, aten.slice_scatter.default) or len(base.args) != 6 or base.kwargs:
            return None
        inner, cp, d, start, stop, step = base.args
        if d % len(ys) != last or step != 2 or start not in (0, 1) or stop not in _END or start in slots:
            return None
        if not (call_to(cp, aten.copy.default) and len(cp.args) == 2 and len(cp.users) == 1):
            return None
        slot = _strided_slot(cp.args[0], last)
        if slot is None or slot != (inner, start) or len(cp.args[0].users) != 1:
            return None
        if base is not end and len(base.users) != 2:  # read by the outer scatter and its slot's slice
            return None
        slots[start] = cp.args[1]
        nodes |= {base, cp, cp.args[0]}
        base = inner
    empty = base
    if not (call_to(empty, aten.empty_like.default) and len(empty.users) == 2):
        return None
    y = empty.args[0]
    nodes.add(empty)
    if shape_of(y) != ys or dtype_of(y) != dtype_of(end):
        return None
    even, odd = _products(slots[0], aten.sub.Tensor), _products(slots[1], aten.add.Tensor)
    if even is None or odd is None:
        return None
    (p0, p1, even_nodes), (q0, q1, odd_nodes) = even, odd
    # even = x1 * c - x2 * s, odd = x1 * s + x2 * c (or x2 * c + x1 * s): x1, x2 the pairs of y
    for x1 in p0:
        c = _factor(p0, x1)
        for x2 in p1:
            s = _factor(p1, x2)
            found = _check_pairs(y, x1, x2)
            if found is None:
                continue
            for r, t in ((q0, q1), (q1, q0)):  # r = x1 * s, t = x2 * c
                if _factor(r, x1) is s and _factor(t, x2) is c:
                    fp32 = all(dtype_of(v) == torch.float32 for v in (slots[0], slots[1]))
                    shapes = [shape_of(v) for v in (c, s, slots[0], slots[1])]
                    half = ys[:-1] + (ys[-1] // 2,)
                    if any(v is None for v in shapes) or shapes[2] != half or shapes[3] != half \
                            or any(torch.broadcast_shapes(v, half) != half for v in shapes[:2]):
                        return None
                    return Rotation(y, end, frozenset(nodes | even_nodes | odd_nodes | found), c, s, "scatter",
                                    fp32)
    return None


def _check_pairs(y, x1, x2) -> Optional[set]:
    """The nodes of ``x1, x2 = unbind(view(y, [..., D/2, 2]), -1)`` (getitems 0 and 1 of one unbind)."""
    if not (call_to(x1, operator.getitem) and call_to(x2, operator.getitem) and x1.args[0] is x2.args[0]
            and (x1.args[1], x2.args[1]) == (0, 1)):
        return None
    unbind = x1.args[0]
    if not call_to(unbind, aten.unbind.int) or _pairs_of(unbind.args[0]) is not y:
        return None
    rank = len(shape_of(unbind.args[0]))
    if (unbind.args[1] if len(unbind.args) > 1 else 0) % rank != rank - 1 or len(unbind.args[0].users) != 1:
        return None
    if any(u not in (x1, x2) for u in unbind.users):
        return None
    return {x1, x2, unbind, unbind.args[0]}


__all__ = ["Rotation", "complex_rotation", "scatter_rotation", "call_to", "shape_of", "dtype_of", "uncast", "VIEWS"]
