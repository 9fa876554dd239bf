"""What a compiled module keeps resident, by kind and by block (``CompiledDiT.memory_report()``).

:func:`memory_report` walks named roots (the lowered graphs first, then the user's module, then the runtime
state and the passes) breadth-first and counts every real tensor storage once, under the first name that
reaches it: two graphs sharing a quantized table, a module slot re-pointed at a graph's tensor, the ledger's
record of a replacement, all count once. Each storage gets one kind:

* ``offloaded_host``: read by a ``dit_passes::onload`` node (loaded onto the device as its block runs);
* ``int4_packed`` / ``int8`` / ``fp8``: a quantized linear's ``qweight`` (by dtype);
* ``scales``: ``wscale`` / ``smooth_inv`` and other ``*scale`` tensors; ``low_rank``: ``lora_down`` / ``lora_up``;
* ``fp32`` / ``bf16`` / ``fp16``: other floating tensors held by a module (dense weights, biases, norms);
* ``state``: tensors reached only through the runtime or the passes (cache buffers, anything kept besides);
* ``other``: integer buffers and the rest.

Meta tensors (weights the passes released) hold no memory: they are listed apart (``released``), with the
bytes they would take. Fake tensors and fx graphs' metadata are not entered.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import types
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

_SKIP_TYPES = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, types.BuiltinFunctionType,
               types.CodeType, torch.dtype, torch.device, torch.fx.Graph, torch.fx.Node)


@dataclasses.dataclass
class TensorEntry:
    """One storage (or one released meta tensor): the first name that reaches it, what it is, its bytes."""

    name: str
    kind: str
    block: str          # "<block list>.<index>" or "other"
    shape: Tuple[int, ...]
    dtype: str
    device: str
    nbytes: int


@dataclasses.dataclass
class MemoryReport:
    """Resident bytes of one rank: ``entries`` (one per storage) and ``released`` (meta, not resident)."""

    rank: int
    entries: List[TensorEntry]
    released: List[TensorEntry]

    @property
    def total(self) -> int:
        """Bytes of every distinct storage reachable (device, host-offloaded and runtime state)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def by_kind(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for e in self.entries:
            out[e.kind] = out.get(e.kind, 0) + e.nbytes
        return out

    @property
    def by_block(self) -> Dict[str, int]:
        """Bytes per block (``other``: outside the blocks), offloaded weights excluded (they are on the host)."""
        out: Dict[str, int] = {}
        for e in self.entries:
            if e.kind != "offloaded_host":
                out[e.block] = out.get(e.block, 0) + e.nbytes
        return out

    @property
    def released_bytes(self) -> int:
        return sum(e.nbytes for e in self.released)

    def as_dict(self) -> Dict[str, Any]:
        return {"rank": self.rank, "total": self.total, "by_kind": self.by_kind, "by_block": self.by_block,
                "released_bytes": self.released_bytes, "released": len(self.released),
                "storages": len(self.entries)}

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {_size(v)}" for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1]))
        lines = [f"memory (rank {self.rank}): {_size(self.total)} resident in {len(self.entries)} storages; "
                 f"released (meta): {_size(self.released_bytes)} in {len(self.released)} tensors",
                 f"  by kind: {kinds or 'nothing'}"]
        groups: Dict[str, List[int]] = {}
        for block, n in self.by_block.items():
            groups.setdefault(block.rsplit(".", 1)[0] if block != "other" else block, []).append(n)
        parts = [f"{g} {_size(sum(v))}" + (f" ({len(v)} blocks, {_size(min(v))}..{_size(max(v))} each)"
                                           if g != "other" else "") for g, v in groups.items()]
        lines.append(f"  by block: {', '.join(parts) or 'nothing'}")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _kind(name: str, t: torch.Tensor, via_module: bool) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "qweight":
        packed = {torch.uint8: "int4_packed", torch.int8: "int8"}
        return packed.get(t.dtype, "fp8" if t.element_size() == 1 else "other")
    if leaf in ("wscale", "smooth_inv") or leaf.endswith("scale"):
        return "scales"
    if leaf in ("lora_down", "lora_up"):
        return "low_rank"
    if not via_module:
        return "state"
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        t.dtype, "fp8" if t.is_floating_point() and t.element_size() == 1 else "other")


def onloaded_tensors(graphs: Iterable[torch.nn.Module]) -> List[torch.Tensor]:
    """The attribute tensors that ``dit_passes::onload`` nodes of ``graphs`` (and their subgraphs) load."""
    out = []
    for root in graphs:
        for mod in root.modules():
            graph = getattr(mod, "graph", None)
            for n in getattr(graph, "nodes", ()):
                if n.op == "get_attr" and any(str(u.target) == "dit_passes.onload.default" for u in n.users):
                    out.append(mod.get_parameter(n.target) if _is_param(mod, n.target) else mod.get_buffer(n.target))
    return out


def _is_param(mod: torch.nn.Module, target: str) -> bool:
    owner, _, leaf = target.rpartition(".")
    return leaf in (mod.get_submodule(owner) if owner else mod)._parameters


def _key(t: torch.Tensor) -> Tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def memory_report(roots: Sequence[Tuple[str, Any]], block_lists: Sequence[str] = (), rank: int = 0,
                  offloaded: Iterable[torch.Tensor] = ()) -> MemoryReport:
    """Count the storages reachable from ``roots`` (``(name, object)``, each walked breadth-first, in order);
    ``block_lists`` name the block lists (``transformer_blocks``) that attribute bytes to blocks."""
    from torch._subclasses.fake_tensor import FakeTensor

    block_re = re.compile(r"(?:^|\.)(" + "|".join(map(re.escape, block_lists)) + r")\.(\d+)(?:\.|$)") \
        if block_lists else None
    host: Set[Tuple[str, int]] = {_key(t) for t in offloaded}
    seen_obj: Set[int] = set()
    seen_storage: Set[Tuple[str, int]] = set()
    entries: List[TensorEntry] = []
    released: List[TensorEntry] = []

    def entry(name: str, t: torch.Tensor, kind: str, nbytes: int) -> TensorEntry:
        m = block_re.search(name) if block_re is not None else None
        return TensorEntry(name, kind, f"{m.group(1)}.{m.group(2)}" if m else "other", tuple(t.shape),
                           str(t.dtype).replace("torch.", ""), str(t.device), nbytes)

    for root in roots:  # one root after the other: a storage takes the name of the first root reaching it
        queue = collections.deque([(*root, False)])
        while queue:
            name, obj, via_module = queue.popleft()
            if id(obj) in seen_obj or isinstance(obj, _SKIP_TYPES) or isinstance(obj, FakeTensor):
                continue
            seen_obj.add(id(obj))
            if isinstance(obj, torch.Tensor):
                if obj.is_meta:
                    released.append(entry(name, obj, "released", obj.numel() * obj.element_size()))
                elif _key(obj) not in seen_storage:
                    seen_storage.add(_key(obj))
                    kind = "offloaded_host" if _key(obj) in host else _kind(name, obj, via_module)
                    entries.append(entry(name, obj, kind, obj.untyped_storage().nbytes()))
                continue
            queue.extend(_children(name, obj, via_module))
    return MemoryReport(rank, entries, released)


def _children(name: str, obj: Any, via_module: bool) -> Iterable[Tuple[str, Any, bool]]:
    """What the walk enters next from ``obj``: a module's tensors under their paths, containers' items,
    other objects' attributes; a generated function's globals and closure (GraphRunner's code)."""
    if isinstance(obj, torch.nn.Module):
        for store in ("_parameters", "_buffers", "_modules"):
            for k, v in getattr(obj, store).items():
                yield f"{name}.{k}", v, True
        for k, v in vars(obj).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                yield f"{name}.{k}", v, False
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield f"{name}[{k!r}]" if not isinstance(k, str) else f"{name}.{k}", v, via_module
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        for i, v in enumerate(obj):
            yield f"{name}[{i}]", v, via_module
    elif isinstance(obj, types.FunctionType):
        if "__name__" not in obj.__globals__:  # exec'd code (GraphRunner): its globals are its constants
            yield f"{name}.<globals>", obj.__globals__, False
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                yield f"{name}.<closure{i}>", cell.cell_contents, False
            except ValueError:  # an empty cell
                continue
    elif isinstance(obj, types.MethodType):
        yield name, obj.__self__, via_module
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
        for k, v in attrs.items():
            yield f"{name}.{k}", v, False


__all__ = ["MemoryReport", "TensorEntry", "memory_report", "onloaded_tensors"]
