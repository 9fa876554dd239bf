"""FuseNormRope: the q / k RMSNorm and the rotary embedding after it become one op.

Why: Inductor writes ``rope(rms_norm(q))`` as a reduction kernel per head row whose second loop swaps the pairs of
``stack([-x1, x0], -1)``; on FLUX.1-dev's single blocks that kernel reaches about a third of an H100's memory
bandwidth (``bench/results/quant_step_epilogues_h100.json``), and the double blocks pay a norm kernel, a
concatenation and a rope kernel. ``dit_passes::rms_norm_rope`` reads each head row once and writes it once, the
parts of a concatenation straight into their place in the output (``dit_passes.kernels.norm_rope_triton`` on CUDA;
elsewhere the ATen ops it replaces, so the CPU result is the original's bit for bit).

Contract: phase ``FUSE_POINTWISE`` (after the sharding phases: it sees this rank's heads and sequence shard, and
the cos / sin tables the sequence sharding sliced). Matches the rotary embedding in its interleaved real form::

    y   = rms_norm(x, [D], w, eps)        or   cat([rms_norm(x_i, [D], w_i, eps_i), ...], dim)  (dim not last)
    x0, x1 = unbind(reshape(y, [..., D/2, 2]), -1)
    rot = flatten(stack([-x1, x0], -1), -2)
    out = to(to(y, f32) * cos + to(rot, f32) * sin, dtype(y))      (the casts absent in an fp32 model)

(the flatten also as a view / reshape to y's shape, as a graph functionalised at capture has it; the rotation also
of ``to(y, f32)``, the same values; the last cast also as ``type_as(out, y)``) with cos / sin broadcasting to y's
shape and every reader of ``y`` (and of each norm) inside the match. The norm may also be diffusers' ``RMSNorm``,
which the graph has as ATen ops (``x * rsqrt(mean(x.float() ** 2) + eps)``, the weight's product after:
``_decomposed_rms_norm``; HunyuanVideo, HunyuanImage, FramePack, Bria-FIBO's single blocks): the op gets
``decomposed=True`` and its reference repeats those ops (all parts of one op of one form). The rotation may also be
the half-split one, ``rot = cat([-x2, x1], -1)`` with x1, x2 the halves of y's last dim (``unbind(reshape(y, [...,
2, D/2]), -2)``, ``chunk(y, 2, -1)`` or ``y[..., :D/2]`` / ``y[..., D/2:]``: ``_rotated_halves``; ACE-Step, Cosmos):
the op gets ``half_split=True`` (its kernel pairs j with j + D/2). Two more rotary forms are the op's rotation with
per-pair tables (:mod:`~dit_passes.passes.rope_forms` gives each form and its proof): the complex product
``view_as_real(view_as_complex(y) * freqs)`` (Qwen-Image, Z-Image) and the pairs written back through strided
slices, ``out[..., 0::2] = x1 * c - x2 * s; out[..., 1::2] = x1 * s + x2 * c`` (Wan); the pass widens their tables
(``repeat_interleave``) for the op and counts them as ``form_complex`` / ``form_scatter``. A norm over all heads of a
token viewed as ``[..., H, D]`` before the rope (Wan's ``rms_norm_across_heads``) gives the op ``rope_dim=D``
(its grouped kernel). A rope inside an autocast-disabled region (``wrap_with_autocast(.., False, body, ..)``:
Z-Image) whose ops are all ones autocast leaves alone is inlined first (the same values under any autocast state).
A rope of one of these forms the pass leaves is counted with its reason (below); other forms (a 2 x 2 rotation
matrix, the scatter's in-place ``copy_`` of a graph not functionalised) are not recognised and not counted.
Nothing outside the match changes (but an inlined region's ops); no weight moves. A run that fuses nothing warns,
naming what it looked for and what it left.

Before (a FLUX single-stream block, bf16)::

    rms_norm_10 = aten.rms_norm.default(unflatten_15, [128], attn_norm_q_weight, 1e-06)
    reshape_6 = aten.reshape.default(rms_norm_10, [1, 4608, 24, -1, 2])
    unbind_6 = aten.unbind.int(reshape_6, -1); getitem_46 = unbind_6[0]; getitem_47 = unbind_6[1]
    stack_6 = aten.stack.default([aten.neg.default(getitem_47), getitem_46], -1)
    flatten_9 = aten.flatten.using_ints(stack_6, 3)
    add_37 = aten.add.Tensor(aten.mul.Tensor(aten.to.dtype(rms_norm_10, f32), unsqueeze_58),
                             aten.mul.Tensor(aten.to.dtype(flatten_9, f32), unsqueeze_60))
    to_52 = aten.to.dtype(add_37, torch.bfloat16)

After::

    rms_norm_rope = dit_passes.rms_norm_rope.default([unflatten_15], [attn_norm_q_weight], [1e-06],
                                                     unsqueeze_58, unsqueeze_60, 1)

``counts``: ``fused`` (rotary embeddings rewritten), ``parts`` (norms folded into them), ``form_complex`` /
``form_scatter`` (of ``fused``, those of the other forms) and ``skipped_<reason>``
(``no_norm``: the rope's input is not a norm or a concatenation of norms (a LayerNorm, a slice of a norm: the rope
of the image part of a single-stream block's tokens, or no norm at all); ``shared_norm``: a norm's output is
read outside the match; ``compute_dtype``: the rope does not compute in fp32 (rope tables cast to bf16 with the
model: Wan after ``.to(bfloat16)``, where ``from_pretrained`` keeps its rope in fp32; complex128 freqs); ``dtype``:
the output's dtype is not the input's; ``shape``: cos / sin do not broadcast to the input, an odd head size, or rows
wider than the kernel takes, ``MAX_D``: LTX-Video's norm and rope span all heads, 2048 wide, where the op would run
its reference; a norm over all heads wider than ``MAX_GROUPED`` or of rank above 3).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import operator
import warnings
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from ..infra.graph_utils import copy_meta, set_val
from ..infra.pass_base import Pass, PassContext, PassResult, skipped_summary
from ..infra.phases import Phase
from .rope_forms import Rotation, complex_rotation, scatter_rotation

aten = torch.ops.aten
# row-major reshapes: which one the graph has, its value depends only on the shape it makes (checked by the matcher)
_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unflatten.int)
MAX_D = 1024  # the widest row dit_passes.kernels.norm_rope_triton takes (its MAX_D; a test checks they agree)
MAX_GROUPED = 16384  # the widest norm over all heads its grouped kernel takes (its MAX_GROUPED; likewise)
_HALF = (torch.float16, torch.bfloat16)


def _rms_norm(x: torch.Tensor, w: Optional[torch.Tensor], eps: float, decomposed: bool) -> torch.Tensor:
    if not decomposed:
        return torch.rms_norm(x, [x.shape[-1]], w, eps)
    # diffusers' RMSNorm, op for op: the statistics in fp32, the product in x's promotion with fp32, rounded to a
    # half-precision weight's dtype before the weight (or to x's dtype without one)
    h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return h.to(x.dtype)
    return (h.to(w.dtype) if w.dtype in _HALF else h) * w


def rms_norm_rope_reference(xs: List[torch.Tensor], weights: List[Optional[torch.Tensor]], eps: List[float],
                            cos: torch.Tensor, sin: torch.Tensor, cat_dim: int,
                            decomposed: bool = False, half_split: bool = False, rope_dim: int = 0) -> torch.Tensor:
    """The ATen ops the op replaces, in the captured graph's order (module docstring)."""
    ys = [_rms_norm(x, w, e, decomposed) for x, w, e in zip(xs, weights, eps)]
    y = torch.cat(ys, cat_dim) if len(ys) > 1 else ys[0]
    if rope_dim:  # the norm spans all heads (Wan): the rope runs on its heads, the view the graph had
        y = y.unflatten(-1, (-1, rope_dim))
    if half_split:  # pairs (j, j + D/2): x1, x2 = halves, rot = cat([-x2, x1]) (the values of any of its forms)
        x1, x2 = y.chunk(2, -1)
        rot = torch.cat([-x2, x1], -1)
    else:
        x0, x1 = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
        rot = torch.stack([-x1, x0], -1).flatten(-2)
    return (y.to(torch.float32) * cos + rot.to(torch.float32) * sin).to(y.dtype)


@functools.lru_cache(maxsize=None)
def kernel_module(name: str, op: str):
    """``dit_passes.kernels.<name>``, imported once per process (the pointwise ops run ~100 times a step, from
    Python where no CUDA graph replays them); None without triton: ``op`` runs its reference, said once."""
    try:
        return importlib.import_module(f"dit_passes.kernels.{name}")
    except ImportError as e:
        warnings.warn(f"dit_passes.kernels.{name} failed to import ({e}); {op} runs its reference")
        return None


def _kernel():
    return kernel_module("norm_rope_triton", "rms_norm_rope")


@torch.library.custom_op("dit_passes::rms_norm_rope", mutates_args=())
def rms_norm_rope(xs: List[torch.Tensor], weights: List[Optional[torch.Tensor]], eps: List[float],
                  cos: torch.Tensor, sin: torch.Tensor, cat_dim: int, decomposed: bool = False,
                  half_split: bool = False, rope_dim: int = 0) -> torch.Tensor:
    """``rope(cat([rms_norm(x_i, w_i, eps_i)], cat_dim), cos, sin)``; on CUDA one Triton launch per part.
    ``decomposed``: the norm is diffusers' RMSNorm written out in ATen ops (the reference repeats them; the kernel
    computes both forms alike, in fp32, rounding once where the decomposed bf16 form rounds before its weight).
    ``half_split``: the rotation pairs element j with j + D/2 (``cat([-x2, x1], -1)``), not 2j with 2j + 1.
    ``rope_dim``: 0, or the head size when the norm spans all heads of a token (one input, its last dim a
    multiple of it): the output is ``[..., heads, rope_dim]`` and each head is rotated."""
    kernel = _kernel() if xs[0].is_cuda else None
    if rope_dim:
        if kernel is None or len(xs) != 1 or not kernel.is_supported_grouped(xs[0], rope_dim, half_split):
            return rms_norm_rope_reference(xs, weights, eps, cos, sin, cat_dim, decomposed, half_split, rope_dim)
        out = xs[0].new_empty(_cat_shape(xs, cat_dim, rope_dim))
        return kernel.rms_norm_rope_grouped_into(xs[0], weights[0], eps[0], cos.expand(out.shape),
                                                 sin.expand(out.shape), out, half_split=half_split)
    if kernel is None or not all(kernel.is_supported(x) for x in xs):
        return rms_norm_rope_reference(xs, weights, eps, cos, sin, cat_dim, decomposed, half_split, rope_dim)
    out = xs[0].new_empty(_cat_shape(xs, cat_dim, rope_dim))
    cos, sin, start = cos.expand(out.shape), sin.expand(out.shape), 0
    for x, w, e in zip(xs, weights, eps):
        n = x.shape[cat_dim]
        kernel.rms_norm_rope_into(x, w, e, cos.narrow(cat_dim, start, n), sin.narrow(cat_dim, start, n),
                                  out.narrow(cat_dim, start, n), half_split=half_split)
        start += n
    return out


@rms_norm_rope.register_fake
def _(xs, weights, eps, cos, sin, cat_dim, decomposed=False, half_split=False, rope_dim=0):
    return xs[0].new_empty(_cat_shape(xs, cat_dim, rope_dim))


def _cat_shape(xs, cat_dim: int, rope_dim: int = 0) -> List[int]:
    shape = list(xs[0].shape)
    shape[cat_dim] = sum(x.shape[cat_dim] for x in xs)
    if rope_dim:
        shape[-1:] = [shape[-1] // rope_dim, rope_dim]
    return shape


class FuseNormRope(Pass):
    """Write ``rope(rms_norm(x))`` (or of a concatenation of norms) as one ``dit_passes::rms_norm_rope``."""

    name = "fuse_norm_rope"
    phase = Phase.FUSE_POINTWISE
    invalidates = ("structure",)  # the q / k norms are no longer aten nodes

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        g = gm.graph
        fused, parts, skipped, forms, gone = 0, 0, {}, {}, set()
        _inline_rope_regions(gm)
        for n in list(g.nodes):
            if n in gone:  # erased by an earlier match
                continue
            match = _match(n)
            if match is None:
                continue
            if isinstance(match, str):
                skipped[match] = skipped.get(match, 0) + 1
                continue
            last, norms, cat_dim, cos, sin, inside, half, form, rope_dim = match
            decomposed = norms[0].decomposed
            with g.inserting_before(last):
                cos, sin = _tables(g, form, cos, sin)
                tail = [decomposed, half, rope_dim]
                while tail and not tail[-1]:  # defaults left out
                    tail.pop()
                args = ([k.x for k in norms], [k.weight for k in norms], [k.eps for k in norms], cos, sin, cat_dim,
                        *tail)
                new = g.call_function(torch.ops.dit_passes.rms_norm_rope.default, args)
            new.meta.update(last.meta)  # the rope's value: same shape and dtype
            copy_meta(new, norms[0].out)  # the norm's module path (an attention's norm_q / norm_k)
            last.replace_all_uses_with(new)
            gone |= inside | {last, *(n for k in norms for n in k.nodes)}
            _erase(g, inside | {last, *(n for k in norms for n in k.nodes)})
            fused, parts = fused + 1, parts + len(norms)
            forms[form] = forms.get(form, 0) + 1
        g.lint()
        ctx.recompile_at_end(gm)
        left, left_text = skipped_summary(skipped, "left to Inductor")
        shown = ", ".join(f"{k} {v}" for k, v in sorted(forms.items()))
        report = (f"{fused} rotary embeddings with their {parts} RMSNorms as one op each ({shown})" if fused
                  else "no RMSNorm followed by a rotary embedding of a form it knows") + left_text
        # the forms rope_forms recognises, counted apart (the real ones are the ``fused`` rest)
        if not fused:  # said, not only recorded: a pass asked for that found nothing is worth knowing
            warnings.warn(f"{self.name} rewrote nothing: {report}", stacklevel=2)
        counts = {"fused": fused, "parts": parts,
                  **{f"form_{k}": v for k, v in sorted(forms.items()) if k not in ("pairs", "half")}, **left}
        return PassResult(fused > 0, counts, report)


# what autocast leaves as it is (it changes only the matmul / convolution / reduction-type ops of its lists)
_AUTOCAST_NEUTRAL = {aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten._assert_tensor_metadata.default,
                     aten.view_as_complex.default, aten.view_as_real.default, aten.mul.Tensor, aten.add.Tensor,
                     aten.sub.Tensor, aten.neg.default, aten.unsqueeze.default, aten.flatten.using_ints,
                     aten.unbind.int, aten.stack.default, aten.cat.default, aten.slice.Tensor, operator.getitem,
                     *_VIEWS}


def _inline_rope_regions(gm: fx.GraphModule) -> int:
    """Inline each autocast-disabled region (``wrap_with_autocast(.., enabled=False, body, *args)[0]``) whose body
    is a rotary embedding of a form this pass knows and only autocast-neutral ops (Z-Image ropes under
    ``autocast(enabled=False)``): its ops compute the same under any autocast state, so they can stand in the
    graph itself, where the norm before them is. Returns how many were inlined; other regions stay."""
    g, inlined = gm.graph, 0
    for hop in list(g.nodes):
        if not (_call(hop, torch.ops.higher_order.wrap_with_autocast) and len(hop.args) > 5 and hop.args[2] is False
                and isinstance(hop.args[4], fx.Node) and hop.args[4].op == "get_attr" and len(hop.users) == 1):
            continue
        (get,) = hop.users
        body = getattr(gm, hop.args[4].target, None)
        if not (_call(get, operator.getitem) and get.args[1] == 0 and isinstance(body, fx.GraphModule)):
            continue
        nodes = list(body.graph.nodes)
        holders, out = [n for n in nodes if n.op == "placeholder"], nodes[-1]
        inner = [n for n in nodes if n.op == "call_function"]
        outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        if len(holders) != len(hop.args) - 5 or len(outs) != 1 or len(inner) != len(nodes) - len(holders) - 1 \
                or any(n.target not in _AUTOCAST_NEUTRAL for n in inner):
            continue
        end = _uncast(outs[0])[0]
        if not isinstance(end, fx.Node) or (complex_rotation(end) or scatter_rotation(end)
                                            or _real_rotation(end)) is None:
            continue
        env = dict(zip(holders, hop.args[5:]))
        with g.inserting_before(hop):
            for n in inner:  # the body's metadata asserts are not copied (Cleanup drops the graph's own)
                if n.target is not aten._assert_tensor_metadata.default:
                    env[n] = g.node_copy(n, lambda a: env[a])
        get.replace_all_uses_with(env[outs[0]])
        g.erase_node(get)
        g.erase_node(hop)
        inlined += 1
    return inlined


def _tables(g: fx.Graph, form: str, cos: fx.Node, sin: Optional[fx.Node]) -> Tuple[fx.Node, fx.Node]:
    """The op's per-element cos / sin tables: the real form's as they are; the other forms' per-pair tables (the
    complex freqs' real and imaginary parts) each value repeated for the two members of its pair
    (:mod:`~dit_passes.passes.rope_forms`)."""
    if form in ("pairs", "half"):
        return cos, sin
    if form == "complex":
        parts = set_val(g.call_function(aten.view_as_real.default, (cos,)))
        cos, sin = (set_val(g.call_function(aten.select.int, (parts, -1, i))) for i in (0, 1))
    return tuple(set_val(g.call_function(aten.repeat_interleave.self_int, (t, 2, -1))) for t in (cos, sin))


# ------------------------------------------------------------------------------------------------ matching
def _call(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _uncast(n) -> Tuple[object, Optional[torch.dtype]]:
    """(source, dtype) of a plain dtype cast ``to(x, dtype)``; (n, None) for anything else."""
    if _call(n, aten.to.dtype) and len(n.args) == 2 and not n.kwargs:
        return n.args[0], n.args[1]
    if _call(n, aten._to_copy.default) and len(n.args) == 1 and set(n.kwargs) == {"dtype"}:
        return n.args[0], n.kwargs["dtype"]
    if _call(n, aten.type_as.default) and len(n.args) == 2 and not n.kwargs and _dtype(n.args[1]) is not None:
        return n.args[0], _dtype(n.args[1])  # ``out.type_as(x)`` (JoyImage): a cast to x's dtype, x read too
    return n, None


def _dtype(n) -> Optional[torch.dtype]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _shape(n) -> Optional[Tuple[int, ...]]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _rotated(n) -> Optional[Tuple[fx.Node, set, bool]]:
    """(y, the rotation's nodes, half_split): :func:`_rotated_pairs` or :func:`_rotated_halves`."""
    if _call(n, aten.cat.default):
        return _rotated_halves(n)
    found = _rotated_pairs(n)
    return (*found, False) if found is not None else None


def _rotated_pairs(n) -> Optional[Tuple[fx.Node, set]]:
    """(y, the rotation's nodes) when n is ``flatten(stack([-x1, x0], -1), -2)`` with ``x0, x1 = unbind(reshape(y,
    [..., D/2, 2]), -1)``. The flatten may be a view / reshape to y's shape: a graph functionalised at capture (a
    model with in-place ops: Chroma, HunyuanVideo, Bria-FIBO) has its composite ops decomposed, flatten into view."""
    if not _call(n, aten.flatten.using_ints, *_VIEWS):
        return None
    st = n.args[0]
    if not (_call(st, aten.stack.default) and len(st.args[0]) == 2):
        return None
    neg, g0 = st.args[0]
    if not (_call(neg, aten.neg.default) and _call(g0, operator.getitem) and _call(neg.args[0], operator.getitem)):
        return None
    g1 = neg.args[0]
    unbind = g0.args[0]
    if unbind is not g1.args[0] or (g0.args[1], g1.args[1]) != (0, 1) or not _call(unbind, aten.unbind.int):
        return None
    reshape, y = unbind.args[0], None
    if _call(reshape, *_VIEWS):
        y = reshape.args[0]
    ys, rs, fs = _shape(y), _shape(reshape), _shape(n)
    if ys is None or rs is None or fs != ys or rs != ys[:-1] + (ys[-1] // 2, 2) or _shape(st) != rs:
        return None
    dims = len(rs)
    if (st.args[1] if len(st.args) > 1 else 0) % (dims) != dims - 1 or unbind.args[1] % dims != dims - 1:
        return None
    if _call(n, aten.flatten.using_ints):
        start = n.args[1] if len(n.args) > 1 else 0
        end = n.args[2] if len(n.args) > 2 else -1
        if start % dims != dims - 2 or end % dims != dims - 1:
            return None
    # a view / reshape of the stack to y's shape (checked above) is the flatten of its last two dims
    return y, {n, st, neg, g0, g1, unbind, reshape}


def _rotated_halves(n) -> Optional[Tuple[fx.Node, set, bool]]:
    """(y, the rotation's nodes, True) when n is ``cat([-x2, x1], -1)`` with x1, x2 the halves of y's last dim:
    ``unbind(reshape(y, [..., 2, D/2]), -2)`` (diffusers' ``use_real_unbind_dim=-2``: ACE-Step, Cosmos),
    ``chunk(y, 2, -1)`` / its ``split``, or ``y[..., :D/2]``, ``y[..., D/2:]``."""
    if not (len(n.args[0]) == 2 and len(n.args) > 1):
        return None
    ys, (neg, x1) = _shape(n), n.args[0]
    if ys is None or not ys or n.args[1] % len(ys) != len(ys) - 1 or ys[-1] % 2 or not _call(neg, aten.neg.default):
        return None
    x2, half, last = neg.args[0], ys[-1] // 2, len(ys) - 1
    if not (_shape(x1) == _shape(x2) == ys[:-1] + (half,)):
        return None
    if _call(x1, aten.slice.Tensor) and _call(x2, aten.slice.Tensor) and x1.args[0] is x2.args[0]:
        y = x1.args[0]
        bounds = [tuple(s.args[1:]) + (1,) * (5 - len(s.args)) for s in (x1, x2)]  # (dim, start, end, step)
        ok = all(d % len(ys) == last and st == 1 for d, _, _, st in bounds) and bounds[0][1] in (0, None) \
            and bounds[0][2] == half and bounds[1][1] == half and bounds[1][2] is not None and bounds[1][2] >= ys[-1]
        return (y, {n, neg, x1, x2}, True) if ok and _shape(y) == ys else None
    if not (_call(x1, operator.getitem) and _call(x2, operator.getitem) and x1.args[0] is x2.args[0]
            and (x1.args[1], x2.args[1]) == (0, 1)):
        return None
    src = x1.args[0]
    if _call(src, aten.unbind.int) and _call(src.args[0], *_VIEWS):
        y = src.args[0].args[0]
        ok = _shape(src.args[0]) == ys[:-1] + (2, half) and src.args[1] % (len(ys) + 1) == len(ys) - 1
        nodes = {src, src.args[0]}
    elif _call(src, aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
        y = src.args[0]
        dim = src.args[2] if len(src.args) > 2 else 0
        ok = dim % len(ys) == last and len(src.users) == 2 and src.args[1] in (2, half, [half, half]) \
            and (src.args[1] == 2) == _call(src, aten.chunk.default)
        nodes = {src}
    else:
        return None
    return (y, {n, neg, x1, x2, *nodes}, True) if ok and _shape(y) == ys else None


def _split_product(m) -> Tuple[Optional[fx.Node], Optional[fx.Node]]:
    """(value, table) of ``value * table`` in either order; the value is the side that is a rope input."""
    if not (_call(m, aten.mul.Tensor) and len(m.args) == 2 and all(isinstance(a, fx.Node) for a in m.args)):
        return None, None
    return m.args[0], m.args[1]


def _real_rotation(add: fx.Node) -> Optional[Rotation]:
    """``y * cos + rotate(y) * sin`` (either order of each product and of the sum) with rotate one of
    :func:`_rotated`'s forms; the casts to fp32 of both products' value sides alike."""
    if not (_call(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs):
        return None
    found = None
    for m_y, m_r in (add.args, add.args[::-1]):
        for y_side, cos in (_split_product(m_y), _split_product(m_y)[::-1]):
            for r_side, sin in (_split_product(m_r), _split_product(m_r)[::-1]):
                if y_side is None or r_side is None:
                    continue
                y, cast_y = _uncast(y_side)
                r, cast_r = _uncast(r_side)
                rot = _rotated(r)
                if rot is None or not isinstance(y, fx.Node):
                    continue
                rot_y, half = rot[0], rot[2]
                src, cast_in = _uncast(rot_y)
                if cast_r is None and cast_in is not None:  # rotate(to(y, f32)) (JoyImage): the same values
                    rot_y, cast_r = src, cast_in
                if rot_y is y and cast_y == cast_r:
                    # the nodes that read y, directly or through the rotation (its cast of y included)
                    reads_y = {add, m_y, m_r, y_side, r_side, *rot[1]} | ({rot[0]} if rot[0] is not y else set())
                    found = Rotation(y, add, frozenset(reads_y), cos, sin, "half" if half else "pairs",
                                     _dtype(add) == torch.float32)
    return found


def _match(end: fx.Node):
    """None when ``end`` does not end a rotary embedding; a skip reason (str) when it ends one this pass leaves;
    else (node to replace, [_Norm], cat_dim, cos, sin, the matched nodes, half_split, form, rope_dim)."""
    rot = _real_rotation(end) or complex_rotation(end) or scatter_rotation(end)
    if rot is None:
        return None
    y = rot.y
    yshape, ydtype = _shape(y), _dtype(y)
    if not rot.fp32:
        return "compute_dtype"
    last, users = rot.end, list(rot.end.users)
    cast, to = _uncast(users[0]) if len(users) == 1 else (None, None)
    if cast is rot.end and to == ydtype:  # the cast back to y's dtype (in an fp32 model a no-op ``type_as`` may stay)
        last = users[0]
    elif _dtype(rot.end) != ydtype:
        return "dtype"
    tables = (rot.cos, rot.sin) if rot.form in ("pairs", "half") else ()
    if any(s is None or torch.broadcast_shapes(s, yshape) != yshape for s in map(_shape, tables)) \
            or yshape[-1] % 2 or yshape[-1] > MAX_D or len(yshape) > 4:
        return "shape"
    norms, cat_dim, rope_dim = _norms_of(y)
    if norms is None:
        return "no_norm"
    if rope_dim and (len(_shape(norms[0].x)) > 3 or _shape(norms[0].x)[-1] > MAX_GROUPED):
        return "shape"
    inside = set(rot.nodes) | {last}
    if any(u not in inside for u in y.users) or (len(norms) > 1 and any(len(k.out.users) != 1 for k in norms)) \
            or any(u not in inside for v in rot.nodes if v is not rot.end for u in v.users) \
            or (rope_dim and len(norms[0].out.users) != 1):
        return "shared_norm"
    if any(_dtype(k.out) != _dtype(k.x) or _dtype(k.out) != ydtype for k in norms):
        return "dtype"
    return last, norms, cat_dim, rot.cos, rot.sin, inside | {y}, rot.form == "half", rot.form, rope_dim


@dataclasses.dataclass(frozen=True)
class _Norm:
    out: fx.Node                # the norm's value: y, or a part of y's concatenation
    x: fx.Node
    weight: Optional[fx.Node]
    eps: float
    nodes: frozenset            # the norm's own nodes (out included)
    decomposed: bool            # diffusers' RMSNorm in ATen ops (``_rms_norm``), not aten.rms_norm


def _norms_of(y: fx.Node):
    """([_Norm], cat_dim, rope_dim) when y is one RMSNorm over the last dim or a concatenation of them (all of one
    form) along a leading dim (rope_dim 0), or a view of one RMSNorm's row as heads (rope_dim: the head size);
    (None, 0, 0) otherwise."""
    ys, rope_dim = _shape(y), 0
    if _call(y, *_VIEWS) and ys and _shape(y.args[0]) and len(ys) >= 2:
        src = _shape(y.args[0])  # a norm over all heads, then the head split: [..., H * D] -> [..., H, D] (Wan)
        if src[:-1] == ys[:-2] and src[-1] == ys[-2] * ys[-1] and ys[-2] > 1:
            y, rope_dim = y.args[0], ys[-1]
    parts, cat_dim = [y], 0
    if rope_dim == 0 and _call(y, aten.cat.default):
        parts = list(y.args[0])
        dims = len(_shape(y) or ())
        cat_dim = (y.args[1] if len(y.args) > 1 else 0) % max(dims, 1)
        if cat_dim == dims - 1:
            return None, 0, 0
    norms = []
    for k in parts:
        if _call(k, aten.rms_norm.default) and len(k.args[1]) == 1 and not k.kwargs:
            norms.append(_Norm(k, k.args[0], _weight(k), _eps(k), frozenset({k}), False))
        else:
            norms.append(_decomposed_rms_norm(k))
    if any(k is None for k in norms) or len({k.decomposed for k in norms}) != 1:
        return None, 0, 0
    return norms, cat_dim, rope_dim


def _decomposed_rms_norm(out) -> Optional[_Norm]:
    """diffusers' RMSNorm as the graph has it (``_rms_norm``'s decomposed branch, op for op)::

        h   = mul(x, rsqrt(add(mean(pow(to(x, f32), 2), [-1], keepdim=True), eps)))   (no cast for fp32 x)
        out = mul(to(h, w.dtype), w)  for a half-precision weight,  mul(h, w)  for an fp32 one,  to(h, x.dtype)
              (or h for fp32 x) without a weight."""
    if not isinstance(out, fx.Node):
        return None
    core = _rms_core(out)
    if core is not None:  # no weight, fp32 x: the cast back elided
        ok = _dtype(core[0]) == torch.float32
        return _Norm(out, core[0], None, core[1], frozenset({out, *core[2]}), True) if ok else None
    src, to = _uncast(out)
    if to is not None:  # no weight: cast back to x's dtype
        core = _rms_core(src)
        ok = core is not None and to == _dtype(core[0])
        return _Norm(out, core[0], None, core[1], frozenset({out, src, *core[2]}), True) if ok else None
    if not (_call(out, aten.mul.Tensor) and len(out.args) == 2 and not out.kwargs):
        return None
    h, w = out.args
    ws = _shape(w)
    if not isinstance(w, fx.Node) or ws is None or ws != (_shape(out) or ())[-1:]:
        return None
    src, to = _uncast(h)
    if (to is not None) != (_dtype(w) in _HALF) or (to is not None and to != _dtype(w)):
        return None
    core = _rms_core(src)
    if core is None:
        return None
    return _Norm(out, core[0], w, core[1], frozenset({out, h, src, *core[2]}), True)


def _rms_core(h) -> Optional[Tuple[fx.Node, float, set]]:
    """(x, eps, nodes) when h is ``mul(x, rsqrt(add(mean(pow(xf, 2), [-1], True), eps)))``, xf: x or
    to(x, f32)."""
    if not (_call(h, aten.mul.Tensor) and len(h.args) == 2 and not h.kwargs):
        return None
    x, r = h.args
    if not (_call(r, aten.rsqrt.default) and isinstance(x, fx.Node)):
        return None
    a = r.args[0]
    if not (_call(a, aten.add.Tensor) and len(a.args) == 2 and isinstance(a.args[1], float) and not a.kwargs):
        return None
    m = a.args[0]
    dims = len(_shape(x) or ())
    if not (_call(m, aten.mean.dim) and not m.kwargs and len(m.args) == 3 and m.args[2] is True
            and [d % max(dims, 1) for d in m.args[1]] == [dims - 1]):
        return None
    p = m.args[0]
    if not (_call(p, aten.pow.Tensor_Scalar) and p.args[1] == 2 and not p.kwargs):
        return None
    xf, to = _uncast(p.args[0])
    if xf is not x or (to if to is not None else _dtype(x)) != torch.float32:
        return None
    nodes = {h, r, a, m, p} | ({p.args[0]} if to is not None else set())
    return x, a.args[1], nodes


def _erase(g: fx.Graph, nodes: set) -> None:
    """Erase the matched nodes left without readers, readers first (the rest of the graph is not touched)."""
    order = {n: i for i, n in enumerate(g.nodes) if n in nodes}
    for n in sorted(order, key=order.get, reverse=True):
        if not n.users:
            g.erase_node(n)


def _weight(norm: fx.Node):
    return norm.args[2] if len(norm.args) > 2 else None


def _eps(norm: fx.Node) -> float:
    eps = norm.args[3] if len(norm.args) > 3 else None
    return float(eps) if eps is not None else torch.finfo(_dtype(norm.args[0])).eps


__all__ = ["FuseNormRope", "rms_norm_rope", "rms_norm_rope_reference", "MAX_D"]
