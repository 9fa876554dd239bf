"""What a saved quantization is checked against, and how its tensors are placed: shared by the quantization
passes (which write it) and loading (which checks it).

* :func:`quant_signature` -- the block lists (class, count), every quantized linear's shape and bias, and a
  fingerprint of its original weights; computed the same from the user's model and from a captured graph
  (both hold the weights under the same module paths);
* :func:`place_tables` -- the per-linear tensors on the model's device, the activation-dtype fields in its dtype.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, Optional, Sequence

import torch

from ..infra.ownership import RELEASED, SAMPLE, weight_sample

FORMAT = "dit_passes.quantized_linears.v1"
# Floating tensors that follow the activation dtype; scales keep their stored dtype (bf16 / fp32).
ACT_DTYPE_FIELDS = ("lora_down", "lora_up", "bias")


def tensor_at(root: torch.nn.Module, target: str) -> Optional[torch.Tensor]:
    """The tensor attribute at dotted ``target`` of ``root``, or None."""
    *parents, leaf = target.split(".")
    mod = root
    for p in parents:
        mod = getattr(mod, p, None)
        if mod is None:
            return None
    t = getattr(mod, leaf, None)
    return t if isinstance(t, torch.Tensor) else None


class MetaWeightError(ValueError):
    """A weight to fingerprint has no values (the meta device: released by a pass, or never loaded)."""


def _fingerprint(h, path: str, w: torch.Tensor) -> None:
    """Hash a fixed strided sample of ``w`` in bf16: exact on any device, equal for fp32 and bf16 copies. A weight
    a pass released (meta, or its stand-in while lowering again) kept its sample."""
    sample = getattr(w, SAMPLE, None)
    sample = weight_sample(w) if sample is None else sample
    h.update(f"{path}:{list(w.shape)}:".encode())
    h.update(sample.numpy().tobytes())


def quant_signature(root: torch.nn.Module, paths: Sequence[str], block_lists: Dict[str, Dict[str, Any]],
                    fused: Optional[Dict[str, Sequence[Sequence[Any]]]] = None) -> Dict[str, Any]:
    """Signature the saved file is checked against: block lists (class, count), the quantized linears'
    shapes, and a fingerprint of their original weights. ``root`` is the user's model or the captured
    graph: both hold the weights under the same module paths (``<path>.weight`` / ``<path>.bias``).

    ``fused``: ``{path: [[member path, rows], ...]}`` for the linears ``FuseSiblingLinears`` made (graph fact
    ``fused_linears``). Such a linear's entry lists its members (``"members"``) and its fingerprint is its members',
    each hashed under its own path: in the graph they are the row ranges of the fused weight at ``path``, in the user's
    model the members' own weights (kept there, or their samples where a pass released them), so one checkpoint
    checks the same from both."""
    fused = fused or {}
    linears: Dict[str, Dict[str, Any]] = {}
    h = hashlib.sha256()
    for path in sorted(paths):  # the sidecar stores them sorted (JSON sort_keys)
        w = _weight(root, path)
        parts = [(path, w)] if path not in fused else _members(root, path, w, fused[path])
        linears[path] = {"out_features": sum(int(t.shape[0]) for _, t in parts), "in_features": int(w.shape[1]),
                         "bias": tensor_at(root, f"{path}.bias") is not None}
        if path in fused:
            linears[path]["members"] = [[m, int(t.shape[0])] for m, t in parts]
        for m, t in parts:
            _fingerprint(h, m, t)
    return {"block_lists": block_lists, "linears": linears, "weights_sha256": h.hexdigest()}


def _weight(root: torch.nn.Module, path: str) -> torch.Tensor:
    w = tensor_at(root, f"{path}.weight")
    if w is None or w.dim() != 2:
        raise ValueError(f"no linear weight at '{path}.weight' in {type(root).__name__}")
    if w.is_meta and getattr(w, SAMPLE, None) is None:
        released = getattr(w, RELEASED, None)
        why = f"released when it was {released[1]}" if released else "never loaded"
        raise MetaWeightError(f"the weight at '{path}.weight' {list(w.shape)} is on the meta device ({why}): "
                              f"quantizing or checking a checkpoint needs its values. Load the model's weights "
                              f"(from_pretrained / load_state_dict), or compile with keep_original=True to keep "
                              f"them")
    return w


def _members(root: torch.nn.Module, path: str, w: torch.Tensor, members: Sequence[Sequence[Any]]):
    """``[(member path, its weight)]`` of fused linear ``path``: row slices of ``w`` where ``w`` is the fused weight
    (the graph), else the members' own weights (the user's model)."""
    try:
        names, rows = [str(m) for m, _ in members], [int(r) for _, r in members]
    except (TypeError, ValueError):
        raise ValueError(f"the members of fused linear '{path}' must be [[path, rows], ...], got {members!r}") from None
    if names[0] != path or len(names) < 2:
        raise ValueError(f"fused linear '{path}' must list itself first among two or more members, got {names}")
    if int(w.shape[0]) != sum(rows):  # the user's model: each member's weight at its own path
        return [(m, _weight(root, m)) for m in names]
    if w.is_meta:
        raise MetaWeightError(f"the fused weight at '{path}.weight' is on the meta device: its members' values are "
                              "needed to fingerprint it; lower the model with its weights loaded")
    starts = [sum(rows[:i]) for i in range(len(rows))]
    return [(m, w[s:s + r]) for m, s, r in zip(names, starts, rows)]


def graph_block_lists(structure) -> Dict[str, Dict[str, Any]]:
    # class names without their module: the file stays valid when diffusers moves a class
    return {bl.name: {"cls": bl.cls.rsplit(".", 1)[-1], "count": int(bl.count)} for bl in structure.block_lists}


def place_tables(tables: Dict[str, Dict[str, torch.Tensor]], weight: torch.Tensor
                 ) -> Dict[str, Dict[str, torch.Tensor]]:
    """``tables`` on ``weight``'s device, the activation-dtype fields in its dtype (no copy when they are)."""
    return {p: {f: t.to(weight.device, weight.dtype if f in ACT_DTYPE_FIELDS else t.dtype) for f, t in tab.items()}
            for p, tab in tables.items()}
