"""What block discovery records on a graph (fact ``"structure"``): see DESIGN.md §2."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch.fx as fx


@dataclasses.dataclass
class BlockList:
    name: str          # module path of the ModuleList, e.g. "single_transformer_blocks"
    cls: str           # class name of its blocks
    count: int


@dataclasses.dataclass
class Block:
    index: int                      # position in the main stack, across lists
    path: str                       # "single_transformer_blocks.3"
    list_name: str
    nodes: List[fx.Node]            # graph order, first..last node of the block
    stream_inputs: List[fx.Node]
    stream_outputs: List[fx.Node]
    side_inputs: List[fx.Node]

    @property
    def first(self) -> fx.Node:
        return self.nodes[0]

    @property
    def last(self) -> fx.Node:
        return self.nodes[-1]


@dataclasses.dataclass
class AttentionSite:
    node: fx.Node
    block: Optional[int]
    q: fx.Node
    k: fx.Node
    v: fx.Node
    num_heads: int
    head_dim: int
    q_len: int
    kv_len: int
    mask: Optional[fx.Node]
    layout: str = "BHSD"


@dataclasses.dataclass
class LinearSite:
    node: fx.Node
    block: Optional[int]
    module_path: str
    role: str
    weight: str
    bias: Optional[str]
    in_features: int
    out_features: int


ROLES = ("q", "k", "v", "qkv", "attn_out", "mlp_up", "mlp_down", "proj", "modulation", "router", "lora", "other")


@dataclasses.dataclass
class DiTStructure:
    block_lists: List[BlockList]
    blocks: List[Block]
    num_streams: int
    prologue: List[fx.Node]
    epilogue: List[fx.Node]
    attention: List[AttentionSite]
    linears: List[LinearSite]
    candidates: Dict[str, int] = dataclasses.field(default_factory=dict)  # every repeated list seen

    def blocks_range(self, start: int, stop: int) -> List[Block]:
        return self.blocks[start:stop]

    def attention_in(self, block: int) -> List[AttentionSite]:
        return [a for a in self.attention if a.block == block]

    def linears_with_role(self, *roles: str) -> List[LinearSite]:
        bad = set(roles) - set(ROLES)
        if bad:
            raise ValueError(f"unknown linear roles {sorted(bad)}; valid roles: {ROLES}")
        return [lin for lin in self.linears if lin.role in roles]

    def column_parallel_linears(self) -> List[LinearSite]:
        return [lin for lin in self.linears if lin.block is not None and lin.role in ("q", "k", "v", "qkv", "mlp_up")]

    def row_parallel_linears(self) -> List[LinearSite]:
        return [lin for lin in self.linears if lin.block is not None and lin.role in ("attn_out", "mlp_down", "proj")]

    def summary(self) -> str:
        lists = ", ".join(f"{bl.name} x{bl.count} ({bl.cls})" for bl in self.block_lists)
        lines = [f"block lists: {lists}; {len(self.blocks)} blocks, {self.num_streams} residual stream(s)"]
        lines.append(f"prologue: {len(self.prologue)} nodes, epilogue: {len(self.epilogue)} nodes")
        if self.blocks:
            b0 = self.blocks[0]
            lines.append(f"block 0 ({b0.path}): {len(b0.nodes)} nodes, streams in "
                         f"{[n.name for n in b0.stream_inputs]}, side inputs {[n.name for n in b0.side_inputs]}")
        per_block: Dict[int, int] = {}
        for a in self.attention:
            if a.block is not None:
                per_block[a.block] = per_block.get(a.block, 0) + 1
        if self.attention:
            a = self.attention[0]
            lines.append(f"attention: {len(self.attention)} sites ({a.layout}, heads={a.num_heads}, "
                         f"head_dim={a.head_dim}); per block: {sorted(set(per_block.values()))}")
        roles: Dict[str, int] = {}
        for lin in self.linears:
            if lin.block is not None:
                roles[lin.role] = roles.get(lin.role, 0) + 1
        lines.append("block linears by role: " + ", ".join(f"{k}={v}" for k, v in sorted(roles.items())))
        others = {k: v for k, v in self.candidates.items() if k not in {b.name for b in self.block_lists}}
        if others:
            lines.append(f"other repeated lists (not the main stack): {others}")
        return "\n".join(lines)
