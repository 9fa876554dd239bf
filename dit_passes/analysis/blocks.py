"""Block discovery: find the repeated transformer blocks of a captured DiT from the graph alone.

Contract
  requires: a captured graph (``meta["dit_module_path"]`` on call_function nodes, ``meta["val"]``).
  derives: fact ``structure`` (:class:`~dit_passes.analysis.structure.DiTStructure`).

How (no per-model tables):
1. Every module path ``<prefix>.<i>`` where ``<prefix>`` has at least two integer children of one class
   is a *repeated list* candidate (``transformer_blocks``, ``blocks``, ``layers``, any name); so is a list of
   one child that runs an attention (a one-layer DiT).
   Lists nested inside another candidate's blocks (``to_out.0``) are ignored.
2. The main stack starts from the candidate holding the most linear-weight elements and extends to a
   list at the same nesting depth that is its *unique* predecessor (successor) in the dataflow, among the lists
   whose blocks attend where any does (HiDream's caption projections are a list feeding the blocks, not blocks):
   Flux's double blocks feed its single blocks (one range, as the reference treats it), whereas
   Lumina2's noise and context refiners both feed ``layers`` (so they stay prologue), and HunyuanVideo's
   token refiner sits deeper (``context_embedder.token_refiner.refiner_blocks``) and is never the stack.
3. A block is the contiguous node range of its path; its stream inputs are values it reads that no other
   block reads from the prologue (the residual streams), its side inputs those every block shares
   (temb, rotary embeddings, masks); in a list of one block, which has no second reader, a value from the prologue
   is a stream only if it has the shape of a block's stream output.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ..capture import module_class_of
from ..infra.facts import facts_of
from ..infra.pass_base import Refusal
from .linear_roles import ROLE_ATTENTION_OPS, find_attention, find_linears
from .structure import Block, BlockList, DiTStructure

_INT = re.compile(r"^\d+$")


class NoRepeatedBlocksError(ValueError, Refusal):
    """The module has no repeated block list: it is not a DiT dit_passes can work on."""


def _block_key(path: str) -> List[Tuple[str, int]]:
    parts = path.split(".")
    return [(".".join(parts[:i]), int(p)) for i, p in enumerate(parts) if _INT.match(p) and i > 0]


def _candidates(nodes: List[fx.Node], attends: Set[str]) -> Dict[str, Dict[int, str]]:
    """prefix -> {index: block class} for every repeated-list candidate (``attends``: :func:`_attending`)."""
    seen: Dict[str, Dict[int, str]] = defaultdict(dict)
    for n in nodes:
        path = n.meta.get("dit_module_path", "")
        for prefix, idx in _block_key(path):
            if idx not in seen[prefix]:
                seen[prefix][idx] = module_class_of(n, f"{prefix}.{idx}")
    # a list of one block is a block list when that block attends (a one-layer DiT, FLUX with one double block):
    # one element alone says nothing of repetition, and an indexed attention-free module is a Sequential's part
    out = {}
    for prefix, idxs in seen.items():
        classes = set(idxs.values())
        if len(classes) == 1 and (len(idxs) >= 2 or prefix in attends):
            out[prefix] = idxs
    # drop lists nested inside the blocks of another candidate (e.g. attn.to_out.0 would not qualify,
    # but a per-block ModuleList of 2+ sub-layers would)
    nested = {p for p in out for q in out if p != q and re.match(rf"^{re.escape(q)}\.\d+\.", p)}
    return {p: v for p, v in out.items() if p not in nested}


def _attending(nodes: List[fx.Node]) -> Set[str]:
    """The list prefixes whose blocks run an attention (SDPA or flex attention) somewhere inside them."""
    return {prefix for n in nodes if n.target in ROLE_ATTENTION_OPS
            for prefix, _ in _block_key(n.meta.get("dit_module_path", ""))}


def _weight_elems(gm: fx.GraphModule, nodes: List[fx.Node]) -> int:
    total = 0
    for n in nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.linear.default:
            w = n.args[1]
            if isinstance(w, fx.Node) and isinstance(w.meta.get("val"), torch.Tensor):
                total += w.meta["val"].numel()
    return total


def discover(gm: fx.GraphModule, block_lists: Optional[List[str]] = None) -> DiTStructure:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    fn_nodes = [n for n in nodes if n.op == "call_function"]
    attends = _attending(fn_nodes)
    cands = _candidates(fn_nodes, attends)
    if not cands:
        tops = sorted({n.meta.get("dit_module_path", "").split(".")[0] for n in fn_nodes} - {""})
        raise NoRepeatedBlocksError(
            "no repeated block list found: a DiT needs a ModuleList of blocks of one class (two or more, or one that "
            "attends) "
            f"(e.g. transformer_blocks.0, transformer_blocks.1). Top-level modules seen: {tops[:20]}. "
            "Pass a diffusers transformer, or name the lists with block_lists=[...]")

    def members(prefix: str) -> Dict[int, List[fx.Node]]:
        out: Dict[int, List[fx.Node]] = defaultdict(list)
        pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(\.|$)")
        for n in fn_nodes:
            m = pat.match(n.meta.get("dit_module_path", ""))
            if m:
                out[int(m.group(1))].append(n)
        return out

    groups = {p: members(p) for p in cands}
    if block_lists is not None:
        missing = [b for b in block_lists if b not in groups]
        if missing:
            raise NoRepeatedBlocksError(f"block_lists {missing} not found; repeated lists in the graph: "
                                        f"{ {p: len(v) for p, v in groups.items()} }")
        chain = sorted(block_lists, key=lambda p: min(pos[n] for ns in groups[p].values() for n in ns))
    else:
        chain = _main_chain(gm, groups, pos, attends)

    blocks: List[Block] = []
    lists: List[BlockList] = []
    owned: List[List[fx.Node]] = []
    for prefix in chain:
        idxs = sorted(groups[prefix])
        lists.append(BlockList(prefix, next(iter(cands[prefix].values())), len(idxs)))
        for i in idxs:
            owned.append(groups[prefix][i])
            blocks.append(Block(len(blocks), f"{prefix}.{i}", prefix, [], [], [], []))
    # A block is the run of its nodes up to where the next block starts: a later call of one of its
    # submodules from outside the stack (DiT's final layer reuses block 0's timestep embedder) belongs to
    # the code that makes it (the epilogue), not to the block. Strays inside the stack keep the whole range
    # (an interleaving, refused below).
    firsts = [min(pos[n] for n in ns) for ns in owned]
    following = sorted(firsts)
    his = []
    for ns, lo in zip(owned, firsts):
        nxt = next((f for f in following if f > lo), len(nodes))
        his.append(max(pos[n] for n in ns if pos[n] < nxt))
    stack_end = max(his)
    for b, ns, lo, hi in zip(blocks, owned, firsts, his):
        strays = [n for n in ns if hi < pos[n] <= stack_end]
        b.nodes = [n for n in nodes[lo:(stack_end if strays else hi) + 1] if n.op == "call_function"]
    blocks.sort(key=lambda b: pos[b.first])
    for i, b in enumerate(blocks):
        b.index = i
        if i and pos[b.first] <= pos[blocks[i - 1].last]:
            raise NoRepeatedBlocksError(f"blocks {blocks[i - 1].path} and {b.path} interleave in the graph; "
                                        "dit_passes needs blocks that run one after another")
    _boundaries(blocks, pos)
    start, end = pos[blocks[0].first], pos[blocks[-1].last]
    prologue = [n for n in nodes[:start] if n.op == "call_function"]
    epilogue = [n for n in nodes[end + 1:] if n.op == "call_function"]
    block_of = {n: b.index for b in blocks for n in b.nodes}
    attention = find_attention(fn_nodes, block_of)
    linears = find_linears(gm, fn_nodes, block_of, blocks)
    return DiTStructure(lists, blocks, max(len(b.stream_outputs) for b in blocks[:-1] or blocks),
                        prologue, epilogue, attention, linears,
                        candidates={p: len(v) for p, v in groups.items()})


def _main_chain(gm: fx.GraphModule, groups: Dict[str, Dict[int, List[fx.Node]]], pos, attends: Set[str]) -> List[str]:
    # Where some lists attend, only those are transformer blocks: HiDream's five caption projections and
    # LongCat-Audio's text convolutions feed the first block list (and would extend the stack backwards) but run
    # no attention; a model with no SDPA / flex attention at all (linear attention only) keeps every list.
    if attends & set(groups):
        groups = {p: g for p, g in groups.items() if p in attends}
    weight = {p: _weight_elems(gm, [n for ns in g.values() for n in ns]) or sum(map(len, g.values()))
              for p, g in groups.items()}
    start = {p: min(pos[n] for ns in g.values() for n in ns) for p, g in groups.items()}
    end = {p: max(pos[n] for ns in g.values() for n in ns) for p, g in groups.items()}
    depth = {p: p.count(".") for p in groups}
    # On a tie (same block class and count, e.g. Lumina2 / Z-Image refiners beside a short ``layers``),
    # the later list wins: refiners run before the main stack, never after it.
    main = max(groups, key=lambda p: (weight[p], start[p]))
    same_depth = [p for p in groups if depth[p] == depth[main]]

    def feeds(a: str, b: str) -> bool:
        """Does list ``a``'s last block reach list ``b``'s first block (a runs entirely before b)?"""
        if end[a] >= start[b]:
            return False
        first_b = groups[b][min(groups[b])]
        last_a = set(groups[a][max(groups[a])])
        seen: Set[fx.Node] = set()
        stack = [x for n in first_b for x in n.all_input_nodes]
        while stack:
            x = stack.pop()
            if x in seen or pos[x] < start[a]:
                continue
            seen.add(x)
            if x in last_a:
                return True
            stack.extend(x.all_input_nodes)
        return False

    chain = [main]
    while True:
        preds = [p for p in same_depth if p not in chain and feeds(p, chain[0])]
        if len(preds) != 1:
            break
        chain.insert(0, preds[0])
    while True:
        succs = [p for p in same_depth if p not in chain and feeds(chain[-1], p)]
        if len(succs) != 1:
            break
        chain.append(succs[0])
    return chain


def _boundaries(blocks: List[Block], pos: Dict[fx.Node, int]) -> None:
    start = pos[blocks[0].first]
    readers: Dict[fx.Node, Set[int]] = defaultdict(set)  # prologue value -> blocks reading it
    for b in blocks:
        inside = set(b.nodes)
        b._inputs = []  # type: ignore[attr-defined]
        for n in b.nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr" and a not in b._inputs:  # type: ignore[attr-defined]
                    b._inputs.append(a)  # type: ignore[attr-defined]
                    if pos[a] < start or a.op == "placeholder":
                        readers[a].add(b.index)
    for b in blocks:
        inside, last = set(b.nodes), pos[b.last]
        b.stream_outputs = [n for n in b.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                            and any(u not in inside and pos[u] > last for u in n.users)]
    # A value several blocks read is a side input. A list of one block has no second reader to tell its side
    # inputs (its list's modulation vectors, FLUX.2's per-list ones) from the streams: there a value from before the
    # stack is a stream only if it has the shape of some block's stream output.
    per_list = Counter(b.list_name for b in blocks)
    out_shapes = {tuple(o.meta["val"].shape) for b in blocks for o in b.stream_outputs}

    def side(a: fx.Node, alone: bool) -> bool:
        if not (pos[a] < start or a.op == "placeholder"):
            return False
        val = a.meta.get("val")
        return len(readers[a]) > 1 or (alone and not (isinstance(val, torch.Tensor) and tuple(val.shape) in out_shapes))
    for b in blocks:
        ins = b._inputs  # type: ignore[attr-defined]
        b.side_inputs = [a for a in ins if side(a, per_list[b.list_name] == 1)]
        b.stream_inputs = [a for a in ins if a not in b.side_inputs and a.meta.get("val") is not None
                           and isinstance(a.meta["val"], torch.Tensor) and a.meta["val"].dim() >= 3]
        del b._inputs  # type: ignore[attr-defined]


def get_structure(gm: fx.GraphModule) -> DiTStructure:
    """The graph's structure fact, discovered now if missing (or invalidated by a pass)."""
    facts = facts_of(gm)
    return facts.derived("structure", lambda: discover(gm, facts.block_lists))


