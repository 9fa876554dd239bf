"""The parity table: cache-dit 1.5.3's public API and diffusers' cache configs, name by name, against dit_passes.

    python -P bench/parity.py                 # the table from the tests' claims (no test run)
    python -P bench/parity.py --run           # also runs every claiming test: a row works only if its tests pass
    python -P bench/parity.py --run --out bench/results

Rows come from the reference packages by introspection, never from a list typed here: cache-dit's public names
(its submodules left out: they are its implementation's namespaces, not API), every public field of its config
classes, and every field of diffusers' cache configs (``diffusers.hooks.*CacheConfig`` and
``PyramidAttentionBroadcastConfig``). A row's status comes from the tests that claim it, with a marker beside the
test that shows it::

    @pytest.mark.parity("DBCacheConfig.Fn_compute_blocks", "enable_cache")            # works: output as the reference's
    @pytest.mark.parity("ParallelismConfig.cp_plan", status="refused")                 # the test asserts the refusal
    @pytest.mark.parity("ParallelismConfig.attention_backend", status="partial")       # works in part: the test says which

A row no test claims is ``missing`` where dit_passes has no such name, ``unverified`` where it has one that no test
claims; with ``--run`` a row whose claiming test fails or skips is ``failing``. ``tests/test_parity.py`` fails on
an unverified row and on a claim that names no row. Writes ``parity.json`` (``summary`` = {total, works, partial,
refused, ignored, missing, unverified, failing}, ``rows`` = [{name, status, test}]) and ``parity.md``.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import inspect
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATUSES = ("works", "partial", "refused", "ignored")  # what a claim may say; the rest are derived
DIFFUSERS_PREFIX = "diffusers."


# ------------------------------------------------------------------------------------------------ rows
def _public_fields(cls: type, inherited: Tuple[str, ...] = ()) -> List[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name not in inherited]


def reference_rows() -> List[str]:
    """Every name of the table, in the reference's order: cache-dit's public names, the fields of its config
    classes (a subclass lists the fields it adds), diffusers' cache-config fields."""
    import cache_dit
    import diffusers.hooks

    rows: List[str] = []
    configs = []
    for name in sorted(n for n in dir(cache_dit) if not n.startswith("_")):
        obj = getattr(cache_dit, name)
        if inspect.ismodule(obj):
            continue
        rows.append(name)
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and name.endswith("Config"):
            configs.append((name, obj))
    listed = {cls for _, cls in configs}
    for name, cls in configs:
        # a class lists the fields its listed bases do not have; BasicCacheConfig's own are listed under
        # DBCacheConfig, its named alias and the class users construct
        if name == "BasicCacheConfig":
            continue
        bases = [b for b in cls.__mro__[1:] if b in listed and not (name == "DBCacheConfig"
                                                                      and b.__name__ == "BasicCacheConfig")]
        inherited = tuple(f for b in bases for f in _public_fields(b))
        rows += [f"{name}.{f}" for f in _public_fields(cls, inherited)]
    for name in sorted(dir(diffusers.hooks)):
        cls = getattr(diffusers.hooks, name)
        if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and (
                name.endswith("CacheConfig") or name.endswith("BroadcastConfig")):
            rows.append(f"{DIFFUSERS_PREFIX}{name}")
            rows += [f"{DIFFUSERS_PREFIX}{name}.{f}" for f in _public_fields(cls)]
    return rows


def exists_here(row: str) -> bool:
    """Whether dit_passes has the name (a diffusers config: our class of that name, or its pass's acceptance)."""
    import dit_passes

    name = row[len(DIFFUSERS_PREFIX):] if row.startswith(DIFFUSERS_PREFIX) else row
    head, _, field = name.partition(".")
    obj = getattr(dit_passes, head, None)
    if obj is None:
        return False
    if not field:
        return True
    return dataclasses.is_dataclass(obj) and field in {f.name for f in dataclasses.fields(obj)}


# ------------------------------------------------------------------------------------------------ claims
@dataclasses.dataclass
class Claim:
    row: str
    status: str
    test: str  # node id without parameters: tests/test_x.py::test_y


def _literal(node: ast.AST):
    return ast.literal_eval(node)


def _parity_marks(decorators) -> List[Tuple[List[str], str]]:
    out = []
    for d in decorators:
        if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parity"):
            continue
        names = [_literal(a) for a in d.args]
        status = next((_literal(k.value) for k in d.keywords if k.arg == "status"), "works")
        out.append((names, status))
    return out


def claims(tests_dir: pathlib.Path = ROOT / "tests") -> List[Claim]:
    """The ``@pytest.mark.parity(...)`` markers of the test files, read from their source (nothing imported)."""
    found: List[Claim] = []
    for path in sorted(tests_dir.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            funcs = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            prefix = ""
            if isinstance(node, ast.ClassDef):
                prefix = node.name + "::"
                funcs = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for fn in funcs:
                for names, status in _parity_marks(fn.decorator_list):
                    if status not in STATUSES:
                        raise ValueError(f"{path.name}::{fn.name}: parity status {status!r}; use one of {STATUSES}")
                    test = f"tests/{path.name}::{prefix}{fn.name}"
                    found += [Claim(n, status, test) for n in names]
    return found


# ------------------------------------------------------------------------------------------------ running
def run_tests(tests: List[str], timeout: float) -> Dict[str, str]:
    """``{test: "passed" | "failed" | "skipped"}`` from one pytest run of ``tests`` (parameters folded: a test
    passes only if every parameter does)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
        subprocess.run(cmd, cwd=ROOT, timeout=timeout, check=False)
        outcome: Dict[str, str] = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            cls_name = ""
            if not pathlib.Path(ROOT, path + ".py").exists():  # a test class: the last part is the class
                path, _, cls_name = path.rpartition("/")
            test = f"{path}.py::" + (cls_name + "::" if cls_name else "") + case.get("name", "").split("[")[0]
            if case.find("failure") is not None or case.find("error") is not None:
                state = "failed"
            elif case.find("skipped") is not None:
                state = "skipped"
            else:
                state = "passed"
            rank = {"failed": 2, "skipped": 1, "passed": 0}
            if rank[state] >= rank.get(outcome.get(test, "passed"), 0):
                outcome[test] = state
        return outcome


# ------------------------------------------------------------------------------------------------ table
def table(outcomes: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    rows = reference_rows()
    by_row: Dict[str, List[Claim]] = {}
    for c in claims():
        by_row.setdefault(c.row, []).append(c)
    out = []
    for row in rows:
        mine = by_row.get(row, [])
        tests = sorted({c.test for c in mine})
        if not mine:
            status = "unverified" if exists_here(row) else "missing"
        else:
            # a row claimed both ways (works for some values, refused for others) is partial
            kinds = {c.status for c in mine}
            status = kinds.pop() if len(kinds) == 1 else "partial"
            if outcomes is not None and any(outcomes.get(t) != "passed" for t in tests):
                status = "failing"
        out.append({"name": row, "status": status, "test": tests})
    summary = {k: sum(r["status"] == k for r in out)
               for k in ("works", "partial", "refused", "ignored", "missing", "unverified", "failing")}
    summary["total"] = len(out)
    return {"summary": summary, "rows": out, "unknown_claims": sorted(set(by_row) - set(rows))}


def _versions() -> Dict[str, str]:
    import cache_dit
    import diffusers
    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cache_dit": getattr(cache_dit, "__version__", "?"), "diffusers": diffusers.__version__,
            "torch": torch.__version__, "commit": commit}


def markdown(result: Dict[str, object]) -> str:
    s = result["summary"]
    lines = ["# Parity with cache-dit and diffusers' cache configs", "",
             f"`{result['command']}` at commit {result['versions']['commit']} (cache-dit "
             f"{result['versions']['cache_dit']}, diffusers {result['versions']['diffusers']}, torch "
             f"{result['versions']['torch']}; {'claiming tests run' if result['ran'] else 'claims only, tests not run'}).",
             "", "| total | works | partial | refused | ignored | missing | unverified | failing |",
             "|---|---|---|---|---|---|---|---|",
             f"| {s['total']} | {s['works']} | {s['partial']} | {s['refused']} | {s['ignored']} | {s['missing']} | "
             f"{s['unverified']} | {s['failing']} |", "", "| name | status | test |", "|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| `{r['name']}` | {r['status']} | {'<br>'.join(f'`{t}`' for t in r['test'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="store_true", help="run every claiming test; a row works only if they pass")
    ap.add_argument("--out", default=None, help="directory for parity.json / parity.md")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole test run")
    args = ap.parse_args(argv)
    outcomes = None
    if args.run:
        outcomes = run_tests(sorted({c.test for c in claims()}), args.timeout)
    result = table(outcomes)
    result["ran"] = bool(args.run)
    result["command"] = "python -P bench/parity.py" + (" --run" if args.run else "")
    result["versions"] = _versions()
    result["date"] = datetime.date.today().isoformat()
    print(json.dumps(result["summary"]))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "parity.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "parity.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
