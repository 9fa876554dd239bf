"""Captured-graph templates shared between processes through a directory (opt-in: ``DIT_PASSES_TRACE_DIR``).

:mod:`.trace_templates` reuses a capture within one process. The test suite runs several processes that build the
same tiny models: two xdist workers, the rank processes of every 2- and 4-rank case (each rank captures the same
model), a Ray worker. A :class:`TraceStore` keeps each template in a file named by a hash of its key, so that one
process captures and the others load:

    file name = sha256(repr((module fingerprint, call signature)), torch version)     # None: not shareable
    file      = pickle of [(mask values, template state), ...]   (graph as node records, tensors of the template)
    miss      = lock <name>.lock (fcntl: the kernel releases it when the holder dies) -> read again -> capture ->
                write <name>.tmp.<pid> -> rename onto <name> (readers see the old file or the new one, never half)

A key part that is not stable across processes (the ``id`` of a hook in the fingerprint, an object whose repr holds an
address) makes the key unshareable: that model is captured per process as before, never loaded wrong.

What a graph record keeps: per node its op, name, target (an ATen operator by its schema name, a higher-order
operator by its name, a Python function by reference), args and kwargs (nodes by name), type, and every meta entry;
``meta["val"]`` fake tensors are written as (shape, stride, storage offset, dtype, device, requires_grad) and rebuilt
in one fake mode per loaded graph (export's settings: ``allow_non_fake_inputs``, a shape environment), the way passes
use them (``detect_fake_mode``, ``fake_mode.from_tensor``). A template whose graph holds anything else that cannot
be written (a meta value that does not pickle, a target that is not importable) is kept in memory only.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import re
import time
from typing import Any, Dict, Hashable, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx

from .env import TRACE_DIR as ENV_DIR

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_LOCK_WAIT_S = 900.0  # a holder that neither finishes nor dies: capture without it rather than hang


class Unshareable(Exception):
    """The template holds something that cannot be written to the store (it stays in memory only)."""


def shared_name(key: Hashable) -> Optional[str]:
    """The file name for ``key``, or None when part of it is not the same in another process."""
    text = repr(key)
    if "('callable'," in text or _ADDRESS.search(text):
        return None  # a hook's id, an object printed with its address
    return hashlib.sha256(f"{torch.__version__}\n{text}".encode()).hexdigest()[:40]


class _NodeRef:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _FakeSpec:
    """A fake tensor's metadata: rebuilt as a fake tensor in the loaded graph's fake mode."""
    __slots__ = ("shape", "stride", "offset", "dtype", "device", "requires_grad")

    def __init__(self, t: torch.Tensor):
        if any(not isinstance(s, int) for s in (*t.shape, *t.stride(), t.storage_offset())):
            raise Unshareable("a symbolic shape")
        self.shape, self.stride, self.offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
        self.dtype, self.device, self.requires_grad = t.dtype, str(t.device), t.requires_grad

    def build(self) -> torch.Tensor:  # called under the fake mode
        if self.offset == 0:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device,
                                       requires_grad=self.requires_grad)
        extent = self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) + 1
        base = torch.empty(extent, dtype=self.dtype, device=self.device, requires_grad=self.requires_grad)
        return base.as_strided(self.shape, self.stride, self.offset)  # a view into a larger storage, as traced


class _Target:
    """An operator written by name (OpOverload / HigherOrderOperator objects do not pickle)."""
    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str):
        self.kind, self.name = kind, name

    def resolve(self) -> Any:
        if self.kind == "hop":
            return getattr(torch.ops.higher_order, self.name)
        ns, _, rest = self.name.partition("::")
        op, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")


def _encode_target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _Target("op", target.name())
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _Target("hop", target.name())
    return target  # a string (placeholder, get_attr, output) or an importable function (operator.getitem)


def _encode(x: Any) -> Any:
    """Args, kwargs and meta values with nodes by name and fake tensors by metadata."""
    if isinstance(x, fx.Node):
        return _NodeRef(x.name)
    if isinstance(x, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):  # meta["original_aten"] too
        return _encode_target(x)
    if isinstance(x, torch.Tensor):
        if isinstance(x, torch._subclasses.fake_tensor.FakeTensor) or x.is_meta:
            return _FakeSpec(x)
        return x  # a real tensor constant in args (rare): pickled with its data
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise Unshareable("a symbolic value")
    if isinstance(x, (list, tuple)) and type(x) is not torch.Size and not hasattr(x, "_fields"):
        return (list if isinstance(x, list) else tuple)(_encode(v) for v in x)  # fx's immutable_list too
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, slice):
        return slice(_encode(x.start), _encode(x.stop), _encode(x.step))
    return x


def _decode(x: Any, nodes: Dict[str, fx.Node], mode) -> Any:
    if isinstance(x, _NodeRef):
        return nodes[x.name]
    if isinstance(x, _Target):
        return x.resolve()
    if isinstance(x, _FakeSpec):
        with mode:
            return x.build()
    if type(x) in (list, tuple):
        return type(x)(_decode(v, nodes, mode) for v in x)
    if type(x) is dict:
        return {k: _decode(v, nodes, mode) for k, v in x.items()}
    if isinstance(x, slice):
        return slice(_decode(x.start, nodes, mode), _decode(x.stop, nodes, mode), _decode(x.step, nodes, mode))
    return x


def graph_state(graph: fx.Graph) -> Dict[str, Any]:
    """A picklable record of ``graph`` (Unshareable if it holds something that is not)."""
    if type(graph._codegen) is not fx.graph.CodeGen:
        raise Unshareable(f"a graph with {type(graph._codegen).__name__}")
    rows = [(n.op, n.name, _encode(n.target), _encode(n.args), _encode(n.kwargs), n.type, _encode(n.meta))
            for n in graph.nodes]
    return {"nodes": rows}


def graph_from_state(state: Dict[str, Any], mode) -> fx.Graph:
    graph = fx.Graph()
    nodes: Dict[str, fx.Node] = {}
    for op, name, target, args, kwargs, type_expr, meta in state["nodes"]:
        node = graph.create_node(op, _decode(target, nodes, mode), _decode(args, nodes, mode), _decode(kwargs, nodes, mode), name,
                                 type_expr)
        if node.name != name:
            raise Unshareable(f"node {name} renamed {node.name} on load")
        node.meta = _decode(meta, nodes, mode)
        nodes[name] = node
    return graph


def new_fake_mode():
    """A fake mode set up as torch.export's: real tensors may meet fake ones (constants), a shape environment."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


def module_state(gm: torch.nn.Module) -> Dict[str, Any]:
    """A higher-order op's body (a GraphModule holding no tensor, maybe bodies of its own) as a record."""
    if type(gm) is not fx.GraphModule and not isinstance(gm, fx.GraphModule):
        raise Unshareable(f"a submodule of type {type(gm).__name__}")
    children = {name: module_state(child) for name, child in gm.named_children()}
    return {"graph": graph_state(gm.graph), "children": children}


def module_from_state(state: Dict[str, Any], mode) -> fx.GraphModule:
    root = torch.nn.Module()
    for name, child in state["children"].items():
        root.add_module(name, module_from_state(child, mode))
    return fx.GraphModule(root, graph_from_state(state["graph"], mode))


class TraceStore:
    """Templates in ``directory``, one file per shareable key (see the module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.loads = 0
        self.writes = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def read(self, name: str) -> List[Tuple[Hashable, Any]]:
        """The entries stored under ``name`` (value key, template state); [] if none or unreadable."""
        try:
            with open(self._path(name), "rb") as f:
                entries = pickle.load(f)
        except FileNotFoundError:
            return []
        except Exception:  # noqa: BLE001 - written by another torch/diffusers, or a class that left: capture afresh
            return []
        self.loads += 1
        return entries

    def write(self, name: str, entries: List[Tuple[Hashable, Any]]) -> bool:
        """Write atomically (temp file + rename); False if an entry does not pickle (nothing is written)."""
        try:
            data = pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a meta value or a target that does not pickle: memory only
            return False
        tmp = f"{self._path(name)}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(name))
        self.writes += 1
        return True

    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Exclusive use of ``name`` among processes; the kernel drops the lock if its holder dies."""
        with open(self._path(name) + ".lock", "a+b") as f:
            deadline = time.monotonic() + _LOCK_WAIT_S
            held = False
            while not held:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break  # stuck holder: go on without the lock (a second capture, not a wrong one)
                    time.sleep(0.05)
            try:
                yield
            finally:
                if held:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)


__all__ = ["ENV_DIR", "TraceStore", "Unshareable", "graph_from_state", "graph_state", "module_from_state",
           "module_state", "new_fake_mode", "shared_name"]
