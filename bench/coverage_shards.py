"""The whole ``dit-passes coverage`` matrix in one run on a many-core machine: the families split into shards
(longest first onto the least loaded shard, by the seconds of an earlier matrix), one ``dit-passes coverage``
process per shard side by side, the shards' matrices merged into one in the zoo's row order.

    python bench/coverage_shards.py --shards 8 --timeout 300 --out $OUT/coverage     # bench/device_coverage.sh
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def shard_families(families, seconds, shards):
    loads = [[0.0, []] for _ in range(shards)]
    for f in sorted(families, key=lambda f: -seconds.get(f, 60.0)):
        least = min(loads, key=lambda x: x[0])
        least[0] += seconds.get(f, 60.0)
        least[1].append(f)
    return [fams for _, fams in loads if fams]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--earlier", default="bench/results/coverage.json", help="an earlier matrix: its cell seconds")
    p.add_argument("--out", default="out/coverage")
    p.add_argument("--families", default="", help="comma-separated: only these (a trial run)")
    p.add_argument("--columns", default="", help="comma-separated: only these columns (default: all)")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds: then stop the shards still running and "
                   "merge the finished ones (their families are listed as unfinished)")
    a = p.parse_args(argv)
    from dit_passes.coverage import merge_rows, select_rows, summarize, to_markdown
    rows = select_rows([f for f in a.families.split(",") if f] or None)
    families = [f for r in rows for f in r.families]
    seconds = {}
    if os.path.exists(a.earlier):
        for r in json.load(open(a.earlier))["rows"]:
            seconds[r["family"]] = sum(c.get("seconds") or 0.0 for c in r["cells"].values())
    shards = shard_families(families, seconds, a.shards)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    procs = []
    for i, fams in enumerate(shards):
        d = os.path.join(a.out, f"shard{i}")
        log = open(os.path.join(a.out, f"shard{i}.log"), "w")
        cmd = [sys.executable, "-m", "dit_passes.cli", "coverage", "--families", ",".join(fams),
               "--timeout", str(a.timeout), "--out", d] + (["--columns", a.columns] if a.columns else [])
        procs.append((d, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    codes = []
    for _, proc in procs:
        left = None if a.deadline <= 0 else max(1.0, a.deadline - (time.perf_counter() - t0))
        try:
            codes.append(proc.wait(timeout=left))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("killed at the deadline")
    wall = time.perf_counter() - t0
    unfinished = [f for (d, _), fams in zip(procs, shards) for f in fams
                  if not os.path.exists(os.path.join(d, "coverage.json"))]
    parts = [json.load(open(os.path.join(d, "coverage.json"))) for d, _ in procs
             if os.path.exists(os.path.join(d, "coverage.json"))]
    if not parts:
        print(f"no shard wrote a matrix (exit codes {codes})")
        return 1
    merged = parts[0]
    for part in parts[1:]:
        merged = merge_rows(merged, part)
    order = {(r.class_name, f): i for i, r in enumerate(rows) for f in r.families}
    merged["rows"].sort(key=lambda r: order.get((r["class"], r["family"]), len(order)))
    merged["summary"] = summarize(merged["rows"], merged["columns"])
    merged["cell_seconds"], merged["seconds"] = merged["seconds"], round(wall, 1)
    columns = f" --columns {a.columns}" if a.columns else ""
    merged["command"] = (f"python bench/coverage_shards.py --shards {a.shards} --timeout {a.timeout:g}{columns} "
                         f"(one `dit-passes coverage --families ...` per shard, {os.cpu_count()} CPUs)")
    merged["shard_exit_codes"] = codes
    merged["unfinished_families"] = unfinished
    with open(os.path.join(a.out, "coverage.json"), "w") as f:
        json.dump(merged, f, indent=1)
    with open(os.path.join(a.out, "coverage.md"), "w") as f:
        f.write(to_markdown(merged, merged["command"]))
    print(json.dumps({"wall_s": wall, "rows": len(merged["rows"]), "exit_codes": codes, "unfinished": unfinished,
                      "summary": merged["summary"]}, indent=1))
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
