"""Attention sites and the role of every linear, found from dataflow inside each block.

Roles (checked in this order, all by walking the graph, never by module names):
1. ``q`` / ``k`` / ``v`` / ``qkv``: the output reaches argument 0 / 1 / 2 (several: ``qkv``) of an
   attention node (SDPA or a flex attention) before any other linear (cross-attention K/V over the text too).
2. ``modulation``: the input does not depend on the block's residual streams (AdaLN linears on temb).
3. walking back from the input, stopping at norms, attention and stream-dependent linears (reaching
   the block's raw residual stream instead skips to 4: a norm-less pre-MLP input is the residual):
   attention only -> ``attn_out``; attention and a linear -> ``proj`` (Flux single blocks'
   ``proj_out`` over concat(attention, MLP)); a linear only -> ``mlp_down``.
4. ``router``: the output reaches a selection (top-k, argmax, sort) before any other linear: a mixture of experts'
   gate, whose rounding would change which experts run (the quantizers keep it in precision by default).
5. ``mlp_up``: the output reaches another stream-dependent linear.
6. anything else: ``other``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from .structure import AttentionSite, Block, LinearSite

aten = torch.ops.aten
SDPA_OPS = {aten.scaled_dot_product_attention.default}
# attention for the roles of the linears around it (q / k / v, attn_out); only SDPA is an AttentionSite, which
# the sequence passes rewrite: a flex attention's block mask and score function are not theirs to shard
ROLE_ATTENTION_OPS = SDPA_OPS | {torch.ops.higher_order.flex_attention}
NORM_OPS = {aten.layer_norm.default, aten.rms_norm.default, aten.group_norm.default,
            aten.native_layer_norm.default}
LINEAR = aten.linear.default
# ops whose result is a choice among values (indices): a linear feeding one is a router
SELECTION_OPS = {aten.topk.default, aten.argmax.default, aten.argmin.default, aten.sort.default, aten.sort.stable,
                 aten.argsort.default, aten.argsort.stable, aten.max.dim, aten.min.dim}


def _attn_mask(n: fx.Node) -> Optional[fx.Node]:
    m = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    return m if isinstance(m, fx.Node) else None


def find_attention(fn_nodes: List[fx.Node], block_of: Dict[fx.Node, int]) -> List[AttentionSite]:
    sites = []
    for n in fn_nodes:
        if n.target not in SDPA_OPS:
            continue
        q, k, v = n.args[:3]
        qv, kv = q.meta["val"], k.meta["val"]
        if qv.dim() != 4:
            continue
        sites.append(AttentionSite(n, block_of.get(n), q, k, v, int(qv.shape[1]), int(qv.shape[-1]),
                                   int(qv.shape[2]), int(kv.shape[2]), _attn_mask(n)))
    return sites


def _forward_reach(start: fx.Node, inside: Set[fx.Node]) -> Tuple[Set[int], List[fx.Node]]:
    """Attention argument slots and linears the value reaches before any other linear/attention."""
    slots: Set[int] = set()
    linears: List[fx.Node] = []
    seen: Set[fx.Node] = set()
    stack = [start]
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen or u not in inside:
                continue
            if u.target in ROLE_ATTENTION_OPS:
                slots.update(i for i, a in enumerate(u.args[:3]) if a is x)
                continue
            if u.target is LINEAR:
                if u.args[0] is x:
                    linears.append(u)
                continue
            seen.add(u)
            stack.append(u)
    return slots, linears


def _backward_reach(start: fx.Node, inside: Set[fx.Node], modulation: Set[fx.Node],
                    streams: Set[fx.Node]) -> Tuple[bool, bool, bool]:
    """(reaches attention, reaches a stream-dependent linear, reaches a block stream input), walking
    back to norms at most. Reaching the raw residual stream means the input *is* the residual (a
    norm-less pre-MLP), so the linear cannot be an output/down projection."""
    seen: Set[fx.Node] = set()
    stack = [start]
    attn = lin = residual = False
    while stack:
        x = stack.pop()
        if x in streams:
            residual = True
            continue
        if x in seen or x not in inside:
            continue
        seen.add(x)
        if x.target in ROLE_ATTENTION_OPS:
            attn = True
            continue
        if x.target is LINEAR:
            if x not in modulation:
                lin = True
            continue
        if x.target in NORM_OPS:
            continue
        stack.extend(x.all_input_nodes)
    return attn, lin, residual


def _feeds_selection(start: fx.Node, inside: Set[fx.Node]) -> bool:
    """Whether the value reaches a selection op (:data:`SELECTION_OPS`) inside the block before any linear."""
    seen: Set[fx.Node] = set()
    stack = [start]
    while stack:
        for u in stack.pop().users:
            if u in seen or u not in inside:
                continue
            seen.add(u)
            if u.target in SELECTION_OPS:
                return True
            if u.target is not LINEAR:
                stack.append(u)
    return False


def _stream_dependent(block: Block) -> Set[fx.Node]:
    inside = set(block.nodes)
    dep: Set[fx.Node] = set()
    stack = list(block.stream_inputs)
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in inside and u not in dep:
                dep.add(u)
                stack.append(u)
    return dep


def _attr(x) -> Optional[str]:
    return x.target if isinstance(x, fx.Node) and x.op == "get_attr" else None


def is_adapter_path(path: str) -> bool:
    """A PEFT adapter's projection (``...to_q.lora_A.default``): not a projection of the model itself."""
    return any(part.startswith(("lora_", "lokr_", "loha_")) for part in path.split("."))


def find_linears(gm: fx.GraphModule, fn_nodes: List[fx.Node], block_of: Dict[fx.Node, int],
                 blocks: List[Block]) -> List[LinearSite]:
    sites: List[LinearSite] = []
    per_block: Dict[int, Tuple[Set[fx.Node], Set[fx.Node]]] = {}
    for b in blocks:
        per_block[b.index] = (set(b.nodes), _stream_dependent(b))
    roles: Dict[fx.Node, str] = {}
    lin_nodes = [n for n in fn_nodes if n.target is LINEAR]
    # pass 1: attention projections and modulation (needed before walking back)
    for n in lin_nodes:
        bi = block_of.get(n)
        if bi is None:
            roles[n] = "other"
            continue
        if is_adapter_path(n.meta.get("dit_module_path", "")):
            roles[n] = "lora"  # an unfused adapter branch beside its base linear
            continue
        inside, dep = per_block[bi]
        slots, _ = _forward_reach(n, inside)
        if slots:
            roles[n] = "qkv" if len(slots) > 1 else {0: "q", 1: "k", 2: "v"}[min(slots)]
        elif n.args[0] not in dep and n.args[0] not in blocks[bi].stream_inputs:
            roles[n] = "modulation"
    modulation = {n for n, r in roles.items() if r == "modulation"}
    for n in lin_nodes:
        if n in roles:
            continue
        inside, _ = per_block[block_of[n]]
        attn, lin, residual = _backward_reach(n.args[0], inside, modulation,
                                              set(blocks[block_of[n]].stream_inputs))
        if residual:
            pass  # the input is the residual stream itself: only mlp_up / other fit (below)
        elif attn:
            roles[n] = "proj" if lin else "attn_out"
        elif lin:
            roles[n] = "mlp_down"
        if n not in roles and _feeds_selection(n, inside):
            roles[n] = "router"
        if n not in roles:
            _, reached = _forward_reach(n, inside)
            roles[n] = "mlp_up" if any(r not in modulation for r in reached) else "other"
    for n in lin_nodes:
        w = n.args[1].meta["val"]
        bias = n.args[2] if len(n.args) > 2 else None
        sites.append(LinearSite(n, block_of.get(n), n.meta.get("dit_module_path", ""), roles[n],
                                _attr(n.args[1]) or n.args[1].name, _attr(bias),
                                int(w.shape[1]), int(w.shape[0])))
    return sites
