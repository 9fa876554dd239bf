"""Loading a saved quantization: ``dit_passes.load(model, path)`` -> a CompiledDiT, no calibration.

``path`` is the ``serialize_to`` directory of a quantization pass (``SVDQuantW4A4``, ``Fp8Linear``,
``Int8Linear``). Before anything is captured, :func:`load` checks the files against ``model``:

* the sha256 of the safetensors file (a corrupted or truncated file is refused);
* the structure signature: the block lists (names, block classes, counts), every quantized linear's
  shape and bias, and a fingerprint of its original weights (another model, another fine-tune, or a
  different number of blocks is refused, naming the first difference);
* the config: format, kind and quant_type must be ones this library writes.

The returned CompiledDiT runs :class:`LoadQuantized` (then any extra ``passes``) on each captured
graph: the same substitution as the quantization pass, with the stored tensors moved to the model's
device and the factors cast to its dtype.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..passes.quantize import FORMAT, QUANT_KINDS, apply_quantized, graph_block_lists, place_tables, quant_signature, tensor_at
from .serialize import QuantizedCheckpointError, load_quantized


def _choose_quant_type(path: str, quant_type: Optional[str]) -> str:
    if not os.path.isdir(path):
        raise QuantizedCheckpointError(f"quantized checkpoint directory {path!r} does not exist; quantize first "
                                       "with serialize_to=<that directory>")
    if quant_type is not None:
        return quant_type
    names = sorted(f[:-5] for f in os.listdir(path)
                   if f.endswith(".json") and os.path.exists(os.path.join(path, f[:-5] + ".safetensors")))
    if len(names) != 1:
        raise QuantizedCheckpointError(f"{path} holds {len(names)} quantized checkpoints {names}; "
                                       "pass quant_type= to choose one")
    return names[0]


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


def expected_signature(model: torch.nn.Module, sidecar: Dict[str, Any]) -> Dict[str, Any]:
    """The signature ``model`` has for the linears and block lists the sidecar names."""
    structure = sidecar.get("structure") or {}
    paths = list((structure.get("linears") or {}).keys())
    if not paths:
        raise QuantizedCheckpointError("the checkpoint lists no quantized linear; re-quantize")
    try:
        return quant_signature(model, paths, _model_block_lists(model, structure.get("block_lists") or {}))
    except ValueError as e:
        raise QuantizedCheckpointError(f"the checkpoint was quantized for another model: {e}") from None


class LoadQuantized(Pass):
    """Substitute stored quantized tensors into the graph (the rewrite of the quantization passes).

    ``tensors``: ``{"<linear path>.<field>": tensor}``; ``config``: the saved config (``kind`` picks the op).
    Every stored linear must be found as an ``aten.linear`` of a block in the graph.
    """

    name = "load_quantized"
    phase = Phase.QUANTIZE
    reads = ("structure",)
    invalidates = ("structure",)

    def __init__(self, tensors: Dict[str, torch.Tensor], config: Dict[str, Any], source: str = ""):
        kind = config.get("kind")
        if kind not in QUANT_KINDS:
            raise QuantizedCheckpointError(f"{source}: unknown quantized kind {kind!r}; this library writes "
                                           f"{sorted(QUANT_KINDS)}")
        self.kind, self.config, self.source = kind, dict(config), source
        self.tables: Dict[str, Dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            path, field = name.rsplit(".", 1)
            self.tables.setdefault(path, {})[field] = t
        need = [a for a in QUANT_KINDS[kind].tensor_args if a != "bias"]
        for path, tab in self.tables.items():
            missing = [a for a in need if a not in tab]
            if missing:
                raise QuantizedCheckpointError(f"{source}: linear {path} lacks tensors {missing}; re-quantize")
        self._placed: Dict[Any, Dict[str, Dict[str, torch.Tensor]]] = {}

    def config_items(self) -> Dict[str, Any]:
        return {"quant_type": self.config.get("quant_type"), "source": self.source}

    def _on(self, weight: torch.Tensor) -> Dict[str, Dict[str, torch.Tensor]]:
        # One copy per (device, dtype), shared by every signature's graph.
        key = (weight.device, weight.dtype)
        if key not in self._placed:
            self._placed[key] = place_tables(self.tables, weight)
        return self._placed[key]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.frontend != "export":
            raise PassError("loading quantized weights needs compile_dit / dit_passes.load (the export front end)")
        structure = get_structure(gm)
        sites = [s for s in structure.linears if s.block is not None and s.module_path in self.tables]
        found = {s.module_path for s in sites}
        absent = [p for p in self.tables if p not in found]
        if absent:
            raise PassError(f"{self.source}: stored linears not found among the graph's block linears: {absent[:5]}")
        sig = quant_signature(gm, list(self.tables), graph_block_lists(structure))
        if sig["weights_sha256"] != self.config.get("_weights_sha256", sig["weights_sha256"]):
            raise PassError(f"{self.source}: the model's weights changed since dit_passes.load checked them")
        weight = tensor_at(gm, sites[0].weight)  # device and dtype the stored tensors follow
        counts = apply_quantized(gm, sites, self._on(weight), self.kind)
        ratio = counts["bytes_after"] / max(counts["bytes_before"], 1)
        return PassResult(True, counts, f"{self.config.get('quant_type')} loaded from {self.source}: "
                                        f"{counts['replaced']} linear node(s); {counts['bytes_before']} -> "
                                        f"{counts['bytes_after']} bytes ({ratio:.2f}x)")


def load(model: torch.nn.Module, path, quant_type: Optional[str] = None, *, passes: Sequence[Pass] = (),
         **compile_kwargs: Any):
    """A CompiledDiT of ``model`` whose block linears are the quantized ones saved in ``path``.

    ``quant_type`` picks one checkpoint when the directory holds several; ``passes`` run after the
    substitution (e.g. ``[passes.DBCache()]``); other keyword arguments go to ``compile_dit``.
    Raises :class:`~dit_passes.quant.serialize.QuantizedCheckpointError` for a missing, corrupted or
    mismatching checkpoint.
    """
    from .. import compile_dit

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load(model, path) needs the transformer nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    quant_type = _choose_quant_type(path, quant_type)
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
    config = {**config, "_weights_sha256": expected["weights_sha256"]}
    loader = LoadQuantized(tensors, config, source=f"{path}/{quant_type}")
    return compile_dit(model, passes=[loader, *passes], **compile_kwargs)
