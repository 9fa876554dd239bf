"""Test-session wiring: how tests share the 2-core CI machine when pytest-xdist runs them on 2 workers.

``.ci/test.sh`` runs ``pytest -n 2 --dist loadgroup``. Every test that starts its own processes (a local Ray
cluster, 2-4 gloo ranks) is in ONE group, so such tests run one at a time on one worker: two of them at once
would put 4-8 busy processes on 2 cores and run into their rank timeouts. The other worker keeps running
single-process tests meanwhile.
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
        return "procs"
    src = _source(pathlib.Path(item.fspath))
    fn_src = getattr(item, "function", None)
    try:
        import inspect
        body = inspect.getsource(fn_src) if fn_src is not None else ""
    except (OSError, TypeError):
        body = ""
    if any(w in body for w in _RAY_WORDS) or pathlib.Path(item.fspath).name.startswith("test_ray"):
        return "procs"
    if item.get_closest_marker("multiproc") is not None or any(w in src for w in _RANK_WORDS):
        return "procs"
    return ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _group_of(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
