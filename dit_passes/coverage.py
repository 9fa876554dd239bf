"""``dit-passes coverage``: every DiT class of diffusers x every pass, on tiny CPU fp32 models.

    dit-passes coverage --out out/coverage                    # the whole matrix (parallel on 2 gloo ranks)
    dit-passes coverage --families flux,wan --no-parallel     # a reduced form
    dit-passes coverage --columns capture,dbcache
    dit-passes coverage --variants only                       # only the real-checkpoint variants (flux[schnell])
    dit-passes coverage --families wan --update out/coverage/coverage.json --out out/coverage   # re-run cells

Rows come from ``dit_passes.models.diffusers_zoo.coverage_rows()`` (the transformer classes diffusers
exports: a class without a zoo config shows as "no config"); columns are :data:`COLUMNS`. Each cell is

* ``exact``: the rewritten module matches (fp32 max relative error <= :data:`TOLERANCE`; the cache columns:
  the first call equals eager and the cached call equals the computed one on identical inputs; SVDQuant's
  reference path: finite and within :data:`SVDQUANT_BOUND`, the error of 4-bit weights and activations);
* ``refused: <reason>``: the library refused before running (a ``PassError``, a capture or block-discovery
  error, a sharding / mesh error: what a user reads; not ``PassCrashed``, a pass's own crash while rewriting);
* ``error: <type: msg>``: anything else (a crash while running, a wrong result, a timeout): a defect.

The models are the zoo's tiny configs with every all-zero floating parameter redrawn (seeded, the same on
every rank: ``zoo.build(..., redraw_zeros=True)``): diffusers zero-initialises gates, modulation and output
projections and norm biases, and behind a zero gate a check against eager cannot see a wrong rewrite.

The local columns run in this process, one model build per cell; the parallel ones run in one
``run_ranks`` call on 2 gloo ranks for every family, each cell on its own process group with the cell's
timeout, so a hang in one cell cannot stall the rest. Writes ``coverage.md`` / ``coverage.json`` to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.utils._pytree as pytree

LOCAL_COLUMNS = ("capture", "dbcache", "taylorseer", "regional", "svdquant")
PARALLEL_COLUMNS = ("ulysses", "ring", "usp", "tp")
COLUMNS = LOCAL_COLUMNS + PARALLEL_COLUMNS
TOLERANCE = 1e-5
SVDQUANT_BOUND = 0.25
WORLD = 2

EXACT, REFUSED, ERROR, NO_CONFIG = "exact", "refused", "error", "no config"


@dataclasses.dataclass
class Cell:
    status: str                 # exact / refused / error / no config
    detail: str = ""            # the reason (refused / error), or the measured error (exact)
    seconds: float = 0.0

    def text(self) -> str:
        return self.status if not self.detail or self.status == EXACT else f"{self.status}: {self.detail}"


class CellTimeout(BaseException):
    """The cell ran past its time budget. A BaseException, as KeyboardInterrupt is: the alarm can fire inside code
    that retries on ``Exception`` (capture tries export again, or with an opaque module, after a failed attempt),
    which would swallow the deadline and let the cell run on."""


class _Refused(Exception):
    """Carries a refusal raised while lowering (capture + passes), before anything ran."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise CellTimeout in this (main) thread after ``seconds``; a no-op off the main thread."""
    import threading
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"cell ran past {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _refusal_types() -> tuple:
    from .analysis.blocks import NoRepeatedBlocksError
    from .capture import CaptureError
    from .infra.pass_base import PassError
    from .parallel.mesh import MeshError
    from .parallel.tp_sharding import ShardingError
    return (PassError, CaptureError, NoRepeatedBlocksError, ShardingError, MeshError)


def _short(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    msg = msg if len(msg) <= limit else msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def _leaves(out) -> List[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _max_rel(actual, expected) -> float:
    """Max over the output tensors of max |a - e| / max |e| (inf when the structure or shapes differ)."""
    a, e = _leaves(actual), _leaves(expected)
    if len(a) != len(e) or any(x.shape != y.shape for x, y in zip(a, e)):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, e):
        if not torch.isfinite(x).all():
            return float("inf")
        scale = y.float().abs().max().clamp_min(1e-30)
        worst = max(worst, ((x.float() - y.float()).abs().max() / scale).item())
    return worst


def _compile(model, passes, inputs):
    """compile_dit + lower now: a refusal here is raised as _Refused, anything else propagates."""
    from . import compile_dit
    from .infra.pass_base import PassCrashed
    try:
        compiled = compile_dit(model, passes=passes())
        compiled.lower(**inputs)
        return compiled
    except PassCrashed:  # a crash inside a pass's rewrite (wrapped as a PassError): a defect, not a refusal
        raise
    except _refusal_types() as e:
        if _timed_out(e):  # a refusal type wrapping the cell's deadline: the time ran out, nothing was refused
            raise
        raise _Refused(_short(e)) from e


def _timed_out(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CellTimeout):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _within(rel: float, bound: float, what: str) -> None:
    if not rel <= bound:
        raise AssertionError(f"{what}: max relative error {rel:.3g} > {bound:g}")


# --------------------------------------------------------------------------------------- the columns
def _check_plain(passes: Callable[[], list], bound: float = TOLERANCE):
    def check(zm, inputs, reference) -> str:
        compiled = _compile(zm.model, passes, inputs)
        with torch.no_grad():
            out = compiled(**inputs)
        rel = _max_rel(out, reference)
        _within(rel, bound, "output vs eager")
        return f"rel {rel:.1e}"
    return check


def _check_cache(passes: Callable[[], list], computed_calls: int):
    """``computed_calls`` warm-up calls, then one that must be cached and equal the last computed one."""
    def check(zm, inputs, reference) -> str:
        compiled = _compile(zm.model, passes, inputs)
        with torch.no_grad():
            outs = [compiled(**inputs) for _ in range(computed_calls + 1)]
        cached = list(compiled.report("dbcache").last_generation()["step_cached"])
        expected = [False] * computed_calls + [True]
        if cached != expected:
            raise AssertionError(f"cache decisions {cached}, expected {expected}")
        rel0 = _max_rel(outs[0], reference)
        _within(rel0, TOLERANCE, "computed call vs eager")
        rel = _max_rel(outs[-1], outs[-2])
        _within(rel, TOLERANCE, "cached call vs computed call")
        return f"rel {max(rel0, rel):.1e}"
    return check


def _local_checks() -> Dict[str, Callable]:
    from .cache.config import TaylorSeerCalibratorConfig
    from .passes import DBCache, RegionalCompile, SVDQuantW4A4

    # always cache once a residual is stored: threshold 1, unlimited cached steps
    always = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, enable_separate_cfg=False)
    return {
        "capture": _check_plain(lambda: []),
        "dbcache": _check_cache(lambda: [DBCache(max_warmup_steps=1, **always)], 1),
        "taylorseer": _check_cache(lambda: [DBCache(max_warmup_steps=2, calibrator=TaylorSeerCalibratorConfig(
            taylorseer_order=1), **always)], 2),
        "regional": _check_plain(lambda: [RegionalCompile(backend="aot_eager")]),
        "svdquant": _check_plain(lambda: [SVDQuantW4A4(rank=4, dynamic=True)], SVDQUANT_BOUND),
    }


def _parallel_checks(group) -> Dict[str, Callable]:
    from .passes import USP, Ring, TensorParallel, Ulysses
    size = torch.distributed.get_world_size(group)
    return {
        "ulysses": _check_plain(lambda: [Ulysses(size=size, group=group)]),
        "ring": _check_plain(lambda: [Ring(size=size, group=group)]),
        "usp": _check_plain(lambda: [USP(ulysses=size, ring=1, group=group)]),
        "tp": _check_plain(lambda: [TensorParallel(size=size, group=group)]),
    }


def run_cell(family: str, check: Callable, timeout: float, batch: int = 1) -> Cell:
    """Build ``family`` fresh (a pass may keep state on the module; zero parameters redrawn, see the module
    docstring), run eager, then ``check``."""
    from .models.zoo import build
    start = time.perf_counter()
    try:
        with _deadline(timeout):
            zm = build(family, redraw_zeros=True)
            inputs = zm.make_inputs(batch=batch, seed=1)
            with torch.no_grad():
                reference = zm.model(**inputs)
            detail = check(zm, inputs, reference)
        return Cell(EXACT, detail, time.perf_counter() - start)
    except _Refused as e:
        return Cell(REFUSED, str(e), time.perf_counter() - start)
    except CellTimeout as e:
        return Cell(ERROR, _short(e), time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - every other failure is a defect the matrix shows
        return Cell(ERROR, _short(e), time.perf_counter() - start)


@contextlib.contextmanager
def _quiet():
    """Silence the libraries' warnings while the matrix runs (they would drown the table); restored after, as
    a pooled rank (``run_ranks``) runs the next caller's function in the same process."""
    import logging
    import warnings
    loggers = [logging.getLogger(name) for name in
               ("diffusers", "torch", "torch._dynamo", "torch._inductor", "torch.fx", "torch.export")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def run_local(families: Sequence[str], columns: Sequence[str], timeout: float, batch: int = 1,
              progress: Optional[Callable[[str], None]] = None) -> Dict[str, Dict[str, Cell]]:
    checks = _local_checks()
    out: Dict[str, Dict[str, Cell]] = {}
    for family in families:
        out[family] = {}
        for column in columns:
            out[family][column] = cell = run_cell(family, checks[column], timeout, batch)
            if progress:
                progress(f"{family:>16} {column:<11} {cell.seconds:6.1f} s  {cell.text()[:150]}")
    return out


def parallel_worker(rank: int, world: int, families: Sequence[str], columns: Sequence[str], timeout: float,
                    batch: int) -> Dict[str, Dict[str, dict]]:
    """One rank of the parallel columns (run by ``run_ranks``): every cell on a fresh group with the cell's
    timeout, the ranks re-synchronised on the world group between cells."""
    import torch.distributed as dist
    out: Dict[str, Dict[str, dict]] = {}
    with _quiet():
        for family in families:
            out[family] = {}
            for column in columns:
                dist.barrier()
                group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout))
                cell = run_cell(family, _parallel_checks(group)[column], timeout, batch)
                out[family][column] = dataclasses.asdict(cell)
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
    return out


def _merge_ranks(per_rank: List[Dict[str, Dict[str, dict]]]) -> Dict[str, Dict[str, Cell]]:
    """One cell from the ranks' cells: an error on any rank wins, then a refusal, else exact (worst error)."""
    out: Dict[str, Dict[str, Cell]] = {}
    for family, row in per_rank[0].items():
        out[family] = {}
        for column in row:
            cells = [Cell(**r[family][column]) for r in per_rank]
            for status in (ERROR, REFUSED):
                bad = [(i, c) for i, c in enumerate(cells) if c.status == status]
                if bad:
                    rank, c = bad[0]
                    out[family][column] = Cell(status, f"rank {rank}: {c.detail}", max(x.seconds for x in cells))
                    break
            else:
                out[family][column] = Cell(EXACT, cells[0].detail, max(x.seconds for x in cells))
    return out


def run_parallel(families: Sequence[str], columns: Sequence[str], timeout: float,
                 batch: int = 1) -> Dict[str, Dict[str, Cell]]:
    from .testing import run_ranks
    budget = 120.0 + timeout * len(families) * len(columns)
    per_rank = run_ranks(parallel_worker, WORLD, list(families), list(columns), timeout, batch, timeout=budget)
    return _merge_ranks(per_rank)


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
                 progress: Optional[Callable[[str], None]] = None) -> dict:
    import diffusers

    from .models.zoo import ALL_FAMILIES
    local_cols = [c for c in columns if c in LOCAL_COLUMNS]
    par_cols = [c for c in columns if c in PARALLEL_COLUMNS] if parallel else []
    families = [f for r in rows for f in r.families]
    start = time.perf_counter()
    cells = run_local(families, local_cols, timeout, batch, progress)
    if par_cols and families:
        if progress:
            progress(f"parallel columns {par_cols} on {WORLD} gloo ranks, {len(families)} families ...")
        for family, row in run_parallel(families, par_cols, timeout, batch).items():
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
        "diffusers": diffusers.__version__, "torch": torch.__version__, "world": WORLD if par_cols else 1,
        "batch": batch, "tolerance": TOLERANCE, "svdquant_bound": SVDQUANT_BOUND, "columns": shown,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": matrix,
        "summary": summarize(matrix, shown),
        "excluded": {name: EXCLUDED[name] for name in transformer_classes() if name in EXCLUDED},
        "zoo_families": list(ALL_FAMILIES),
    }


def merge_rows(base: dict, update: dict) -> dict:
    """``base`` (an earlier matrix) with ``update``'s cells in place of the same (class, family, column) cells:
    re-running a few families or columns after a fix keeps the rest of a 35-minute matrix. ``update``'s columns
    must be among ``base``'s and its settings the same; the result lists both commands and their seconds."""
    differ = [k for k in ("world", "batch", "tolerance", "svdquant_bound") if base.get(k) != update.get(k)]
    extra = [c for c in update["columns"] if c not in base["columns"]]
    if differ or extra:
        what = (f"different {', '.join(differ)} ({[base.get(k) for k in differ]} vs {[update.get(k) for k in differ]})"
                if differ else f"columns {extra} that the earlier matrix lacks")
        raise ValueError(f"cannot merge coverage matrices with {what}: re-run with the earlier run's settings, or "
                         "without --update")
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
    merged["summary"] = summarize(merged["rows"], base["columns"])
    merged["seconds"] = round(base["seconds"] + update["seconds"], 1)
    merged["commands"] = list(base.get("commands") or [base.get("command", "")]) + [update.get("command", "")]
    merged["command"] = merged["commands"][0]
    for k in ("diffusers", "torch"):
        merged[k] = update[k]
    return merged


def summarize(matrix: List[dict], columns: Sequence[str]) -> Dict[str, Dict[str, int]]:
    out = {}
    for c in columns:
        counts = {EXACT: 0, REFUSED: 0, ERROR: 0, NO_CONFIG: 0}
        for row in matrix:
            if c in row["cells"]:
                counts[row["cells"][c]["status"]] += 1
        out[c] = counts
    return out


def _cell_md(cell: dict, ref: Optional[int]) -> str:
    mark = {EXACT: "exact", REFUSED: "refused", ERROR: "**error**", NO_CONFIG: "no config"}[cell["status"]]
    return mark if ref is None else f"{mark} [{ref}]"


def to_markdown(result: dict, command: str = "") -> str:
    cols = result["columns"]
    lines = [f"# DiT coverage: diffusers {result['diffusers']}, torch {result['torch']}", ""]
    commands = result.get("commands") or ([command] if command else [])
    if len(commands) > 1:
        lines += [f"Made by `{commands[0]}`, then the rows of " + ", ".join(f"`{c}`" for c in commands[1:]) +
                  f" put in place of the same cells ({result['seconds']} s in all).", ""]
    elif commands:
        lines += [f"Made by `{commands[0]}` ({result['seconds']} s).", ""]
    lines += [f"exact: fp32 max relative error <= {result['tolerance']:g} vs eager (DBCache / TaylorSeer: the "
              f"cached call equals the computed one on identical inputs; SVDQuant W4A4 reference path: finite and "
              f"<= {result['svdquant_bound']:g}); parallel columns on {result['world']} gloo ranks, "
              f"batch {result['batch']}. refused: the library refused before running; error: a defect.", "",
              "| column | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for status in (EXACT, REFUSED, ERROR, NO_CONFIG):
        lines.append(f"| {status} | " + " | ".join(str(result["summary"][c][status]) for c in cols) + " |")
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
            if cell["status"] in (REFUSED, ERROR):
                notes.append(f"{row['family']} / {c}: {cell['status']}: {cell['detail']}")
                ref = len(notes)
            texts.append(_cell_md(cell, ref))
        lines.append(f"| {row['class']} | {row['family'] or '-'} | " + " | ".join(texts) + " |")
    if notes:
        lines += ["", "## Reasons", ""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    lines += ["", "## Excluded classes (not diffusion transformers over latent tokens)", "",
              "| class | why |", "|---|---|"]
    lines += [f"| {name} | {why} |" for name, why in result["excluded"].items()]
    return "\n".join(lines) + "\n"


def to_text(result: dict) -> str:
    cols = result["columns"]
    short = {EXACT: "exact", REFUSED: "refused", ERROR: "ERROR", NO_CONFIG: "-"}
    width = max([len("family")] + [len(r["family"] or r["class"]) for r in result["rows"]])
    lines = [f"{'family':<{width}}  " + "  ".join(f"{c:<10}" for c in cols)]
    for row in result["rows"]:
        name = row["family"] or f"{row['class']} (no config)"
        lines.append(f"{name:<{width}}  " + "  ".join(
            f"{short[row['cells'][c]['status']] if c in row['cells'] else '':<10}" for c in cols))
    lines.append("")
    for c in cols:
        s = result["summary"][c]
        lines.append(f"{c:<11} exact {s[EXACT]:3d}  refused {s[REFUSED]:3d}  error {s[ERROR]:3d}  "
                     f"no config {s[NO_CONFIG]:3d}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dit-passes coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="", help="comma-separated zoo families or diffusers class names")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"comma-separated, of {', '.join(COLUMNS)}")
    parser.add_argument("--variants", default="all", choices=("all", "none", "only"),
                        help="the real-checkpoint variants (rows such as flux[schnell]): all (default), none, only")
    parser.add_argument("--no-parallel", action="store_true", help="skip the parallel columns (no ranks spawned)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (default 120)")
    parser.add_argument("--batch", type=int, default=1, help="batch of the example call (2: a CFG pair)")
    parser.add_argument("--out", default="", help="directory for coverage.md / coverage.json")
    parser.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    parser.add_argument("--update", default="", help="an earlier coverage.json: run only --families / --columns "
                        "and write it with those cells replaced")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        print(f"dit-passes coverage: unknown column(s) {unknown}; columns: {', '.join(COLUMNS)}", file=sys.stderr)
        return 2
    try:
        rows = select_rows([f.strip() for f in args.families.split(",") if f.strip()], args.variants)
    except ValueError as e:
        print(f"dit-passes coverage: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    with _quiet():
        result = build_matrix(rows, columns, parallel=not args.no_parallel, timeout=args.timeout, batch=args.batch,
                              progress=progress)
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


__all__ = ["COLUMNS", "LOCAL_COLUMNS", "PARALLEL_COLUMNS", "Cell", "build_matrix", "main", "merge_rows", "run_cell",
           "select_rows", "summarize", "to_markdown", "to_text"]
