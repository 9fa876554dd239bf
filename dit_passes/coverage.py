"""``dit-passes coverage``: every DiT class of diffusers x every pass, on tiny CPU fp32 models.

    dit-passes coverage --out out/coverage                    # the whole matrix (parallel on 2 gloo ranks)
    dit-passes coverage --families flux,wan --no-parallel     # a reduced form
    dit-passes coverage --columns capture,dbcache
    dit-passes coverage --variants only                       # only the real-checkpoint variants (flux[schnell])
    dit-passes coverage --columns capture --inputs alt_resolution   # every family at its second size
    dit-passes coverage --families wan --update out/coverage/coverage.json --out out/coverage   # re-run cells
    dit-passes coverage --columns fuse,fp8 --no-parallel --update out/coverage/coverage.json --out out/coverage
                                                              # ... or add a column to an earlier matrix

Rows come from ``dit_passes.models.diffusers_zoo.coverage_rows()`` (the transformer classes diffusers
exports: a class without a zoo config shows as "no config"); columns are :data:`COLUMNS`. Each cell is exact,
refused or error, run by :mod:`dit_passes.coverage_cells` (what each column runs, what each status means, how
the cells run on gloo ranks). This module builds the matrix from the cells, merges an earlier one
(``--update``), renders it and is the command line. Writes ``coverage.md`` / ``coverage.json`` to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import coverage_cells as _cells
from .coverage_cells import (CACHE_COLUMNS, COLUMNS, ERROR, EXACT, FP8_BOUND, FP8_RATIO, LOCAL_COLUMNS, NO_CONFIG,
                             NOTHING, PARALLEL_COLUMNS, QUANT_COLUMNS, REFUSED, STATUSES, SVDQUANT_BOUND, TOLERANCE,
                             WORLD, Cell, _quiet, run_cell, run_local, run_parallel)

# Re-exported: tests/test_coverage.py and tests/test_zoo_variants.py read these from dit_passes.coverage.
CellTimeout, parallel_worker = _cells.CellTimeout, _cells.parallel_worker
_compile, _leaves, _local_checks, _max_rel, _within = (_cells._compile, _cells._leaves, _cells._local_checks,
                                                       _cells._max_rel, _cells._within)


# ---------------------------------------------------------------------------------------- the matrix
def select_rows(names: Optional[Sequence[str]], variants: str = "all"):
    """Coverage rows (not excluded), filtered by family or class names (a class name keeps all its families, a
    family name only that family: ``flux`` is not ``flux[schnell]``); unknown names raise ValueError.
    ``variants``: "all" keeps the real-checkpoint variants (``family[tag]``, ``models/zoo_variants.py``),
    "none" drops them, "only" keeps only them (a class without one is left out)."""
    from .models.diffusers_zoo import coverage_rows
    if variants not in ("all", "none", "only"):
        raise ValueError(f"variants must be 'all', 'none' or 'only', got {variants!r}")
    rows = [r for r in coverage_rows() if r.excluded is None]
    if names:
        wanted = set(names)
        known = {r.class_name for r in rows} | {f for r in rows for f in r.families}
        unknown = sorted(wanted - known)
        if unknown:
            raise ValueError(f"unknown families / classes {unknown}; known families: "
                             f"{', '.join(sorted(f for r in rows for f in r.families))}")
        rows = [r if r.class_name in wanted else dataclasses.replace(r, families=tuple(
            f for f in r.families if f in wanted)) for r in rows if r.class_name in wanted or wanted & set(r.families)]
    if variants == "all":
        return rows
    keep = (lambda f: "[" not in f) if variants == "none" else (lambda f: "[" in f)
    out = [dataclasses.replace(r, families=tuple(f for f in r.families if keep(f))) for r in rows]
    # "only": a class with no variant has no row ("none" keeps the rows of classes without a config)
    return [r for r in out if r.families or variants == "none"]


def build_matrix(rows, columns: Sequence[str], parallel: bool = True, timeout: float = 120.0, batch: int = 1,
                 progress: Optional[Callable[[str], None]] = None, inputs: str = "default") -> dict:
    """The matrix of ``rows`` x ``columns``; ``inputs``: the zoo input set every cell calls with (``"default"``, or
    ``"alt_resolution"``: each family at its second size, where classes with a sample size rebuild their positional
    tables in forward)."""
    import diffusers

    from .models.zoo import ALL_FAMILIES
    local_cols = [c for c in columns if c in LOCAL_COLUMNS]
    par_cols = [c for c in columns if c in PARALLEL_COLUMNS] if parallel else []
    families = [f for r in rows for f in r.families]
    start = time.perf_counter()
    cells = run_local(families, local_cols, timeout, batch, progress, inputs=inputs)
    if par_cols and families:
        if progress:
            progress(f"parallel columns {par_cols} on {WORLD} gloo ranks, {len(families)} families ...")
        for family, row in run_parallel(families, par_cols, timeout, batch, inputs=inputs).items():
            cells[family].update(row)
    matrix = []
    for r in rows:
        for family in r.families or (None,):
            if family is None:
                row_cells = {c: Cell(NO_CONFIG) for c in columns if c in local_cols or c in par_cols}
            else:
                row_cells = {c: cells[family][c] for c in columns if c in cells[family]}
            matrix.append({"class": r.class_name, "family": family,
                           "cells": {c: dataclasses.asdict(x) for c, x in row_cells.items()}})
    shown = local_cols + par_cols
    from .models.diffusers_zoo import EXCLUDED, transformer_classes
    return {
        "commit": source_commit(), "command": "",
        "diffusers": diffusers.__version__, "torch": torch.__version__, "world": WORLD if par_cols else 1,
        "batch": batch, "inputs": inputs, "tolerance": TOLERANCE, "svdquant_bound": SVDQUANT_BOUND,
        "fp8_ratio": FP8_RATIO, "fp8_bound": FP8_BOUND, "columns": shown,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": matrix,
        "summary": summarize(matrix, shown),
        "excluded": {name: EXCLUDED[name] for name in transformer_classes() if name in EXCLUDED},
        "zoo_families": list(ALL_FAMILIES),
    }


def source_commit() -> str:
    """The git commit of the dit_passes source this process imports (``+dirty`` where its tree has uncommitted
    changes), or ``"unknown"`` outside a git checkout: a matrix says which code made it."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "") if sha else "unknown"


_BOUNDS = {"svdquant": ("svdquant_bound",), "fp8": ("fp8_ratio", "fp8_bound")}  # a column's settings


def merge_rows(base: dict, update: dict) -> dict:
    """``base`` (an earlier matrix) with ``update``'s cells in place of the same (class, family, column) cells:
    re-running a few families or columns after a fix keeps the rest of a 35-minute matrix. A column ``base``
    lacks is added (after ``base``'s; each row has the cells the update ran, the others none). The settings the
    update's cells depend on must be the same: batch, input set and tolerance; the rank count where both ran a parallel
    column, SVDQuant's / fp8's bounds where both ran that column (a base without it takes the update's). The
    result lists both commands, their seconds and the diffusers / torch versions each ran with ("2.11.0, then
    2.13.0")."""
    def parallel(m):
        return bool(set(m["columns"]) & set(PARALLEL_COLUMNS))
    keys = ["batch", "inputs", "tolerance"] + (["world"] if parallel(base) and parallel(update) else []) + \
        [k for c in _BOUNDS for k in _BOUNDS[c] if c in update["columns"] and c in base["columns"]]
    settings = [{"inputs": "default", **m} for m in (base, update)]  # a matrix from before --inputs: the default
    differ = [k for k in keys if settings[0].get(k) != settings[1].get(k)]
    if differ:
        raise ValueError(f"cannot merge coverage matrices with different {', '.join(differ)} "
                         f"({[settings[0].get(k) for k in differ]} vs {[settings[1].get(k) for k in differ]}): "
                         "re-run with the earlier run's settings, or without --update")
    columns = list(base["columns"]) + [c for c in update["columns"] if c not in base["columns"]]
    fresh = {(r["class"], r["family"]): r for r in update["rows"]}
    rows = []
    for r in base["rows"]:
        if r["family"] is None:  # "no config" before: the class's new rows, if it has any now
            rows += [fresh.pop(k) for k in list(fresh) if k[0] == r["class"]] or [r]
        elif (r["class"], r["family"]) in fresh:
            rows.append(dict(r, cells={**r["cells"], **fresh.pop((r["class"], r["family"]))["cells"]}))
        else:
            rows.append(r)
    merged = dict(base)
    merged["rows"] = rows + list(fresh.values())
    merged["columns"] = columns
    for c, keys in _BOUNDS.items():  # a column new to base: its bounds are the update's
        if c in update["columns"] and c not in base["columns"]:
            merged.update({k: update.get(k) for k in keys})
    merged["summary"] = summarize(merged["rows"], columns)
    merged["seconds"] = round(base["seconds"] + update["seconds"], 1)
    merged["commands"] = list(base.get("commands") or [base.get("command", "")]) + [update.get("command", "")]
    merged["command"] = merged["commands"][0]
    for k in ("commit", "diffusers", "torch"):  # the commit and versions each run's cells came from, in order
        seen = [v for v in str(base.get(k, "") or "unknown").split(", then ") if v]
        new = str(update.get(k, "") or "unknown")
        merged[k] = ", then ".join(seen + [new] * (new not in seen))
    if parallel(update):
        merged["world"] = update["world"]
    return merged


def summarize(matrix: List[dict], columns: Sequence[str]) -> Dict[str, Dict[str, int]]:
    out = {}
    for c in columns:
        counts = {status: 0 for status in STATUSES}
        for row in matrix:
            if c in row["cells"]:
                counts[row["cells"][c]["status"]] += 1
        out[c] = counts
    return out


# the count a cell of each column shows beside its status: (key of ``changed``, key of the total or None)
_HEADLINE = {"svdquant": ("replaced", "considered"), "fp8": ("replaced", "considered"), "fuse": ("fused_groups", None),
             "attention": ("attention_rewritten", None), "norm_rope": ("fused", None), "norm_modulate": ("fused", None),
             "regional": ("regions", None), "dbcache": ("blocks_in_branch", None),
             "taylorseer": ("blocks_in_branch", None), "ulysses": ("all_to_all", None), "usp": ("all_to_all", None),
             "ring": ("ring_exchange", None), "tp": ("all_reduce", None)}


def headline(column: str, cell: dict) -> str:
    """What the cell's pass changed, in a few characters: ``18/22`` linears quantized of those considered, ``3``
    sites fused or collectives inserted, ``blocks 1, cached 1`` for a cache; empty where the cell has no counts
    (an older matrix)."""
    changed = cell.get("changed") or {}
    if column in ("epilogues",) and changed:
        return f"{changed.get('split', 0)}+{changed.get('fused', 0)}"
    key, total = _HEADLINE.get(column, (None, None))
    if key is None or key not in changed:
        return ""
    text = f"{changed[key]}/{changed[total]}" if total and total in changed else str(changed[key])
    if cell.get("cached_steps") is not None:
        text = f"blocks {text}, cached {cell['cached_steps']}"
    return text


def _cell_md(cell: dict, ref: Optional[int], column: str = "") -> str:
    mark = {EXACT: "exact", NOTHING: "nothing to do", REFUSED: "refused", ERROR: "**error**",
            NO_CONFIG: "no config"}[cell["status"]]
    count = headline(column, cell) if cell["status"] == EXACT else ""
    mark = f"{mark} ({count})" if count else mark
    return mark if ref is None else f"{mark} [{ref}]"


def to_markdown(result: dict, command: str = "") -> str:
    cols = result["columns"]
    lines = [f"# DiT coverage: diffusers {result['diffusers']}, torch {result['torch']}, commit "
             f"{result.get('commit') or 'unknown'}", ""]
    commands = result.get("commands") or ([command] if command else [])
    if len(commands) > 1:
        lines += [f"Made by `{commands[0]}`, then the rows of " + ", ".join(f"`{c}`" for c in commands[1:]) +
                  f" put in place of the same cells ({result['seconds']} s in all).", ""]
    elif commands:
        lines += [f"Made by `{commands[0]}` ({result['seconds']} s).", ""]
    fp8 = (f"; fp8 e4m3 reference path: <= {result['fp8_ratio']:g} x the error of the same linears with e4m3 "
           f"weights alone, itself <= {result['fp8_bound']:g}" if "fp8" in cols else "")
    lines += [f"exact: fp32 max relative error <= {result['tolerance']:g} vs eager (DBCache / TaylorSeer: a "
              f"10-step loop whose latents move with the output caches several steps; its computed steps equal "
              f"eager, and every step equals cache-dit's own cache where cache-dit runs the class; SVDQuant W4A4 "
              f"reference path: finite and "
              f"<= {result['svdquant_bound']:g}{fp8}); parallel columns on {result['world']} gloo ranks, "
              f"batch {result['batch']}, the zoo's `{result.get('inputs', 'default')}` inputs; the quantization "
              "columns at widths where their groups fit (more heads of the same width). In parentheses what the pass changed, its own counts: linears quantized / "
              "considered, sites fused, blocks in the cache's branch and calls cached, regions compiled "
              "(epilogues: split+gelu), collectives inserted (ulysses / usp: all_to_all, ring: ring exchanges, "
              "tp: all_reduce). "
              "nothing to do: the pass changed nothing (its reason below); refused: the library refused before "
              "running; error: a defect (a quantization that quantized nothing, a cache that cached nothing).", "",
              "| column | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for status in STATUSES:
        lines.append(f"| {status} | " + " | ".join(str(result["summary"][c].get(status, 0)) for c in cols) + " |")
    lines += ["", "| class | family | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    notes: List[str] = []
    for row in result["rows"]:
        texts = []
        for c in cols:
            cell = row["cells"].get(c)
            if cell is None:
                texts.append("")
                continue
            ref = None
            if cell["status"] in (NOTHING, REFUSED, ERROR):
                notes.append(f"{row['family']} / {c}: {cell['status']}: {cell['detail']}")
                ref = len(notes)
            texts.append(_cell_md(cell, ref, c))
        lines.append(f"| {row['class']} | {row['family'] or '-'} | " + " | ".join(texts) + " |")
    if notes:
        lines += ["", "## Reasons", ""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    lines += ["", "## Excluded classes (not diffusion transformers over latent tokens)", "",
              "| class | why |", "|---|---|"]
    lines += [f"| {name} | {why} |" for name, why in result["excluded"].items()]
    return "\n".join(lines) + "\n"


def to_text(result: dict) -> str:
    cols = result["columns"]
    short = {EXACT: "exact", NOTHING: "nothing", REFUSED: "refused", ERROR: "ERROR", NO_CONFIG: "-"}
    width = max([len("family")] + [len(r["family"] or r["class"]) for r in result["rows"]])
    lines = [f"{'family':<{width}}  " + "  ".join(f"{c:<10}" for c in cols)]
    for row in result["rows"]:
        name = row["family"] or f"{row['class']} (no config)"
        lines.append(f"{name:<{width}}  " + "  ".join(
            f"{short[row['cells'][c]['status']] if c in row['cells'] else '':<10}" for c in cols))
    lines.append("")
    for c in cols:
        s = result["summary"][c]
        lines.append(f"{c:<11} exact {s[EXACT]:3d}  nothing to do {s.get(NOTHING, 0):3d}  refused {s[REFUSED]:3d}  "
                     f"error {s[ERROR]:3d}  no config {s[NO_CONFIG]:3d}")
    return "\n".join(lines)


def cli_selection(prog: str, families: str, columns: str, variants: str):
    """The rows and columns the comma lists of a command line name, or None after printing to stderr what is wrong
    (an unknown column, family or class)."""
    cols = [c.strip() for c in columns.split(",") if c.strip()]
    unknown = [c for c in cols if c not in COLUMNS]
    if unknown:
        print(f"{prog}: unknown column(s) {unknown}; columns: {', '.join(COLUMNS)}", file=sys.stderr)
        return None
    try:
        return select_rows([f.strip() for f in families.split(",") if f.strip()], variants), cols
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dit-passes coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="", help="comma-separated zoo families or diffusers class names")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"comma-separated, of {', '.join(COLUMNS)}")
    parser.add_argument("--variants", default="all", choices=("all", "none", "only"),
                        help="the real-checkpoint variants (rows such as flux[schnell]): all (default), none, only")
    parser.add_argument("--no-parallel", action="store_true", help="skip the parallel columns (no ranks spawned)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (default 120)")
    parser.add_argument("--batch", type=int, default=1, help="batch of the example call (2: a CFG pair)")
    parser.add_argument("--inputs", default="default", choices=("default", "alt_resolution"),
                        help="the zoo's input set: default, or alt_resolution (each family at a second size)")
    parser.add_argument("--out", default="", help="directory for coverage.md / coverage.json")
    parser.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    parser.add_argument("--update", default="", help="an earlier coverage.json: run only --families / --columns "
                        "and write it with those cells replaced")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    picked = cli_selection("dit-passes coverage", args.families, args.columns, args.variants)
    if picked is None:
        return 2
    rows, columns = picked
    torch.set_num_threads(1)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    with _quiet():
        result = build_matrix(rows, columns, parallel=not args.no_parallel, timeout=args.timeout, batch=args.batch,
                              progress=progress, inputs=args.inputs)
    command = "dit-passes coverage " + " ".join(sys.argv[1:] if argv is None else argv)
    result["command"] = command.strip()
    if args.update:
        with open(args.update) as f:
            try:
                result = merge_rows(json.load(f), result)
            except ValueError as e:
                print(f"dit-passes coverage: {e}", file=sys.stderr)
                return 2
    print(to_text(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "coverage.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "coverage.md"), "w") as f:
            f.write(to_markdown(result, result["command"]))
    return 0


__all__ = ["CACHE_COLUMNS", "COLUMNS", "LOCAL_COLUMNS", "NOTHING", "PARALLEL_COLUMNS", "QUANT_COLUMNS", "Cell",
           "build_matrix", "headline", "source_commit", "cli_selection", "main", "merge_rows",
           "run_cell", "select_rows", "summarize", "to_markdown", "to_text"]
