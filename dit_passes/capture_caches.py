"""State that a trace leaves in the model: function caches emptied, fake attributes dropped after each export
(DESIGN.md section 1).

A model may memoise a helper with ``functools.lru_cache`` / ``functools.cache`` (a RoPE table keyed on the image
grid, on a method: the cache lives on the class, keyed by ``self``). ``torch.export`` runs the forward on fake
tensors, so a call that misses the cache while tracing stores a *FakeTensor* there, and every later call with the
same arguments gets it back: the next eager run fails ("Tensor must have a last dimension of size 2" from a fake
complex table) or the next trace bakes a tensor of a dead fake mode. torch.export restores neither these caches,
which sit outside the modules, nor an attribute a lazy forward adds (``if not hasattr(self, "_table"):
self._table = ...``) or sets (``self.freqs_cis = None`` in ``__init__``, a list of tables after the first call:
Bria-FIBO 2's ``RopeEmbedder``, a plain object a module holds): capture deletes such an added attribute, or puts
back the value a declared one had, when it holds a FakeTensor (the next call initialises it again, as a fresh
module's first call would). Buffers, parameters and submodules fare the same (a forward that registers a table built
at the input's size over its sample-size buffer left a FakeTensor there, and the eager model then computed on it).

Capture cannot remove one entry of an ``lru_cache`` (no API for it), so a cache that missed during an export
is emptied whole (``cache_clear``). That is safe: a cache is transparent by contract (the function's value is
what the entry held), so the only cost is recomputing the entries of other instances once. A cache that only
hit during the export is left alone: its entries came from eager runs, and the graph bakes the cached tensor
as a constant exactly as eager would reuse it (the arguments are the capture's constants: shapes, ``img_shapes``).

Without this, a model whose first export fails (data-dependent sizes) could not be retried by the eager run
that records its scalars (:mod:`dit_passes.capture_values`): the poisoned cache made that run fail, and the model
captured only after the user had run it eagerly once.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import types
from typing import Any, Dict, Iterator, List

import torch
import torch.utils._pytree as pytree

_CACHE_TYPE = type(functools.lru_cache(maxsize=None)(len))  # functools.cache / lru_cache wrappers
# attribute values that are not an object's own state (classes, functions, modules of code, tensors, submodules)
_NOT_STATE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType,
              functools.partial, torch.Tensor, torch.nn.Module)


def _caches_in(value: Any, found: Dict[int, Any]) -> None:
    """The lru caches ``value`` is, wraps (``staticmethod`` / ``functools.wraps`` chains) or closes over."""
    for _ in range(8):  # a wrapper chain is short; a cycle (``__wrapped__`` to itself) must not hang
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        if isinstance(value, _CACHE_TYPE):
            found[id(value)] = value
            return
        if not isinstance(value, types.FunctionType):
            return
        for cell in value.__closure__ or ():  # a wrapper that picks the cache at call time closes over it
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(inner, _CACHE_TYPE):
                found[id(inner)] = inner
        value = getattr(value, "__wrapped__", None)


def function_caches(model: torch.nn.Module) -> List[Any]:
    """The lru caches a forward of ``model`` can reach by name: in its modules' instance attributes, their classes
    (and bases) and the globals of the Python modules defining them. torch's own classes are skipped (their
    modules hold no caches of the model's values), which also keeps the scan short."""
    found: Dict[int, Any] = {}
    seen_classes, seen_modules = set(), set()
    for module in model.modules():
        for value in vars(module).values():
            _caches_in(value, found)
        for cls in type(module).__mro__:
            if cls in seen_classes or cls.__module__.split(".")[0] in ("torch", "builtins"):
                continue
            seen_classes.add(cls)
            for value in vars(cls).values():
                _caches_in(value, found)
            py_module = sys.modules.get(cls.__module__)
            if py_module is not None and py_module.__name__ not in seen_modules:
                seen_modules.add(py_module.__name__)
                for value in list(vars(py_module).values()):
                    _caches_in(value, found)
    return list(found.values())


def _holds_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(value, torch.nn.Module):  # a submodule a forward builds lazily: its weights
        return any(isinstance(t, FakeTensor) for t in itertools.chain(value.parameters(), value.buffers()))
    return any(isinstance(leaf, FakeTensor) for leaf in pytree.tree_leaves(value))


@contextlib.contextmanager
def trace_time_caches_dropped(model: torch.nn.Module) -> Iterator[None]:
    """Around a trace of ``model``: on exit (success or failure), empty the caches that missed during it and
    delete the module attributes it added that hold fake tensors (or put back their values before it)."""
    caches = function_caches(model)
    misses = [c.cache_info().misses for c in caches]
    tables = [(table, dict(table)) for table in _attribute_tables(model)]  # shallow: the values before
    try:
        yield
    finally:
        for cache, before in zip(caches, misses):
            if cache.cache_info().misses != before:
                cache.cache_clear()
        for table, before in tables:
            for name, value in list(table.items()):
                if not _holds_fake(value) or (name in before and before[name] is value):
                    continue
                if name not in before:
                    del table[name]
                elif not _holds_fake(before[name]):  # declared, then set while traced (``self.freqs_cis = None``,
                    table[name] = before[name]  # a list of fake tables after): its value before


def _attribute_tables(model: torch.nn.Module) -> List[Dict[str, Any]]:
    """Where a forward can store a value by name: each state holder's ``__dict__`` and, for a module, the
    registries ``__setattr__`` and ``register_buffer`` write into instead (a forward that builds its positional
    table at the input's size and registers it as a buffer over the sample-size one)."""
    tables = []
    for holder in _state_holders(model):
        tables.append(vars(holder))
        if isinstance(holder, torch.nn.Module):
            tables += [holder._buffers, holder._parameters, holder._modules]
    return tables


def _state_holders(model: torch.nn.Module) -> List[Any]:
    """The modules, and the plain Python objects they hold as attributes (Bria-FIBO 2 / Z-Image keep their RoPE
    tables on a ``RopeEmbedder`` that is not an ``nn.Module``)."""
    found: Dict[int, Any] = {}
    for module in model.modules():
        found[id(module)] = module
        for value in vars(module).values():
            if hasattr(value, "__dict__") and not isinstance(value, _NOT_STATE):
                found.setdefault(id(value), value)
    return list(found.values())
