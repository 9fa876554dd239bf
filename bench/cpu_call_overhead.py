"""One transformer call of the trained digits DiT on the CPU: the original against its lowered graphs.

Rows (one call each, batch 1: 1x16 image tokens, 4 text tokens, as one denoising step of the demo):

* ``original``: the diffusers FluxTransformer2DModel;
* ``graph``: ``compile_dit(model, passes=[])`` (capture + Cleanup, nothing else);
* ``dbcache_never``: ``compile_dit`` with the default ``DBCache`` (F8B0) and ``residual_diff_threshold=0``,
  so it never caches: every call pays the cache program (decision, state in / out, ``torch.cond``) and
  computes every block;
* ``dbcache_always``: the same with threshold 1 after 8 warm-up steps (the middle blocks skipped).

Timing: the rows are measured interleaved (round r: every row, ``--calls`` calls each), ``--rounds``
times, so a load change on this shared machine hits every row alike; a row's time is the median over
rounds of the per-round median call time, and the ratio is taken per round against the original, then
the median. Memory: each row also runs in a fresh subprocess (model load, build, 50 calls) that
reports its resident set after the calls and its peak (VmHWM), both in MiB.

    OMP_NUM_THREADS=2 python bench/cpu_call_overhead.py --out bench/results/cpu_call_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict

import torch

ROWS = ("original", "graph", "dbcache_never", "dbcache_always")


def make_inputs(batch: int = 1) -> Dict[str, torch.Tensor]:
    from dit_passes.models.digits import load_digits_pipeline

    pipe, cond = load_digits_pipeline()
    prompt, pooled = cond(list(range(batch)))
    side = 4  # 16x16 pixels -> 8x8 latents -> 4x4 packed tokens
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(batch, side * side, 16, generator=g), encoder_hidden_states=prompt,
                  pooled_projections=pooled, timestep=torch.full((batch,), 0.5), img_ids=ids.reshape(-1, 3),
                  txt_ids=torch.zeros(prompt.shape[1], 3), return_dict=False)
    return pipe.transformer, inputs


def build(row: str, model: torch.nn.Module) -> Callable[..., object]:
    from dit_passes import compile_dit, passes

    if row == "original":
        return model
    if row == "graph":
        return compile_dit(model, passes=[])
    if row == "dbcache_never":
        return compile_dit(model, passes=[passes.DBCache(residual_diff_threshold=0.0)])
    if row == "dbcache_always":
        return compile_dit(model, passes=[passes.DBCache(residual_diff_threshold=1.0, max_warmup_steps=8)])
    raise SystemExit(f"unknown row {row!r}; rows: {', '.join(ROWS)}")


def _proc_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def memory_of(row: str) -> dict:
    """Run in this (fresh) process: load, build, 50 calls; resident and peak MiB."""
    model, inputs = make_inputs()
    rss_model = _proc_mib("VmRSS")
    fn = build(row, model)
    with torch.no_grad():
        for _ in range(50):
            fn(**inputs)
    return {"rss_after_load_mib": rss_model, "rss_mib": _proc_mib("VmRSS"), "peak_mib": _proc_mib("VmHWM")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20, help="calls per row per round")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default="bench/results/cpu_call_overhead.json")
    ap.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: one row's memory, printed as JSON
    args = ap.parse_args()
    if args.memory_of:
        print(json.dumps(memory_of(args.memory_of)))
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model, inputs = make_inputs()
    fns, build_s = {}, {}
    with torch.no_grad():
        for row in rows:
            t0 = time.perf_counter()
            fns[row] = build(row, model)
            fns[row](**inputs)  # capture + passes happen on the first call
            build_s[row] = time.perf_counter() - t0
            for _ in range(10):
                fns[row](**inputs)
        per_round: Dict[str, list] = {r: [] for r in rows}
        for _ in range(args.rounds):
            for row in rows:
                ts = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fns[row](**inputs)
                    ts.append(time.perf_counter() - t0)
                per_round[row].append(statistics.median(ts))
    results = {}
    for row in rows:
        ratios = [a / b for a, b in zip(per_round[row], per_round["original"])] if "original" in rows else []
        results[row] = {"ms": 1e3 * statistics.median(per_round[row]),
                        "ms_min_round": 1e3 * min(per_round[row]),
                        "vs_original": statistics.median(ratios) if ratios else None,
                        "first_call_s": build_s[row]}
    for row in rows:  # memory: one fresh process per row
        proc = subprocess.run([sys.executable, "-P", __file__, "--memory-of", row], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        results[row].update(json.loads(lines[-1]) if lines else {"memory_error": proc.stderr[-400:]})
    report = {"command": "OMP_NUM_THREADS={} python bench/cpu_call_overhead.py {}".format(
                  os.environ.get("OMP_NUM_THREADS", "?"), " ".join(sys.argv[1:])),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or
              platform.machine(), "rounds": args.rounds, "calls_per_round": args.calls,
              "load_avg_1m": os.getloadavg()[0], "rows": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'row':16s} {'ms/call':>8s} {'x orig':>7s} {'first call s':>12s} {'RSS MiB':>8s} {'peak MiB':>8s}")
    for row, r in results.items():
        ratio = "" if r["vs_original"] is None else f"{r['vs_original']:.3f}"
        print(f"{row:16s} {r['ms']:8.3f} {ratio:>7s} {r['first_call_s']:12.2f} {r.get('rss_mib', float('nan')):8.1f} "
              f"{r.get('peak_mib', float('nan')):8.1f}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
