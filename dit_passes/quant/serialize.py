"""Saving and loading quantized linears: ``<dir>/<quant_type>.safetensors`` + ``<dir>/<quant_type>.json``.

The safetensors file holds the tensors (no pickle), named ``<linear path>.<field>`` (e.g.
``transformer_blocks.0.attn.to_q.qweight``). The JSON sidecar holds the format version, the config,
the per-linear list (tensor names, shapes, dtypes), the model-structure signature and the sha256 of
the safetensors file. Loading verifies all of them before a tensor is used.

A structure signature is a dict; :func:`structure_signature` builds the usual one,
``{"model_class": str, "linears": {path: {"out_features", "in_features", "bias"}}}``. Other keys are
compared for equality.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
_QUANT_TYPE_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class QuantizedCheckpointError(ValueError):
    """A saved quantization that cannot be used: corrupted, for another model, or another config."""


def structure_signature(model: nn.Module, paths: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Signature of ``model``'s linears (all ``nn.Linear``, or only those at ``paths``), in module order."""
    wanted = None if paths is None else set(paths)
    linears = {}
    for path, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (wanted is None or path in wanted):
            linears[path] = {"out_features": mod.out_features, "in_features": mod.in_features,
                             "bias": mod.bias is not None}
    if wanted is not None and wanted - set(linears):
        raise ValueError(f"no nn.Linear at {sorted(wanted - set(linears))[:5]} in {type(model).__name__}")
    return {"model_class": type(model).__name__, "linears": linears}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _paths(path_dir: str, quant_type: str) -> Tuple[str, str]:
    if not isinstance(quant_type, str) or not _QUANT_TYPE_RE.match(quant_type):
        raise ValueError(f"config['quant_type'] must be a plain name like 'svdq_int4_r32', got {quant_type!r}")
    return os.path.join(path_dir, f"{quant_type}.safetensors"), os.path.join(path_dir, f"{quant_type}.json")


def _linear_table(tensors: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, Any]]:
    table: Dict[str, Dict[str, Any]] = {}
    for name, t in tensors.items():
        if "." not in name:
            raise ValueError(f"tensor name {name!r} must be '<linear path>.<field>'")
        linear, field = name.rsplit(".", 1)
        table.setdefault(linear, {})[field] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
    return table


def _atomic_write(path: str, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp_", suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def save_quantized(path_dir: str, tensors: Dict[str, torch.Tensor], config: Dict[str, Any],
                   structure_signature: Dict[str, Any]) -> str:
    """Write the tensors and their JSON sidecar; returns the safetensors path.

    ``config`` must be JSON-serializable and hold ``quant_type`` (it names the files). Files are written
    to a temporary name and renamed, so a crash never leaves a half-written pair behind a valid name.
    """
    if "quant_type" not in config:
        raise ValueError("config needs 'quant_type' (it names the files, e.g. 'svdq_int4_r32')")
    st_path, js_path = _paths(path_dir, config["quant_type"])
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"tensors must all be torch.Tensor; not: {bad[:5]}")
    os.makedirs(path_dir, exist_ok=True)
    table = _linear_table(tensors)
    try:
        meta_json = json.dumps({"config": config, "structure": structure_signature}, sort_keys=True)
    except TypeError as e:
        raise TypeError(f"config and structure_signature must be JSON-serializable: {e}") from None
    # Own, contiguous CPU copies: safetensors refuses shared or strided storage.
    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    _atomic_write(st_path, lambda p: save_file(cpu, p, metadata={"format": "pt", "dit_passes": "quantized"}))
    sidecar = {"format_version": FORMAT_VERSION, "quant_type": config["quant_type"], "sha256": _sha256(st_path),
               **json.loads(meta_json), "linears": table}
    _atomic_write(js_path, lambda p: _write_text(p, json.dumps(sidecar, indent=1, sort_keys=True)))
    return st_path


def _first_structure_mismatch(saved: Dict[str, Any], expected: Dict[str, Any]) -> Optional[str]:
    for key in sorted(set(saved) | set(expected)):
        if key == "linears":
            continue
        if saved.get(key) != expected.get(key):
            return f"'{key}' is {saved.get(key)!r} in the file but {expected.get(key)!r} in the model"
    s_lin, e_lin = saved.get("linears", {}), expected.get("linears", {})
    for path, spec in e_lin.items():
        if path not in s_lin:
            return f"linear '{path}' of the model is not in the file"
        if s_lin[path] != spec:
            return f"linear '{path}' is {s_lin[path]} in the file but {spec} in the model"
    for path in s_lin:
        if path not in e_lin:
            return f"linear '{path}' in the file does not exist in the model"
    return None


def find_quant_type(path_dir: str, quant_type: Optional[str] = None) -> str:
    """``quant_type``, or the one checkpoint ``path_dir`` holds (refused when it holds none or several)."""
    if not os.path.isdir(path_dir):
        raise QuantizedCheckpointError(f"quantized checkpoint directory {path_dir!r} does not exist; quantize first "
                                       "with serialize_to=<that directory>")
    if quant_type is not None:
        return quant_type
    names = sorted(f[:-5] for f in os.listdir(path_dir)
                   if f.endswith(".json") and os.path.exists(os.path.join(path_dir, f[:-5] + ".safetensors")))
    if len(names) != 1:
        raise QuantizedCheckpointError(f"{path_dir} holds {len(names)} quantized checkpoints {names}; "
                                       "pass quant_type= to choose one")
    return names[0]


def load_quantized(path_dir: str, expected_structure_signature: Dict[str, Any], quant_type: Optional[str] = None,
                   expected_config: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Load and verify what :func:`save_quantized` wrote; returns ``(tensors, config)``.

    Raises :class:`QuantizedCheckpointError` when a file is missing, the sha256 differs (corruption),
    the structure signature differs (naming the first mismatching linear), the tensors differ from the
    sidecar's list, or a key of ``expected_config`` differs from the saved config.
    """
    quant_type = find_quant_type(path_dir, quant_type or None)
    st_path, js_path = _paths(path_dir, quant_type)
    for p in (st_path, js_path):
        if not os.path.exists(p):
            raise QuantizedCheckpointError(f"missing {p}; re-run the quantization with serialize_to={path_dir!r}")
    try:
        with open(js_path) as f:
            side = json.load(f)
    except json.JSONDecodeError as e:
        raise QuantizedCheckpointError(f"{js_path} is not valid JSON ({e}); delete the directory and re-quantize") from None
    if side.get("format_version") != FORMAT_VERSION:
        raise QuantizedCheckpointError(f"{js_path} has format_version {side.get('format_version')!r}, this "
                                       f"library reads {FORMAT_VERSION}; re-quantize")
    digest = _sha256(st_path)
    if digest != side.get("sha256"):
        raise QuantizedCheckpointError(f"{st_path} is corrupted: its sha256 {digest[:16]}... differs from the "
                                       f"recorded {str(side.get('sha256'))[:16]}...; delete it and re-quantize")
    # JSON round trip so that tuples in the caller's signature compare equal to the saved lists.
    expected = json.loads(json.dumps(expected_structure_signature))
    mismatch = _first_structure_mismatch(side.get("structure", {}), expected)
    if mismatch:
        raise QuantizedCheckpointError(f"{st_path} was quantized for another model: {mismatch}")
    config = side.get("config", {})
    if config.get("quant_type") != quant_type:
        raise QuantizedCheckpointError(f"{js_path} records quant_type {config.get('quant_type')!r}, "
                                       f"the file name says {quant_type!r}")
    for key, want in json.loads(json.dumps(expected_config or {})).items():
        if config.get(key) != want:
            raise QuantizedCheckpointError(f"{st_path} was quantized with {key}={config.get(key)!r}, "
                                           f"expected {want!r}; re-quantize or change the config")
    tensors = load_file(st_path)
    if _linear_table(tensors) != side.get("linears"):
        raise QuantizedCheckpointError(f"{st_path}: the tensors differ from the list in {js_path}")
    return tensors, config


def memory_report(tensors: Dict[str, torch.Tensor], structure_signature: Dict[str, Any]) -> Dict[str, Any]:
    """Bytes of the quantized linears vs the same linears in bf16 (weight + bias).

    Returns ``{"quantized_bytes", "bf16_bytes", "ratio", "per_linear": {path: (quantized, bf16)}}``
    over the linears that have tensors (their path is the name up to the last dot).
    """
    q_bytes: Dict[str, int] = {}
    for name, t in tensors.items():
        path = name.rsplit(".", 1)[0]
        q_bytes[path] = q_bytes.get(path, 0) + t.numel() * t.element_size()
    linears = structure_signature.get("linears", {})
    unknown = [p for p in q_bytes if p not in linears]
    if unknown:
        raise ValueError(f"tensors for linears missing from the structure signature: {unknown[:5]}")
    per = {}
    for path, qb in q_bytes.items():
        spec = linears[path]
        bf16 = 2 * spec["out_features"] * (spec["in_features"] + (1 if spec["bias"] else 0))
        per[path] = (qb, bf16)
    total_q = sum(v[0] for v in per.values())
    total_b = sum(v[1] for v in per.values())
    return {"quantized_bytes": total_q, "bf16_bytes": total_b,
            "ratio": total_q / total_b if total_b else float("nan"), "per_linear": per}
