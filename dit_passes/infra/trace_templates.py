"""Captured graphs reused across model instances of one architecture (opt-in; what the test suite uses).

torch.export of a tiny DiT takes 1-5 s on a CPU core, and a process that builds the same architecture many times
(the test suite, a sweep, two identical transformers such as Wan 2.2's pair) traces the same graph again each
time. A :class:`TraceTemplates` keeps the captured graph *without its tensors* under a key that covers everything
that can change what export traces, and binds a later model's own parameters and buffers into a copy of it:

    key = (module fingerprint, call signature)      # values of mask-like inputs too for specialised graphs
    template = graph copy + get_attr targets + the constants created inside forward (not the model's)
    hit  -> fx.GraphModule({target: the new model's tensor}, graph copy)  == a fresh capture of the new model

The module fingerprint is every submodule's path and class, its parameters' and buffers' names, shapes, dtypes,
devices and tensor types, and its plain attributes (numbers, strings, flags such as ``training``, the class and
attributes of objects it holds such as attention processors, the identity of its hooks). Parameter *values* are not
in it: export's graph does not depend on them (data-dependent Python either fails export or is specialised and
guarded at run time, see capture's docstring). Global state export may read (a context manager that selects an
attention backend) is not in the key: reuse is off unless asked for (:func:`default_templates`).

Ownership: a template holds no tensor of the model it was captured from (a cache keeps no weight).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import types
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import env
from .trace_store import (TraceStore, Unshareable, graph_from_state, graph_state, module_from_state,
                          module_state, new_fake_mode, shared_name)

ENV_FLAG = env.REUSE_TRACES
_SKIP_ATTRS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _value_key(v: Any, depth: int = 0) -> Hashable:
    """A hashable description of an attribute value, deep enough to tell two configurations apart."""
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return (type(v).__name__, v)
    if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ("torch", str(v))
    if isinstance(v, torch.Tensor):  # a plain tensor attribute: its value is bound from the model on reuse
        return ("tensor", type(v).__qualname__, tuple(v.shape), str(v.dtype), str(v.device))
    if isinstance(v, torch.nn.Module):
        return ("module", type(v).__module__, type(v).__qualname__)  # its own state is keyed as a submodule
    if isinstance(v, type):
        return ("class", v.__module__, v.__qualname__)
    if isinstance(v, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)):
        # held by an instance (a hook, a replaced forward): two closures of one qualname can behave differently
        return ("callable", getattr(v, "__module__", ""), getattr(v, "__qualname__", repr(v)), id(v))
    if depth >= 3:
        return ("deep", type(v).__module__, type(v).__qualname__)
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_value_key(x, depth + 1) for x in v]
        return (type(v).__name__, tuple(sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items))
    if isinstance(v, dict) or hasattr(v, "items") and callable(v.items):
        return ("dict", tuple(sorted((repr(k), _value_key(x, depth + 1)) for k, x in v.items())))
    if hasattr(v, "__dict__"):  # an object held by a module (an attention processor, a config): class and state
        return ("object", type(v).__module__, type(v).__qualname__,
                tuple(sorted((k, _value_key(x, depth + 1)) for k, x in vars(v).items())))
    return ("opaque", type(v).__module__, type(v).__qualname__, repr(v))


def _tensor_key(name: str, t: Optional[torch.Tensor]) -> Hashable:
    if t is None:
        return (name, None)
    return (name, type(t).__qualname__, tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad)


def module_fingerprint(model: torch.nn.Module) -> Hashable:
    """What decides the traced graph of ``model`` apart from its weights' values (see the module docstring)."""
    rows = []
    for path, m in model.named_modules(remove_duplicate=False):
        attrs = []
        for k, v in vars(m).items():
            if k in _SKIP_ATTRS:
                continue
            if k.startswith("_") and k.endswith("hooks") or k.endswith("hooks_with_kwargs"):
                v = tuple(dict(v).values())  # the hooks themselves, keyed as callables
            attrs.append((k, _value_key(v)))
        rows.append((path, type(m).__module__, type(m).__qualname__, tuple(sorted(attrs)),
                     tuple(_tensor_key(n, p) for n, p in m._parameters.items()),
                     tuple(_tensor_key(n, b) for n, b in m._buffers.items()),
                     tuple(sorted(m._non_persistent_buffers_set))))
    return (tuple(rows), str(torch.get_default_dtype()), env.diffusers_attention_backend())


class _Template:
    """A captured graph without tensors: rebuilt around another model's tensors by :meth:`instantiate`."""

    def __init__(self, gm: fx.GraphModule, model: torch.nn.Module, fields: Dict[str, Any]):
        self.graph = _copy_graph(gm.graph)
        self.fields = fields  # the Captured fields that depend only on the key
        own = _model_tensors(model)
        by_storage = {_storage_of(t): path for path, t in own.items()}
        self.constants: Dict[str, torch.Tensor] = {}
        self.aliases: Dict[str, Tuple[str, Tuple[int, ...], Tuple[int, ...], int]] = {}
        self.persistent: Dict[str, bool] = {}
        self.submodules: Dict[str, torch.nn.Module] = {}
        for n in gm.graph.nodes:
            if n.op != "get_attr":
                continue
            owner_path, _, attr = n.target.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            self.persistent[n.target] = attr not in owner._non_persistent_buffers_set
            if n.target in own:
                continue
            val = getattr(owner, attr)
            if isinstance(val, torch.nn.Module):  # a higher-order op's body (autocast, checkpoint regions)
                self.submodules[n.target] = copy.deepcopy(val)
                continue
            source = by_storage.get(_storage_of(val))
            if source is not None:  # a lifted alias of a weight (``param.to(device)`` in forward): rebind it
                self.aliases[n.target] = (source, tuple(val.shape), tuple(val.stride()), val.storage_offset())
            else:  # created inside forward (an arange, a literal): not the model's
                self.constants[n.target] = val.detach().clone()

    def state(self) -> Dict[str, Any]:
        """What :mod:`.trace_store` writes (Unshareable if part of it cannot be)."""
        try:  # a TreeSpec pickles with a deprecation warning of torch's: its JSON form
            fields = {**self.fields, "out_spec": pytree.treespec_dumps(self.fields["out_spec"])}
        except Exception as e:  # noqa: BLE001 - an output type pytree cannot name
            raise Unshareable(f"output structure: {e}") from e
        return {"graph": graph_state(self.graph), "fields": fields, "constants": self.constants,
                "aliases": self.aliases, "persistent": self.persistent,
                "submodules": {k: module_state(m) for k, m in self.submodules.items()}}

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> "_Template":
        mode = new_fake_mode()  # one per loaded graph, as one export has one
        self = cls.__new__(cls)
        self.graph = graph_from_state(state["graph"], mode)
        self.fields = {**state["fields"], "out_spec": pytree.treespec_loads(state["fields"]["out_spec"])}
        self.constants = state["constants"]
        self.aliases, self.persistent = state["aliases"], state["persistent"]
        self.submodules = {k: module_from_state(m, mode) for k, m in state["submodules"].items()}
        return self

    def instantiate(self, model: torch.nn.Module) -> Optional[fx.GraphModule]:
        own = _model_tensors(model)
        root: Dict[str, Any] = {}
        for target in self.persistent:
            if target in own:
                root[target] = own[target]
            elif target in self.aliases:
                source, size, stride, offset = self.aliases[target]
                if source not in own:
                    return None  # the model no longer has this weight: capture afresh
                root[target] = own[source].detach().as_strided(size, stride, offset)
            elif target in self.constants:
                root[target] = self.constants[target].clone()
            elif target in self.submodules:
                root[target] = copy.deepcopy(self.submodules[target])
            else:
                return None
        gm = fx.GraphModule(root, _copy_graph(self.graph))
        for target, persistent in self.persistent.items():
            owner_path, _, attr = target.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            val = getattr(owner, attr)
            if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter):  # moved by .to()
                delattr(owner, attr)
                owner.register_buffer(attr, val, persistent=persistent)
        return gm


def _model_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every tensor export can read from ``model`` by path: parameters, buffers and plain tensor attributes."""
    out: Dict[str, torch.Tensor] = {}
    for path, m in model.named_modules():
        prefix = f"{path}." if path else ""
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and k not in _SKIP_ATTRS:
                out[prefix + k] = v
        for k, v in list(m._parameters.items()) + list(m._buffers.items()):
            if v is not None:
                out[prefix + k] = v
    return out


def _calls_a_module(node: fx.Node) -> bool:
    """An opaque module call of capture (``dit_passes::opaque_module``): it runs one instance's module."""
    return node.op == "call_function" and str(node.target).startswith("dit_passes.opaque_module")


def _attr_at(gm: fx.GraphModule, target: str) -> Any:
    owner_path, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner_path) if owner_path else gm, attr)


def _storage_of(t: torch.Tensor) -> Tuple[int, str]:
    return (t.untyped_storage().data_ptr(), str(t.device)) if t.device.type != "meta" else (id(t), "meta")


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    """A node-for-node copy (same names, shallow-copied meta) with its output node's meta."""
    new = fx.Graph()
    val_map: Dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, val_map)
    old_out = graph.output_node()
    new_out = new.output(out, type_expr=old_out.type)
    new_out.meta = dict(old_out.meta)
    return new


class TraceTemplates:
    """Captured graphs by (module fingerprint, call signature); least recently used dropped past ``maxsize``.

    With a :class:`~.trace_store.TraceStore`, a key missing here is read from the store's directory (written by this
    or another process), and a capture is written there; :meth:`exclusive` lets one process capture a key while the
    others wait for its file.
    """

    def __init__(self, maxsize: int = 32, shared: Optional[TraceStore] = None):
        self.maxsize = maxsize
        self.shared = shared
        self._by_key: "collections.OrderedDict[Hashable, List[Tuple[Hashable, _Template]]]" = collections.OrderedDict()
        self.hits = 0
        self.misses = 0
        self.loaded = 0  # hits on a template read from the store

    @staticmethod
    def key_of(model: torch.nn.Module, call_key: Hashable) -> Hashable:
        return (module_fingerprint(model), call_key)

    def lookup(self, model: torch.nn.Module, key: Hashable,
               values_of: Callable[[List[int]], Hashable]) -> Optional[Tuple[fx.GraphModule, Dict[str, Any]]]:
        """A graph module for ``model`` and the Captured fields, or None (capture afresh)."""
        found = self._find(model, key, values_of)
        if found is None and self.shared is not None and self._read_store(key):
            found = self._find(model, key, values_of)
            self.loaded += found is not None
        self.hits += found is not None
        self.misses += found is None
        return found

    @contextlib.contextmanager
    def exclusive(self, model: torch.nn.Module, key: Hashable, values_of: Callable[[List[int]], Hashable]):
        """After a miss: holds the store's lock on ``key`` (no-op without a store or for an unshareable key) and yields
        what another process stored while this one waited (counted as a hit), or None: capture and :meth:`store`."""
        name = shared_name(key) if self.shared is not None else None
        if name is None:
            yield None
            return
        with self.shared.locked(name):
            found = self._find(model, key, values_of) if self._read_store(key) else None
            if found is not None:
                self.hits, self.misses, self.loaded = self.hits + 1, self.misses - 1, self.loaded + 1
            yield found

    def _find(self, model: torch.nn.Module, key: Hashable,
              values_of: Callable[[List[int]], Hashable]) -> Optional[Tuple[fx.GraphModule, Dict[str, Any]]]:
        for values, template in self._by_key.get(key, ()):
            if values != values_of(template.fields["value_leaves"]):
                continue
            gm = template.instantiate(model)
            if gm is None:
                break
            self._by_key.move_to_end(key)
            return gm, dict(template.fields)
        return None

    def _read_store(self, key: Hashable) -> bool:
        """Adds the store's templates of ``key`` to memory; True if it had any."""
        name = shared_name(key)
        entries = self.shared.read(name) if name is not None else []
        templates = []
        for values, state in entries:
            try:
                templates.append((values, _Template.from_state(state)))
            except Exception:  # noqa: BLE001 - an operator or class this process lacks: capture afresh
                continue
        for values, template in templates:
            self._remember(key, values, template)
        return bool(templates)

    def store(self, model: torch.nn.Module, key: Hashable, values: Hashable, gm: fx.GraphModule,
              fields: Dict[str, Any]) -> None:
        if any(n.op == "call_module" or _calls_a_module(n) for n in gm.graph.nodes) or any(
                next(m.parameters(), None) is not None or next(m.buffers(), None) is not None
                for n in gm.graph.nodes if n.op == "get_attr"
                for m in [_attr_at(gm, n.target)] if isinstance(m, torch.nn.Module)):
            return  # called submodules, or subgraphs holding tensors: not templated
        template = _Template(gm, model, fields)
        self._remember(key, values, template)
        name = shared_name(key) if self.shared is not None else None
        if name is not None:  # under exclusive(): the file's other entries (other mask values) are kept
            try:
                state = template.state()
            except Unshareable:
                return
            entries = [(v, st) for v, st in self.shared.read(name) if v != values]
            self.shared.write(name, entries + [(values, state)])

    def _remember(self, key: Hashable, values: Hashable, template: _Template) -> None:
        entries = self._by_key.setdefault(key, [])
        entries[:] = [(v, t) for v, t in entries if v != values] + [(values, template)]
        self._by_key.move_to_end(key)
        while len(self._by_key) > self.maxsize:
            self._by_key.popitem(last=False)

    def clear(self) -> None:
        self._by_key.clear()


_DEFAULT: Dict[Optional[str], TraceTemplates] = {}  # by store directory


def default_templates() -> Optional[TraceTemplates]:
    """The process's templates when ``DIT_PASSES_REUSE_TRACES=1`` (the test suite sets it), else None; shared with
    other processes through ``DIT_PASSES_TRACE_DIR`` when that is set too (``.ci/test.sh`` sets it for its run)."""
    if not env.reuse_traces():
        return None
    directory = env.trace_dir()
    templates = _DEFAULT.get(directory)
    if templates is None:
        templates = _DEFAULT[directory] = TraceTemplates(shared=TraceStore(directory) if directory else None)
    return templates


__all__ = ["ENV_FLAG", "TraceTemplates", "default_templates", "module_fingerprint"]
