"""The quantization passes over linears ``FuseSiblingLinears`` made (graph fact ``fused_linears``).

A fused linear's weight is its m members' weights stacked by rows ([sum N_i, K]). ``SVDQuantW4A4`` gives it one
low-rank branch of rank ``r`` x m: the members' own rank-r branches, stacked, are one rank-(m r) candidate (a
block-diagonal ``lora_up``), so the best rank-(m r) approximation of the (smoothed) stacked weight is at least as
close; one rank-r branch for the whole group lost ~5 dB PSNR on the digits DiT. Cost: ``lora_down`` is the members'
([m r, K]), ``lora_up`` is dense ([sum N_i, m r] instead of m blocks [N_i, r]): m times the members' up-projection
MACs and bytes. FLUX.1 at r = 32, per token: q / k / v 1.18 M MACs instead of 0.59 M (4.2% of the 3072 x 9216
GEMM's instead of 2.1%), a single block's proj_mlp + q / k / v 3.1 M instead of 1.1 M (4.8% of its GEMM's instead
of 1.6%). The checkpoint records the members in its structure signature (``quant.signature.quant_signature``) and
the fused linears' ranks in ``config["rank_of"]``; the low-rank tensors carry their shapes.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, List

import torch
import torch.fx as fx

from ..infra.facts import facts_of


def fused_members(gm: fx.GraphModule, paths) -> Dict[str, List[List[Any]]]:
    """``{path: [[member path, rows], ...]}`` of the linears at ``paths`` that ``FuseSiblingLinears`` made (the
    caller declares it reads ``fused_linears``)."""
    record = facts_of(gm).fused_linears
    return {p: [[m, int(r)] for m, r in record[p].members] for p in paths if p in record}


def low_rank_of(tables: Dict[str, Dict[str, torch.Tensor]], paths) -> Dict[str, int]:
    """The rank of the low-rank branch (``lora_down``'s rows) of each linear at ``paths`` that has one."""
    return {p: int(tables[p]["lora_down"].shape[0]) for p in paths if p in tables and "lora_down" in tables[p]}


def fused_note(fused: Dict[str, List[List[Any]]], tables: Dict[str, Dict[str, torch.Tensor]]) -> str:
    """What the report says of the fused linears: ``"3 fused linear(s) at rank 96, 1 at rank 128"``."""
    ranks = low_rank_of(tables, fused)
    by_rank = collections.Counter(ranks.values())
    parts = [f"{n} at rank {r}" for r, n in sorted(by_rank.items())]
    plain = len(fused) - len(ranks)
    if plain:
        parts.append(f"{plain} without a low-rank branch")
    return f"{len(fused)} fused linear(s): " + ", ".join(parts)


__all__ = ["fused_members", "low_rank_of", "fused_note"]
