"""Reading a saved quantization for a model: :func:`read_checkpoint` -> the verified tensors and config.

``path`` is the ``serialize_to`` directory of a quantization pass (``SVDQuantW4A4``, ``Fp8Linear``,
``Int8Linear``). Before anything is captured, the files are checked against ``model``:

* the sha256 of the safetensors file (a corrupted or truncated file is refused);
* the structure signature: the block lists (names, block classes, counts), every quantized linear's
  shape and bias, and a fingerprint of its original weights (another model, another fine-tune, or a
  different number of blocks is refused, naming the first difference);
* the config: format, kind and quant_type must be ones this library writes.

The graph rewrite that substitutes the tensors is the pass ``dit_passes.passes.load_quantized.LoadQuantized``;
``dit_passes.load(model, path)`` (the front end) puts both together into a CompiledDiT.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

import torch

from .serialize import QuantizedCheckpointError, find_quant_type, load_quantized
from .signature import FORMAT, MetaWeightError, quant_signature


def _read_sidecar(path: str, quant_type: str) -> Dict[str, Any]:
    js = os.path.join(path, f"{quant_type}.json")
    if not os.path.exists(js):
        raise QuantizedCheckpointError(f"missing {js}; re-run the quantization with serialize_to={path!r}")
    try:
        with open(js) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise QuantizedCheckpointError(f"{js} is not valid JSON ({e}); delete the directory and re-quantize") from None


def _model_block_lists(model: torch.nn.Module, saved: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    out = {}
    for name in saved:
        try:
            lst = model.get_submodule(name)
        except AttributeError:
            out[name] = None  # compared unequal below, naming the key
            continue
        first = lst[0] if isinstance(lst, torch.nn.ModuleList) and len(lst) else None
        out[name] = {"cls": type(first).__name__ if first is not None else type(lst).__name__,
                     "count": len(lst) if isinstance(lst, torch.nn.ModuleList) else 0}
    return out


def saved_fused(sidecar: Dict[str, Any]) -> Dict[str, Any]:
    """``{path: [[member, rows], ...]}`` of the linears the checkpoint was quantized fused (``FuseSiblingLinears``)."""
    linears = (sidecar.get("structure") or {}).get("linears") or {}
    return {p: spec["members"] for p, spec in linears.items() if isinstance(spec, dict) and "members" in spec}


def expected_signature(model: torch.nn.Module, sidecar: Dict[str, Any]) -> Dict[str, Any]:
    """The signature ``model`` has for the linears and block lists the sidecar names (a fused linear: its members',
    each read at its own path of the model)."""
    structure = sidecar.get("structure") or {}
    paths = list((structure.get("linears") or {}).keys())
    if not paths:
        raise QuantizedCheckpointError("the checkpoint lists no quantized linear; re-quantize")
    try:
        return quant_signature(model, paths, _model_block_lists(model, structure.get("block_lists") or {}),
                               saved_fused(sidecar))
    except MetaWeightError as e:
        raise QuantizedCheckpointError(str(e)) from None
    except ValueError as e:
        raise QuantizedCheckpointError(f"the checkpoint was quantized for another model: {e}") from None


def read_checkpoint(model: torch.nn.Module, path, quant_type: Optional[str] = None
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], str]:
    """``(tensors, config, source)`` of the checkpoint in directory ``path``, verified against ``model``.

    ``quant_type`` picks one checkpoint when the directory holds several. ``config`` carries
    ``_weights_sha256`` (the model's fingerprint, checked again on the captured graph) and ``_fused`` (the fused
    linears' members, which the graph must fuse alike: ``FuseSiblingLinears``); ``source`` is
    ``<path>/<quant_type>`` for messages. Raises :class:`QuantizedCheckpointError` for a missing,
    corrupted or mismatching checkpoint.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load(model, path) needs the transformer nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    quant_type = find_quant_type(path, quant_type)
    sidecar = _read_sidecar(path, quant_type)
    if (sidecar.get("config") or {}).get("format") != FORMAT:
        raise QuantizedCheckpointError(f"{path}/{quant_type}.json has format "
                                       f"{(sidecar.get('config') or {}).get('format')!r}, expected {FORMAT!r}; "
                                       "re-quantize with this version of dit_passes")
    expected = expected_signature(model, sidecar)
    try:
        tensors, config = load_quantized(path, expected, quant_type)
    except QuantizedCheckpointError as e:
        if "weights_sha256" in str(e):
            raise QuantizedCheckpointError(
                f"{path}/{quant_type}: the model's weights differ from the weights that were quantized (another "
                "checkpoint or fine-tune); re-quantize this model") from None
        raise
    return (tensors, {**config, "_weights_sha256": expected["weights_sha256"], "_fused": saved_fused(sidecar)},
            f"{path}/{quant_type}")
