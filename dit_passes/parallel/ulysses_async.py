"""Async Ulysses: the q / k / v all-to-alls of one attention issued as soon as each projection is done, each
waited for only after the next projection is computed (communication overlaps compute). Exactly the
collectives of the synchronous Ulysses (4 ``all_to_all_single`` per attention) on the same data.

Before (one attention; exported graphs compute the three linears first, the permutes last)::

    linear (to_q), linear_1 (to_k), linear_2 (to_v), ... rms_norm, rotary ... permute, permute_1, permute_2
    ulysses_attention(permute, permute_1, permute_2, ...)                          # 4 all-to-alls inside

after (the chain private to each input moved, in the order v, q, k, to just before the attention)::

    linear_2 ... permute_2; ulysses_rows_2; all_to_all_single_2          # v sent
    linear ... permute;     ulysses_rows;   all_to_all_single            # q projected while v travels
    linear_1 ... permute_1; ulysses_rows_1; all_to_all_single_1          # k projected while q travels
    wait_tensor_2; wait_tensor; wait_tensor_1
    ulysses_received_attention(wait_tensor, wait_tensor_1, wait_tensor_2, ...)     # output all-to-all inside

With ``float8`` each send is ``ulysses_fp8_rows`` and each wait is followed by ``from_fp8_rows`` (the ops of
synchronous float8 Ulysses, so its bits); inside USP the all-to-alls run on the Ulysses group and
``usp*_received_attention`` runs the ring over the blocks and the output all-to-all (the ops of ``usp_attention``).

A node moves only when it is private to one input's chain, inside the attention's block (its module path shares
the block's first two components) and every node still reads its inputs after they are computed; otherwise the
attention keeps the original order (sends right after their input, still correct, less overlap): counted apart.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Set

import torch.fx as fx

ISSUE_ORDER = ("v", "q", "k")  # v's chain is the shortest (no norm / rotary): its all-to-all starts first


@dataclasses.dataclass(frozen=True)
class AsyncUlysses:
    """How a context-parallel pass asks for async all-to-alls: ``size`` ranks in the Ulysses group (the inner dim of a
    USP mesh: rank ``g`` is in ring block ``g // size``), the e4m3 payloads or not, and the wrapper of
    :mod:`~dit_passes.parallel.sequence_ops` that runs the attention after the q / k / v all-to-alls."""

    size: int
    float8: bool
    received_op: Callable


def _block(n: fx.Node) -> str:
    return ".".join((n.meta.get("dit_module_path") or "").split(".")[:2])


def _ancestors(n: fx.Node, inside) -> Set[fx.Node]:
    seen, todo = {n}, [n]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen and inside(a):
                seen.add(a)
                todo.append(a)
    return seen


def overlap(g: fx.Graph, attention: fx.Node, sends: List[fx.Node]) -> bool:
    """Move each send's private chain (``sends`` in issue order) to just before ``attention``, chain after chain;
    True when moved, False (graph untouched) when a move would read a value before it is computed."""
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    block = _block(attention)

    def inside(m: fx.Node) -> bool:
        return m.op == "call_function" and pos[m] < pos[attention] and bool(block) and _block(m) == block

    reach = [_ancestors(s, inside) for s in sends]
    chains: List[Set[fx.Node]] = []
    for i, mine in enumerate(reach):
        others = set().union(*(r for j, r in enumerate(reach) if j != i))
        chains.append(mine - others)
    owner: Dict[fx.Node, int] = {m: i for i, c in enumerate(chains) for m in c}
    for i, c in enumerate(chains):  # result-less readers (export's metadata asserts) travel with their value
        for m in list(c):
            for u in m.users:
                if not u.users and inside(u) and u not in owner:
                    c.add(u)
                    owner[u] = i
    moved = [m for c in chains for m in sorted(c, key=pos.__getitem__)]
    moving = set(moved)
    order = [n for n in nodes[:pos[attention]] if n not in moving] + moved + nodes[pos[attention]:]
    new_pos = {n: i for i, n in enumerate(order)}
    if any(new_pos[a] >= new_pos[n] for n in order for a in n.all_input_nodes):
        return False
    for m in moved:
        attention.prepend(m)
    return True
