"""Cutting the block range of a discovered DiT into prologue | Fn blocks | middle | Bn blocks | epilogue.

Used by the residual-cache pass. Pure analysis: nothing here edits the graph.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Set, Tuple

import torch
import torch.fx as fx

from ..analysis.structure import DiTStructure
from ..infra.pass_base import PassError


@dataclasses.dataclass(frozen=True)
class StreamBase:
    """What a stream leaving the middle is the residual against: one stream entering the middle (``parts`` of
    one), the concatenation along ``dim`` of entering streams where the middle joins them (a dual- to
    single-stream hand-over inside the range: the joint sequence against the streams it was made of), or
    nothing (``parts == ()``: no entering stream has its shape, so the leaving value itself is cached)."""

    parts: Tuple[fx.Node, ...]
    dim: int = 1


@dataclasses.dataclass
class MiddleSegment:
    nodes: List[fx.Node]              # the middle blocks (and glue between them), graph order
    live_in: List[fx.Node]            # values the middle reads: streams at the cut + side inputs
    live_out: List[fx.Node]           # middle values read after it (the streams leaving)
    before_of: Dict[fx.Node, StreamBase]  # live_out -> what it is a residual against
    range_start: fx.Node              # first node of block 0
    image_in: fx.Node                 # image stream entering block 0
    image_at_cut: fx.Node             # image stream after the Fn blocks


def _ancestor_placeholders(n: fx.Node, limit: int = 5000) -> set:
    seen, stack, out = set(), [n], set()
    while stack and len(seen) < limit:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder":
            out.add(x.target)
        stack.extend(x.all_input_nodes)
    return out


def _same_kind(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and tuple(va.shape) == tuple(vb.shape) and va.dtype == vb.dtype)


def _match(targets: List[fx.Node], pool: List[fx.Node], what: str) -> Dict[fx.Node, fx.Node]:
    """Pair each target with a pool value of the same shape/dtype, in order (streams keep their order)."""
    used: set = set()
    out = {}
    for t in targets:
        cands = [p for p in pool if p not in used and _same_kind(t, p)]
        if not cands:
            shapes = [tuple(p.meta["val"].shape) for p in pool if isinstance(p.meta.get("val"), torch.Tensor)]
            raise PassError(f"dbcache: cannot match {what} '{t.name}' {tuple(t.meta['val'].shape)} to a residual "
                            f"stream entering the cached blocks (candidates: {shapes}); this block layout "
                            f"changes the stream shapes inside the range")
        used.add(cands[0])
        out[t] = cands[0]
    return out


def _joined(t: fx.Node, middle: List[fx.Node], streams: List[fx.Node]) -> StreamBase:
    """The entering streams that ``t`` (a leaving value of another shape) is the join of: the first
    concatenation in the middle with ``t``'s shape whose every input has exactly one entering stream of its
    own shape (the streams keep their shapes through the blocks before a hand-over). Else ``StreamBase(())``."""
    want = tuple(t.meta["val"].shape)
    for n in middle:
        if n.target is not torch.ops.aten.cat.default or tuple(n.meta["val"].shape) != want:
            continue
        inputs, dim = n.args[0], (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
        parts = []
        for x in inputs:
            same = [p for p in streams if isinstance(x, fx.Node) and _same_kind(x, p)]
            if len(same) > 1:  # streams of one shape (as many text as image tokens): follow the residual adds
                same = [p for p in same if p is _residual_source(x, set(middle), same)]
            if len(same) != 1 or same[0] in parts:
                break
            parts.append(same[0])
        else:
            return StreamBase(tuple(parts), dim % len(want))
    return StreamBase(())


def _residual_source(x: fx.Node, middle: Set[fx.Node], streams: List[fx.Node]):
    """The stream ``x`` continues: walk back through the residual adds (``x = x + f(x)``: the first operand)
    and through ops with a single input of ``x``'s shape; None where the walk is ambiguous."""
    seen = 0
    while x not in streams and x in middle and seen < 10000:
        seen += 1
        if x.target is torch.ops.aten.add.Tensor and isinstance(x.args[0], fx.Node):
            x = x.args[0]
            continue
        same = [a for a in x.all_input_nodes if _same_kind(a, x)]
        if len(same) != 1:
            return None
        x = same[0]
    return x if x in streams else None


def _bases(leaving: List[fx.Node], middle: List[fx.Node], streams: List[fx.Node]) -> Dict[fx.Node, StreamBase]:
    """Each leaving value's base: a same-shape entering stream (in order), else the streams it joins."""
    used: set = set()
    out = {}
    for t in leaving:
        cands = [p for p in streams if p not in used and _same_kind(t, p)]
        if cands:
            used.add(cands[0])
            out[t] = StreamBase((cands[0],))
        else:
            out[t] = _joined(t, middle, streams)
    return out


def _stream_inputs(block) -> List[fx.Node]:
    """The residual streams entering ``block``: discovery's (``(batch, tokens, channels)`` inputs), else, for a
    model without a batch axis (Cosmos 3 packs ``(tokens, channels)`` sequences), the values entering the block
    with the shape of one leaving it (a residual stream keeps its shape through a block): its inputs, and the
    slices of an input it starts with (Cosmos 3 splits its joint sequence in two; capture's functionalisation
    re-materialises those slices at their first use, inside block 0)."""
    if block.stream_inputs:
        return block.stream_inputs
    inside, side = set(block.nodes), set(block.side_inputs)
    shapes = {tuple(o.meta["val"].shape) for o in block.stream_outputs}

    def entering(x: fx.Node) -> bool:
        return x not in inside and x not in side and x.op != "get_attr"

    out: List[fx.Node] = []
    for n in block.nodes:
        sliced = n.target is torch.ops.aten.slice.Tensor and isinstance(n.args[0], fx.Node) and entering(n.args[0])
        for a in ([n] if sliced else []) + [a for a in n.all_input_nodes if entering(a)]:
            v = a.meta.get("val")
            if a not in out and isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape) in shapes:
                out.append(a)
    return out


def _bounds(s: DiTStructure, fn: int, bn: int, pos: Dict[fx.Node, int]) -> Tuple[int, int]:
    """Graph positions ``[lo, hi)`` of the middle: after block ``fn - 1`` (from block 0's first node when
    ``fn == 0``: the whole range is cached) up to block ``n - bn``."""
    blocks = s.blocks
    lo = pos[blocks[fn - 1].last] + 1 if fn else pos[blocks[0].first]
    hi = pos[blocks[len(blocks) - bn].first] if bn else pos[blocks[-1].last] + 1
    return lo, hi


def cut_middle(gm: fx.GraphModule, s: DiTStructure, fn: int, bn: int,
               exclude: Set[fx.Node] = frozenset()) -> MiddleSegment:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    blocks = s.blocks
    lo, hi = _bounds(s, fn, bn, pos)
    middle = [n for n in nodes[lo:hi] if n.op == "call_function" and n not in exclude]
    inside = set(middle)
    live_in: List[fx.Node] = []
    for n in middle:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr" and a not in live_in:
                live_in.append(a)
    live_out = [n for n in middle if any(u not in inside for u in n.users)]
    bad = [a.name for a in live_in + live_out if not isinstance(a.meta.get("val"), torch.Tensor)]
    if bad:
        raise PassError(f"dbcache: values crossing the cached range are not tensors: {bad}")
    ins = _stream_inputs(blocks[0])
    if not ins:
        raise PassError("dbcache: block 0 has no residual stream input")
    start = pos[blocks[0].first]
    # the streams at the cut: produced by the Fn blocks, or with no Fn block the streams entering block 0
    streams_at_cut = [a for a in live_in if pos[a] >= start] if fn else [a for a in ins if a in live_in]
    before_of = _bases(live_out, middle, streams_at_cut)

    image_in = next((x for x in ins if "hidden_states" in _ancestor_placeholders(x)
                     and "encoder_hidden_states" not in _ancestor_placeholders(x)), None)
    if image_in is None:
        image_in = max(ins, key=lambda x: x.meta["val"].numel())
    image_at_cut = _match([image_in], streams_at_cut, "image stream")[image_in]
    return MiddleSegment(middle, live_in, live_out, before_of, blocks[0].first, image_in, image_at_cut)



def keep_loads_with_blocks(gm: fx.GraphModule, s: DiTStructure, fn: int, bn: int,
                           loads: Dict[fx.Node, int]) -> Tuple[int, Set[fx.Node]]:
    """Keep each layerwise-offload load on the side of the cut its block is on: a middle block's load
    moves into the middle (so a cached step never loads it); a Bn block's load issued inside the middle
    stays where it is but is excluded from the cut (returned, for ``cut_middle(exclude=...)``), so it
    still runs ahead of its block. A load goes together with the getitems that read it.
    Returns ``(loads moved, nodes to exclude from the middle)``."""
    n = len(s.blocks)
    nodes = list(gm.graph.nodes)
    pos = {x: i for i, x in enumerate(nodes)}
    lo, hi = _bounds(s, fn, bn, pos)
    moved, exclude = 0, set()
    for load, index in loads.items():
        if load not in pos:
            continue
        in_middle = fn <= index < n - bn
        if in_middle and pos[load] < lo:
            for x in [load, *load.users]:
                nodes[lo].prepend(x)
            moved += 1
        elif not in_middle and lo <= pos[load] < hi:
            exclude.update([load, *load.users])
    return moved, exclude
