"""Test-session wiring: how tests share the 2-core CI machine when pytest-xdist runs them on 2 workers.

``.ci/test.sh`` runs ``pytest -n 2 --dist loadgroup``. Tests that start their own processes are grouped so
that each group runs on one worker, one test at a time: all Ray tests (one local Ray cluster at a time;
two would compete for the same 2 CPUs and ports) and all multi-rank gloo tests (2-4 rank processes each,
whose rank timeout assumes they are not sharing the machine with another such test). The other worker
keeps running single-process tests meanwhile.
"""
from __future__ import annotations

import pathlib

import pytest

_RAY_WORDS = ("ray_cluster", "RayLauncher", "use_ray=True", "import ray")
_RANK_WORDS = ("run_ranks(",)
_sources: dict = {}


def _source(path: pathlib.Path) -> str:
    if path not in _sources:
        _sources[path] = path.read_text()
    return _sources[path]


def _group_of(item: pytest.Item) -> str:
    if item.get_closest_marker("ray") is not None:
        return "ray"
    src = _source(pathlib.Path(item.fspath))
    fn_src = getattr(item, "function", None)
    try:
        import inspect
        body = inspect.getsource(fn_src) if fn_src is not None else ""
    except (OSError, TypeError):
        body = ""
    if any(w in body for w in _RAY_WORDS) or pathlib.Path(item.fspath).name.startswith("test_ray"):
        return "ray"
    if item.get_closest_marker("multiproc") is not None or any(w in src for w in _RANK_WORDS):
        return "ranks"
    return ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _group_of(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
