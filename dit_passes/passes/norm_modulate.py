"""FuseNormModulate: AdaLN's LayerNorm and its modulation (and a gated residual before them) become one op.

Why: a DiT block normalises its residual stream and modulates it by the timestep, ``LN(h) * (1 + scale) +
shift``, twice or more per block. Inductor writes that as a looped reduction over the 3072-wide row (its persistent
reductions stop at 1024 columns), reading the row twice; ``dit_passes::layer_norm_modulate`` reads it once, with
the gated residual ``h = r + gate * y`` before it too (FLUX's shapes on an H100:
``bench/results/ln_modulate_kernel_h100.json``). On CUDA the op is
one Triton launch (``dit_passes.kernels.ln_modulate_triton``); elsewhere the ATen ops it replaces, so the CPU result
is the original's bit for bit.

Contract: phase ``FUSE_POINTWISE`` (this rank's shard; before the cache passes and RegionalCompile, which move and
compile the blocks). Matches, with every intermediate read only inside the match::

    n   = layer_norm(x, [D], w, b, eps)          (or native_layer_norm(...)[0]; w / b optional)
    out = n * m + a                              (either operand order, or addcmul(a, n, m))

where ``m`` and ``a`` broadcast to ``x``'s shape (``1 + scale`` and ``shift``, computed as they were), with
optional casts: of ``x`` before the norm (an fp32 LayerNorm of a bf16 stream: Wan's ``FP32LayerNorm``), of ``n``
after it, and of ``out``. When ``x = r + gate * y`` (or ``r + y``) of one dtype, in the same block, and every
other reader of ``x`` comes after ``out``, the residual joins the op, which returns ``(x, out)``. A cast of ``x``
read elsewhere too (Wan's ``type_as`` of the residual stream, a no-op in fp32) stays: the op reads the cast.

Before (a FLUX double-stream block's second norm, bf16)::

    mul_17 = aten.mul.Tensor(unsqueeze_16, dropout)                 # gate_msa * attn_output
    add_8 = aten.add.Tensor(linear, mul_17)                         # the residual stream, read again later
    layer_norm_2 = aten.layer_norm.default(add_8, [3072], None, None, 1e-06, False)
    add_9 = aten.add.Tensor(unsqueeze_17, 1)
    mul_18 = aten.mul.Tensor(layer_norm_2, add_9)
    add_10 = aten.add.Tensor(mul_18, unsqueeze_18)

After::

    add_9 = aten.add.Tensor(unsqueeze_17, 1)
    ln = dit_passes.residual_layer_norm_modulate.default(linear, dropout, unsqueeze_16, None, None, 1e-06,
                                                         add_9, unsqueeze_18)
    add_8 = ln[0]; add_10 = ln[1]

``counts``: ``fused`` (norms rewritten), ``with_residual`` (of them, those that took the residual) and
``skipped_<reason>`` (``shared``: the norm's or the product's value is read outside the match; ``shape``: ``m`` /
``a`` do not broadcast to the rows, rows wider than the kernel's ``MAX_D``, or a rank above 3; ``dtype``: not a
float computation). A LayerNorm with no modulation after it is not a candidate and not counted.
"""
from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any, Optional, Tuple

import torch
import torch.fx as fx

from ..analysis.blocks import _block_key
from ..infra.graph_utils import copy_meta
from ..infra.pass_base import Pass, PassContext, PassResult, skipped_summary
from ..infra.phases import Phase
from .norm_rope import _call, _dtype, _erase, _shape, _uncast, kernel_module

aten = torch.ops.aten
MAX_D = 16384  # the widest row dit_passes.kernels.ln_modulate_triton takes (its MAX_D; a test checks they agree)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def layer_norm_modulate_reference(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                                  eps: float, scale: torch.Tensor, shift: torch.Tensor, scale_plus_one: bool = False,
                                  in_dtype: Optional[torch.dtype] = None, norm_dtype: Optional[torch.dtype] = None,
                                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The ATen ops the op replaces (module docstring); a dtype of None: no cast there."""
    n = torch.layer_norm(_cast(x, in_dtype), [x.shape[-1]], weight, bias, eps)
    m = scale + 1 if scale_plus_one else scale  # in scale's dtype, as the graph had it
    return _cast(_cast(n, norm_dtype) * m + shift, out_dtype)


def residual_layer_norm_modulate_reference(residual: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor],
                                           weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                                           scale: torch.Tensor, shift: torch.Tensor, scale_plus_one: bool = False,
                                           in_dtype: Optional[torch.dtype] = None,
                                           norm_dtype: Optional[torch.dtype] = None,
                                           out_dtype: Optional[torch.dtype] = None
                                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    h = residual + (gate * y if gate is not None else y)
    return h, layer_norm_modulate_reference(h, weight, bias, eps, scale, shift, scale_plus_one, in_dtype, norm_dtype,
                                            out_dtype)


def _kernel():
    return kernel_module("ln_modulate_triton", "layer_norm_modulate")


def _out_dtype(x, scale, shift, in_dtype, norm_dtype, out_dtype) -> torch.dtype:
    """The dtype the replaced ops produce (PyTorch's promotion along the chain)."""
    if out_dtype is not None:
        return out_dtype
    n = norm_dtype or in_dtype or x.dtype
    return torch.promote_types(torch.promote_types(n, scale.dtype), shift.dtype)


def _on_kernel(x: torch.Tensor, *others) -> bool:
    kernel = _kernel() if x.is_cuda else None
    return kernel is not None and kernel.is_supported(x) and all(o is None or o.is_cuda for o in others)


@torch.library.custom_op("dit_passes::layer_norm_modulate", mutates_args=())
def layer_norm_modulate(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                        scale: torch.Tensor, shift: torch.Tensor, scale_plus_one: bool = False,
                        in_dtype: Optional[torch.dtype] = None, norm_dtype: Optional[torch.dtype] = None,
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``LN(x) * scale + shift`` (``* (1 + scale)`` with ``scale_plus_one``) over the last dim, with the casts
    named; on CUDA one Triton launch computing in fp32 (the ``1 +`` too, as Inductor's fused kernel did) and
    rounding once to the output's dtype."""
    if not _on_kernel(x, weight, bias, scale, shift):
        return layer_norm_modulate_reference(x, weight, bias, eps, scale, shift, scale_plus_one, in_dtype, norm_dtype,
                                             out_dtype).contiguous()  # the layout the fake implementation gives
    out = x.new_empty(x.shape, dtype=_out_dtype(x, scale, shift, in_dtype, norm_dtype, out_dtype))
    return _kernel().layer_norm_modulate_into(x, weight, bias, eps, scale, shift, out, scale_plus_one=scale_plus_one)


@layer_norm_modulate.register_fake
def _(x, weight, bias, eps, scale, shift, scale_plus_one=False, in_dtype=None, norm_dtype=None, out_dtype=None):
    return x.new_empty(x.shape, dtype=_out_dtype(x, scale, shift, in_dtype, norm_dtype, out_dtype))


@torch.library.custom_op("dit_passes::residual_layer_norm_modulate", mutates_args=())
def residual_layer_norm_modulate(residual: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor],
                                 weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                                 scale: torch.Tensor, shift: torch.Tensor, scale_plus_one: bool = False,
                                 in_dtype: Optional[torch.dtype] = None, norm_dtype: Optional[torch.dtype] = None,
                                 out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * y`` and ``LN(h) * scale + shift``: returns ``(h, out)``; on CUDA one launch that
    reads the two rows once and writes both (``h`` rounded to its dtype before the norm reads it)."""
    if not _on_kernel(y, residual, gate, weight, bias, scale, shift):
        h, out = residual_layer_norm_modulate_reference(residual, y, gate, weight, bias, eps, scale, shift,
                                                        scale_plus_one, in_dtype, norm_dtype, out_dtype)
        return h.contiguous(), out.contiguous()  # the layouts the fake implementation gives
    h = torch.empty_like(y, memory_format=torch.contiguous_format)
    out = y.new_empty(y.shape, dtype=_out_dtype(y, scale, shift, in_dtype, norm_dtype, out_dtype))
    _kernel().layer_norm_modulate_into(y, weight, bias, eps, scale, shift, out, residual=residual, gate=gate,
                                       h_out=h, scale_plus_one=scale_plus_one)
    return h, out


@residual_layer_norm_modulate.register_fake
def _(residual, y, gate, weight, bias, eps, scale, shift, scale_plus_one=False, in_dtype=None, norm_dtype=None,
      out_dtype=None):
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            y.new_empty(y.shape, dtype=_out_dtype(y, scale, shift, in_dtype, norm_dtype, out_dtype)))


class FuseNormModulate(Pass):
    """Write ``LN(x) * m + a`` (with ``x = r + gate * y`` folded in where it can) as one op of ours."""

    name = "fuse_norm_modulate"
    phase = Phase.FUSE_POINTWISE
    invalidates = ("structure",)  # the blocks' norms are no longer aten nodes

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        g = gm.graph
        fused, residual, skipped = 0, 0, {}
        order, gone = {n: i for i, n in enumerate(g.nodes)}, set()
        for n in list(g.nodes):
            if n in gone:  # erased by an earlier match
                continue
            match = _match(n, order)
            if match is None:
                continue
            if isinstance(match, str):
                skipped[match] = skipped.get(match, 0) + 1
                continue
            self._rewrite(g, match)
            gone |= match.nodes
            fused, residual = fused + 1, residual + (match.res is not None)
        g.lint()
        ctx.recompile_at_end(gm)
        left, left_text = skipped_summary(skipped, "left to Inductor")
        report = (f"{fused} LayerNorm + modulation as one op ({residual} with the residual before them)" if fused
                  else "no LayerNorm followed by a modulation") + left_text
        if not fused:  # said, not only recorded: a pass asked for that found nothing is worth knowing
            warnings.warn(f"{self.name} rewrote nothing: {report}", stacklevel=2)
        return PassResult(fused > 0, {"fused": fused, "with_residual": residual, **left}, report)

    @staticmethod
    def _rewrite(g: fx.Graph, m: "_Match") -> None:
        tail = [m.plus_one, m.in_dtype, m.norm_dtype, m.out_dtype]
        while tail and tail[-1] in (None, False):  # defaults left out
            tail.pop()
        common = (m.weight, m.bias, m.eps, m.scale, m.shift, *tail)
        with g.inserting_before(m.last):
            if m.res is None:
                new = g.call_function(torch.ops.dit_passes.layer_norm_modulate.default, (m.x,) + common)
                new.meta.update(m.last.meta)
                outs = [(m.last, new)]
            else:
                r, y, gate, add = m.res
                new = g.call_function(torch.ops.dit_passes.residual_layer_norm_modulate.default,
                                      (r, y, gate) + common)
                h, out = (g.call_function(operator.getitem, (new, i)) for i in range(2))
                new.meta["val"] = (add.meta["val"], m.last.meta["val"])
                h.meta.update(add.meta)
                out.meta.update(m.last.meta)
                outs = [(m.last, out), (add, h)]
        copy_meta(new, m.norm)  # the norm's module path (a block's norm1 / norm2)
        for old, repl in outs:
            old.replace_all_uses_with(repl)
        _erase(g, m.nodes)


# ------------------------------------------------------------------------------------------------ matching
@dataclasses.dataclass
class _Match:
    last: fx.Node                   # the node the op's output replaces (the sum, or its cast)
    norm: fx.Node                   # the LayerNorm's value (its module path goes to the op)
    x: fx.Node
    weight: Any
    bias: Any
    eps: float
    scale: fx.Node                  # m, or s of ``m = s + 1`` with plus_one
    shift: fx.Node
    plus_one: bool
    in_dtype: Optional[torch.dtype]
    norm_dtype: Optional[torch.dtype]
    out_dtype: Optional[torch.dtype]
    nodes: set                      # the matched nodes, erased once the op replaces them
    res: Optional[Tuple[fx.Node, fx.Node, Optional[fx.Node], fx.Node]] = None  # (r, y, gate, x's add)


def _layer_norm(n) -> Optional[Tuple[fx.Node, object, object, float, set]]:
    """(x, weight, bias, eps, nodes) when n is a LayerNorm over the last dim: ``aten.layer_norm`` or
    ``native_layer_norm(...)[0]`` whose statistics are not read."""
    nodes = {n}
    if _call(n, operator.getitem) and n.args[1] == 0 and _call(n.args[0], aten.native_layer_norm.default):
        ln = n.args[0]
        if any(u is not n for u in ln.users):
            return None
        nodes.add(ln)
    elif _call(n, aten.layer_norm.default) and not n.kwargs:
        ln = n
    else:
        return None
    x, shape = ln.args[0], ln.args[1]
    xs = _shape(x)
    if not isinstance(x, fx.Node) or xs is None or not xs or list(shape) != [xs[-1]]:
        return None
    w = ln.args[2] if len(ln.args) > 2 else None
    b = ln.args[3] if len(ln.args) > 3 else None
    eps = ln.args[4] if len(ln.args) > 4 else 1e-5
    return x, w, b, float(eps), nodes


def _modulation(last) -> Optional[Tuple[fx.Node, fx.Node, fx.Node, set]]:
    """(product side n, m, a, nodes) when last is ``n * m + a`` (``add(mul(..), ..)`` in any order or
    ``addcmul(a, n, m)``); the product read only by the add. n is the side that is a (cast) LayerNorm."""
    if _call(last, aten.addcmul.default) and len(last.args) == 3 and last.kwargs.get("value", 1) == 1:
        a, t1, t2 = last.args
        for n, m in ((t1, t2), (t2, t1)):
            if _layer_norm(_uncast(n)[0]) is not None and isinstance(m, fx.Node) and isinstance(a, fx.Node):
                return n, m, a, {last}
        return None
    if not (_call(last, aten.add.Tensor) and len(last.args) == 2 and not last.kwargs):
        return None
    for p, a in (last.args, last.args[::-1]):
        if not (_call(p, aten.mul.Tensor) and len(p.args) == 2 and not p.kwargs and isinstance(a, fx.Node)):
            continue
        for n, m in (p.args, p.args[::-1]):
            if isinstance(m, fx.Node) and isinstance(n, fx.Node) and _layer_norm(_uncast(n)[0]) is not None:
                return n, m, a, {last, p}
    return None


def _match(last: fx.Node, order):
    """None when ``last`` does not end a LayerNorm + modulation; a skip reason (str) when it ends one this pass
    leaves; else a :class:`_Match` (module docstring)."""
    found = _modulation(last)
    if found is None:
        return None
    n, m, a, nodes = found
    norm_out, norm_dtype = _uncast(n)
    x_cast, w, b, eps, ln_nodes = _layer_norm(norm_out)
    x, in_dtype = _uncast(x_cast)
    if x_cast is not x and any(u is not norm_out and u not in ln_nodes for u in x_cast.users):
        x, in_dtype = x_cast, None  # the cast read elsewhere too (Wan's no-op type_as in fp32): it stays, the op reads it
    nodes |= ln_nodes | ({n} if n is not norm_out else set()) | ({x_cast} if x_cast is not x else set())
    product = next(iter(u for u in nodes if u is not last and _call(u, aten.mul.Tensor)), None)
    end, out_dtype = last, None
    users = list(last.users)
    if len(users) == 1:
        src, to = _uncast(users[0])
        if src is last and to is not None:
            end, out_dtype = users[0], to
            nodes.add(end)
    inner = [norm_out, n, x_cast, product] + [v for v in ln_nodes if v is not norm_out]
    if any(v is not None and v is not x and v is not last and any(u not in nodes for u in v.users) for v in inner):
        return "shared"
    xs = _shape(x)
    if any(_dtype(v) not in _FLOATS for v in (x, m, a, end)):
        return "dtype"
    if len(xs) > 3 or xs[-1] > MAX_D or any(_shape(v) is None or torch.broadcast_shapes(_shape(v), xs) != xs
                                            for v in (m, a)) or _shape(end) != xs:
        return "shape"
    s = _plus_one(m)
    if s is not None:  # ``1 + scale`` read only here: its sum joins the op (in fp32 on the GPU, as Inductor had it)
        nodes.add(m)
    match = _Match(last=end, norm=norm_out, x=x, weight=w, bias=b, eps=eps, scale=m if s is None else s, shift=a,
                   plus_one=s is not None, in_dtype=in_dtype, norm_dtype=norm_dtype, out_dtype=out_dtype, nodes=nodes)
    found = _residual(x, match, order)
    if found is not None:
        match.res, residual_nodes = found
        match.nodes = nodes | residual_nodes
    return match


def _plus_one(m: fx.Node) -> Optional[fx.Node]:
    """s when m is ``s + 1`` (either order) of s's dtype, read only by the modulation's product."""
    if not (_call(m, aten.add.Tensor, aten.add.Scalar) and len(m.args) == 2 and not m.kwargs and len(m.users) == 1):
        return None
    for s, one in (m.args, m.args[::-1]):
        if isinstance(s, fx.Node) and not isinstance(one, fx.Node) and one == 1 and _dtype(s) == _dtype(m) \
                and _shape(s) == _shape(m):
            return s
    return None


def _residual(x: fx.Node, match: _Match, order):
    """((r, y, gate, the add), the nodes it joins) when x = ``r + gate * y`` / ``r + y`` can join the op: one dtype,
    the product read only by the add, every other reader of x after the op's place, and x in the norm's block (of
    any list: the module paths' list indices agree), so that the blocks stay node ranges for the passes after this
    one (the cache passes cut there)."""
    same_block = _block_key(x.meta.get("dit_module_path", "")) == _block_key(match.norm.meta.get("dit_module_path", ""))
    if not (_call(x, aten.add.Tensor) and len(x.args) == 2 and not x.kwargs) or not same_block:
        return None
    xs, xd = _shape(x), _dtype(x)
    later = order.get(match.last, -1)
    if any(u not in match.nodes and order.get(u, -1) <= later for u in x.users):
        return None
    for r, t in (x.args, x.args[::-1]):
        if not (isinstance(r, fx.Node) and isinstance(t, fx.Node) and _shape(r) == xs and _dtype(r) == xd):
            continue
        if _call(t, aten.mul.Tensor) and len(t.args) == 2 and not t.kwargs and len(t.users) == 1:
            for gate, y in (t.args, t.args[::-1]):
                if isinstance(gate, fx.Node) and isinstance(y, fx.Node) and _shape(y) == xs and _dtype(y) == xd \
                        and _dtype(gate) == xd and _shape(gate) is not None \
                        and torch.broadcast_shapes(_shape(gate), xs) == xs:
                    return (r, y, gate, x), {x, t}
        if _dtype(t) == xd and _shape(t) == xs:
            return (r, t, None, x), {x}
    return None


__all__ = ["FuseNormModulate", "layer_norm_modulate", "residual_layer_norm_modulate",
           "layer_norm_modulate_reference", "residual_layer_norm_modulate_reference", "MAX_D"]
