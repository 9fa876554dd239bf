"""Coverage beyond the zoo's configs: every class built from configs drawn around its tiny one, every pass run on
each (``dit-passes fuzz``).

The coverage matrix runs one config per class and the real checkpoints' flags (``zoo_variants``); a config nobody
wrote down can still break a pass, and a zoo that only holds configs that work hides it. A draw changes, from the
family's tiny config (:func:`draw_overrides`, deterministic in ``(family, seed)``):

* the length of every block list (the zoo's 2 -> 1 or 3; lists outside the main stack may also be empty),
* the head count where the head width is its own field (2 -> 1 or 3: hidden widths follow, and 3 heads do not
  divide over 2 ranks),
* every boolean field of the class's ``__init__`` (the zoo's value, else the class default), each flipped with
  probability :data:`FLIP`.

A draw the class itself rejects (its constructor or its eager forward raises) is *invalid*: listed with the reason,
not a defect of ours. On a valid draw each column is the coverage matrix's cell (``coverage_cells``: exact, refused
before running, or an error), so a column's errors here are defects of the passes as the matrix's are.

    dit-passes fuzz --draws 2 --columns capture,dbcache,fp8 --out out/fuzz      # every family, 2 draws each
    dit-passes fuzz --families flux,wan --seed 7 --parallel                      # + ulysses / ring / usp / tp
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import random
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .coverage_cells import (COLUMNS, ERROR, EXACT, LOCAL_COLUMNS, NOTHING, PARALLEL_COLUMNS, REFUSED, Cell, _leaves,
                             _quiet, run_cell, run_local, run_parallel)

MAIN_BLOCKS = (1, 3)        # the zoo's block lists hold 2
AUX_BLOCKS = (0, 1, 3)      # a list outside the main stack (refiners, a token refiner) may be empty
HEADS = (1, 3)              # the zoo's 2 heads
FLIP = 0.35                 # a boolean field's chance of being flipped


def draw_overrides(family: str, seed: int) -> Dict[str, object]:
    """Config fields to replace in ``family``'s tiny config: block-list lengths, the head count, flipped booleans
    (module docstring). Deterministic in ``(family, seed)``; a draw that changes nothing is drawn again (up to 16
    times)."""
    from .models.zoo import config_for, family_spec, model_class
    spec, base = family_spec(family), config_for(family)
    params = inspect.signature(model_class(family).__init__).parameters
    for attempt in range(16):
        rng = random.Random(f"{family}:{seed}:{attempt}")
        out: Dict[str, object] = {}
        for key in spec.block_list_keys.values():
            out[key] = rng.choice(MAIN_BLOCKS)
        for key in spec.aux_list_keys.values():
            out[key] = rng.choice(AUX_BLOCKS)
        if spec.head_dim_key is not None and spec.heads_key in params:
            out[spec.heads_key] = rng.choice(HEADS)
        for name, p in params.items():
            value = base.get(name, p.default)
            if isinstance(value, bool) and rng.random() < FLIP:
                out[name] = not value
        out = {k: v for k, v in out.items() if base.get(k, params[k].default) != v}
        if out:
            return dict(sorted(out.items()))
    return {}


def probe(family: str, overrides: Dict[str, object], timeout: float, batch: int = 1) -> Optional[str]:
    """None where the class builds and runs eagerly with ``overrides`` (a finite output), else why not (the draw is
    invalid): the matrix's cell with no pass to check."""
    cell = run_cell(family, _finite, timeout, batch, overrides)
    return None if cell.status == EXACT else cell.detail


def _finite(zm, inputs, reference) -> str:
    leaves = _leaves(reference)
    if not leaves or not all(torch.isfinite(t).all() for t in leaves):
        raise ValueError("eager output not finite")
    return ""


def _heads_key(family: str) -> str:
    from .models.zoo import family_spec
    return family_spec(family).heads_key


def row_key(family: str, seed: int) -> str:
    return f"{family}#{seed}"


def run_fuzz(families: Sequence[str], draws: int, columns: Sequence[str], seed: int = 0, timeout: float = 120.0,
             parallel: bool = False, progress: Optional[Callable[[str], None]] = None) -> dict:
    """``draws`` configs per family from seeds ``seed ..``: each probed, then every column's cell on the valid ones.
    Returns the JSON-able result (rows, a summary per column, the invalid draws)."""
    start = time.perf_counter()
    rows: List[dict] = []
    drawn: Dict[str, tuple] = {}
    for family in families:
        heads_key = _heads_key(family)
        for s in range(seed, seed + draws):
            overrides = draw_overrides(family, s)
            why = probe(family, overrides, timeout)
            if why is not None and heads_key in overrides:  # widths tied to the head count (SD3's caption
                kept = {k: v for k, v in overrides.items() if k != heads_key}  # projection): the rest of the draw
                if kept and probe(family, kept, timeout) is None:
                    overrides, why = kept, None
            rows.append({"family": family, "seed": s, "overrides": overrides, "invalid": why, "cells": {}})
            if why is None:
                drawn[row_key(family, s)] = (family, overrides)
            elif progress:
                progress(f"{row_key(family, s):>20} invalid: {why[:150]}")
    local = [c for c in columns if c in LOCAL_COLUMNS]
    par = [c for c in columns if c in PARALLEL_COLUMNS] if parallel else []
    cells: Dict[str, Dict[str, Cell]] = run_local(list(drawn), local, timeout, progress=progress, drawn=drawn)
    if par and drawn:
        for key, row in run_parallel(list(drawn), par, timeout, drawn=drawn).items():
            cells[key].update(row)
    for r in rows:
        r["cells"] = {c: dataclasses.asdict(x) for c, x in cells.get(row_key(r["family"], r["seed"]), {}).items()}
    shown = local + par
    summary = {c: {st: sum(1 for r in rows if r["cells"].get(c, {}).get("status") == st)
                   for st in (EXACT, NOTHING, REFUSED, ERROR)} for c in shown}
    import diffusers

    from .coverage import source_commit
    return {"commit": source_commit(), "diffusers": diffusers.__version__, "torch": torch.__version__,
            "columns": shown, "draws": draws,
            "seed": seed, "seconds": round(time.perf_counter() - start, 1), "valid": len(drawn),
            "invalid": sum(1 for r in rows if r["invalid"]), "summary": summary, "rows": rows}


def to_markdown(result: dict, command: str) -> str:
    cols = result["columns"]
    lines = [f"# Fuzzed configs: diffusers {result['diffusers']}, torch {result['torch']}, commit "
             f"{result.get('commit', 'unknown')}", "",
             f"Made by `{command}` ({result['seconds']:.0f} s): {result['valid']} valid draws, {result['invalid']} "
             "the classes themselves reject (listed last).", "",
             "| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for st in (EXACT, NOTHING, REFUSED, ERROR):
        lines.append(f"| {st} | " + " | ".join(str(result["summary"][c][st]) for c in cols) + " |")
    lines += ["", "## Cells not exact", ""]
    for r in result["rows"]:
        for c, cell in r["cells"].items():
            if cell["status"] != EXACT:
                lines.append(f"- `{row_key(r['family'], r['seed'])}` {json.dumps(r['overrides'])} **{c}** "
                             f"{cell['status']}: {cell['detail']}")
    lines += ["", "## Draws the class rejects", ""]
    lines += [f"- `{row_key(r['family'], r['seed'])}` {json.dumps(r['overrides'])}: {r['invalid']}"
              for r in result["rows"] if r["invalid"]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .coverage import cli_selection
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="dit-passes fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="", help="comma-separated zoo families or class names (default: all)")
    p.add_argument("--columns", default=",".join(LOCAL_COLUMNS), help=f"comma-separated, of {', '.join(COLUMNS)}")
    p.add_argument("--draws", type=int, default=1, help="configs drawn per family (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the first draw's seed (default 0)")
    p.add_argument("--parallel", action="store_true", help="run the parallel columns too (gloo ranks)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per cell (default 120)")
    p.add_argument("--out", default="", help="directory for fuzz.md / fuzz.json")
    p.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    a = p.parse_args(argv)
    if a.draws < 1:
        print("dit-passes fuzz: --draws must be >= 1", file=sys.stderr)
        return 2
    picked = cli_selection("dit-passes fuzz", a.families, a.columns, "none")
    if picked is None:
        return 2
    rows, columns = picked
    torch.set_num_threads(1)
    progress = None if a.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    with _quiet():
        result = run_fuzz([f for r in rows for f in r.families], a.draws, columns, a.seed, a.timeout, a.parallel,
                          progress)
    command = ("dit-passes fuzz " + " ".join(argv)).strip()
    result["command"] = command
    md = to_markdown(result, command)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fuzz.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(a.out, "fuzz.md"), "w") as f:
            f.write(md)
    return 1 if any(result["summary"][c][ERROR] for c in result["columns"]) else 0


__all__ = ["draw_overrides", "main", "probe", "run_fuzz", "to_markdown"]
