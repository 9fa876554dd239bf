"""Where sequence sharding starts: the residual streams entering block 0, and those entering a later block list's
first block (:func:`entering_streams`), each sharded along the token dim unless shorter than the group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..analysis.structure import DiTStructure
from ..infra.pass_base import PassError
from .propagate import is_tensor, val
from .sequence_plan import SequenceShardSpec, Sharded

__all__ = ["entering_streams", "stream_layout"]


def stream_layout(s: fx.Node, spec: SequenceShardSpec, token_dim: int) -> Optional[Sharded]:
    """``s`` sharded along ``token_dim``, or None for a stream shorter than the group (a rank would hold no
    token): it stays replicated, and its ops run whole on every rank, exactly."""
    n = int(val(s).shape[token_dim])
    return Sharded(token_dim, ((s.name, n),)) if n >= spec.world else None


def entering_streams(structure: DiTStructure, spec: SequenceShardSpec, token_dim: int):
    """The residual streams entering block 0, and per later block list the streams entering its first block
    (sharded there unless the walk placed them already: Flux's single blocks take the dual blocks' output)."""
    out = {}
    for s in structure.blocks[0].stream_inputs:
        v = val(s)
        if not isinstance(v, torch.Tensor) or v.dim() < 3:
            raise PassError(f"context parallel: residual stream '{s.name}' entering block 0 has shape "
                            f"{None if v is None else tuple(v.shape)}; expected [batch, tokens, features]")
        lay = stream_layout(s, spec, token_dim)
        if lay is not None:
            out[s] = lay
    late, start = {}, 0
    for lst in structure.block_lists:
        first = structure.blocks[start]
        start += lst.count
        if first is structure.blocks[0]:
            continue
        for s in first.stream_inputs:
            lay = stream_layout(s, spec, token_dim) if is_tensor(s) and val(s).dim() >= 3 else None
            if lay is not None and s not in out:
                at = next(n for n in first.nodes if n.op == "call_function")
                late.setdefault(at, {})[s] = lay
    return out, late
