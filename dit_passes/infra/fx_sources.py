"""The generated source FX keeps for every ``GraphModule.recompile()``: dropped for graphs that are gone.

Why: FX executes a graph module's generated ``forward`` from a string and keeps that string, for tracebacks and
``inspect``, in a process-wide table (``torch.fx.graph_module._loader.eval_cache``, one entry per recompile, and a
lazy ``linecache`` entry for it) that nothing ever empties. A lowering recompiles its graph after every pass, and
the capture builds graph modules of its own, so each lowering left ~0.65 MB of source behind for the 12-block
digits DiT (more for bigger models), whether or not the graph is kept: a served module lowering again (a new
cache config, a LoRA swap, an evicted resolution coming back) grew without bound (``bench/soak.py`` measured it).

Contract: :func:`source_keys` before a lowering, then :func:`drop_sources_since` with the modules kept drops
every entry added meanwhile that none of their graph modules' ``forward`` runs (the superseded recompiles, the
capture's intermediate modules); :func:`drop_module_sources` drops a graph's own entries when it is evicted or
forgotten. Only source text goes: code already compiled runs on (a traceback through it shows no source line).
Where this torch has no such table, all three do nothing.
"""
from __future__ import annotations

import linecache
from typing import Iterable, Optional, Set

import torch


def _table() -> Optional[dict]:
    # torch keeps the table on a module-level loader object with no public accessor; absent: nothing to drop
    loader = getattr(torch.fx.graph_module, "_loader", None)
    table = getattr(loader, "eval_cache", None)
    return table if isinstance(table, dict) else None


def _keys_of(modules: Iterable[torch.nn.Module]) -> Set[str]:
    """The table keys of the generated ``forward`` of every graph module in ``modules`` (and their submodules):
    each recompile compiles its source under its key as the file name."""
    out: Set[str] = set()
    for root in modules:
        for m in root.modules():
            if isinstance(m, torch.fx.GraphModule):
                code = getattr(type(m).__dict__.get("forward"), "__code__", None)
                if code is not None:
                    out.add(code.co_filename)
    return out


def _drop(table: dict, keys: Iterable[str]) -> int:
    n = 0
    for key in keys:
        if table.pop(key, None) is not None:
            n += 1
        linecache.cache.pop(key, None)
    return n


def source_keys() -> Set[str]:
    """The keys in the table now (before a lowering)."""
    table = _table()
    return set(table) if table is not None else set()


def drop_sources_since(before: Set[str], keep: Iterable[torch.nn.Module]) -> int:
    """Drop the entries added since ``before`` that no graph module of ``keep`` runs; returns how many."""
    table = _table()
    if table is None:
        return 0
    live = _keys_of(keep)
    return _drop(table, [k for k in list(table) if k not in before and k not in live])


def drop_module_sources(modules: Iterable[torch.nn.Module]) -> int:
    """Drop the entries of the graph modules in ``modules`` (a graph evicted or forgotten); returns how many."""
    table = _table()
    return 0 if table is None else _drop(table, _keys_of(modules))


__all__ = ["source_keys", "drop_sources_since", "drop_module_sources"]
