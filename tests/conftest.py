"""Test-session wiring: how tests share the 2-core CI machine.

Each test is marked here as it is collected: ``ranks`` (it runs gloo ranks: ``run_ranks(`` in its code or in one of
its fixtures') or ``ray`` (it starts a local Ray cluster). ``.ci/test.sh`` runs three pytest processes at once, ranked by CPU priority: ``-m ray`` at the normal priority
(its workers too: ``RAY_worker_niceness=0``), ``-m "ranks and not ray"`` in one process niced by 5, and
``-m "not ranks and not ray"`` on two xdist workers niced by 15, which take the cycles the other two leave. Two rank
tests at once would put 4-8 busy processes on 2 cores and run into their rank timeouts; a raylet must register within
Ray's fixed 30 s, which it missed on 2 busy cores at equal priority. (pytest-xdist's ``loadgroup`` did not keep a
group marked here on one worker: two rank tests ran at once, and each worker computed the rank fixtures again.)

Fixtures that run ranks are session-scoped: one computation serves every test of the rank process.

Captures are reused across instances of one architecture and call (``DIT_PASSES_REUSE_TRACES=1``,
``dit_passes.infra.trace_templates.py``): the suite builds the same tiny models hundreds of times, and torch.export took
about half of its CPU time. ``tests/test_trace_templates.py`` checks that a reused graph is the fresh one.
``.ci/test.sh`` also shares them between its processes (xdist workers, pooled ranks, Ray) through
``DIT_PASSES_TRACE_DIR`` (``dit_passes/infra/trace_store.py``): each rank of a 2- or 4-rank case captured the same
model again.
"""
from __future__ import annotations

import ast
import inspect
import os
import pathlib
import textwrap

import pytest

os.environ.setdefault("DIT_PASSES_REUSE_TRACES", "1")  # set before any test imports dit_passes; ranks inherit it

_RAY_WORDS = ("ray_cluster", "RayLauncher", "use_ray=True", "import ray")
_RANK_WORDS = ("run_ranks(",)


def _body(fn) -> str:
    """The code of ``fn`` without its docstring (a docstring naming Ray does not start it)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))) if fn is not None else None
    except (OSError, TypeError, SyntaxError):
        return ""
    if tree is None:
        return ""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _kind_of(item: pytest.Item) -> str:
    """"ray" (starts a local Ray cluster), "ranks" (runs gloo ranks: in its body or one of its fixtures'),
    or ""."""
    if item.get_closest_marker("ray") is not None:
        return "ray"
    body = _body(getattr(item, "function", None))
    if any(w in body for w in _RAY_WORDS) or pathlib.Path(item.fspath).name.startswith("test_ray"):
        return "ray"
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
    if item.get_closest_marker("multiproc") is not None or any(
            w in b for b in [body, *map(_body, fixtures)] for w in _RANK_WORDS):
        return "ranks"
    return ""


def pytest_itemcollected(item):
    # marked as each test is collected: before `-m` selects (a collection_modifyitems hook)
    kind = _kind_of(item)
    if kind:
        item.add_marker(getattr(pytest.mark, kind))


def pytest_collection_modifyitems(session, config, items):
    # Tests marked `ends_rank_pools` make a rank fail on purpose, which ends every pooled rank (the harness's
    # guarantee: no process left once the error reaches the test). They run last, so the rank tests before them
    # keep one pool per world size (and its captured graphs) instead of starting new ranks halfway through.
    items.sort(key=lambda item: item.get_closest_marker("ends_rank_pools") is not None)


# DIT_PASSES_CPU_REPORT=<dir>: each test's CPU seconds, written per pytest process to <dir>/cpu-<pid>.tsv (CPU s, wall
# s, test id): what a test costs on a busy machine, where wall time says little. Counted: this process, its live
# descendants (pooled ranks, read from /proc) and the reaped ones (RUSAGE_CHILDREN: subprocess.run, ended pools).
# A process moves from the first to the second when it is reaped, so nothing is counted twice (the ranks' own
# per-call reports were, once a test ended the pools: their whole lifetime landed on that test). A pooled rank's
# start-up is charged to the first test that uses its pool. Not for Ray tests: Ray's workers leave this process's tree
# (reparented when their raylet ends them), so their CPU is lost and a Ray test can even read negative.
_CPU_DIR = os.environ.get("DIT_PASSES_CPU_REPORT")


if _CPU_DIR:
    import resource
    import time

    _TICK = os.sysconf("SC_CLK_TCK")

    def _live_descendants_cpu() -> float:
        parent, cpu = {}, {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # after "(comm)": state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based from state
            parent[int(pid)] = int(fields[1])
            cpu[int(pid)] = sum(int(x) for x in fields[11:15]) / _TICK
        mine, frontier = set(), {os.getpid()}
        while frontier:
            frontier = {p for p, pp in parent.items() if pp in frontier} - mine
            mine |= frontier
        return sum(cpu[p] for p in mine)

    def _cpu_now():
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + child.ru_utime + child.ru_stime + _live_descendants_cpu()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, wall = _cpu_now(), time.perf_counter()
        yield
        os.makedirs(_CPU_DIR, exist_ok=True)
        with open(os.path.join(_CPU_DIR, f"cpu-{os.getpid()}.tsv"), "a") as f:
            f.write(f"{_cpu_now() - start:.1f}\t{time.perf_counter() - wall:.1f}\t{item.nodeid}\n")
