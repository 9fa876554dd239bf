"""``dit-passes fidelity --sweep``: every caching method over a range of its thresholds, on one plot.

Each method of :data:`SWEEP_METHODS` is built at each of its thresholds (``compile_dit(original,
passes=builder(threshold, ctx), keep_original=True)``) and all of them are sampled in ONE
:func:`~dit_passes.fidelity.run_fidelity` call on the trained digits DiT (the same seeds, labels and
steps; timed runs interleaved with the uncached baseline). Per point: PSNR / SSIM against the uncached
images, the fraction of work executed, the measured speedup. Outputs in ``--out``:

* ``fidelity_sweep.png`` (needs matplotlib, else a one-line notice): PSNR vs the fraction of work
  executed (left) and vs the measured speedup (right), one curve per method, the Pareto front over all
  methods marked (black dashes, circled points);
* ``fidelity_sweep.json`` (every point, the fronts, MagCache's calibrated ratios, the command);
* ``fidelity_sweep.md`` (the command and a table, Pareto points starred).

The x of a point is the fraction of transformer-block work executed (``executed_block_fraction``: the
block-range caches) where the method reports it; an attention-level cache (TaylorSeerCache, PAB, FasterCache) skips only
its attention modules, so its x is the fraction of calls in which those modules ran
(``executed_module_fraction``, 1 - cached calls / calls): the plot draws those points hollow and says so.

    dit-passes fidelity --sweep                                  # every method, defaults below
    dit-passes fidelity --sweep --methods first_block_cache,mag_cache --steps 20 --out out/sweep
    dit-passes fidelity --sweep --quick                          # 2 thresholds a method, 8 steps: a smoke test

Adding a method is one entry: ``SWEEP_METHODS[name] = (builder, thresholds)`` with ``builder(threshold,
ctx) -> [passes]``; ``ctx`` (:class:`SweepContext`) gives the run's ``steps`` / ``pipe`` / ``labels`` and
``ctx.once(key, fn)`` for a calibration shared by every threshold of a run (MagCache's ratios).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import compile_dit, passes
from .cache.config import TaylorSeerCalibratorConfig
from .fidelity import Sampler, _jsonable, digits_sampler, run_fidelity
from .infra import env

PLOT_NAME, JSON_NAME, TABLE_NAME = "fidelity_sweep.png", "fidelity_sweep.json", "fidelity_sweep.md"
BLOCK_X, MODULE_X = "executed_block_fraction", "executed_module_fraction"
X_LABELS = {BLOCK_X: "fraction of block work executed",
            MODULE_X: "fraction of calls the cached (attention) modules ran"}


class SweepContext:
    """What a builder may need besides its threshold: the run's settings and the pipeline, and ``once``:
    a value computed at the first ask and shared by every later one of the run (a calibration)."""

    def __init__(self, pipe, steps: int, seeds: Sequence[int], labels: Sequence[int], true_cfg_scale: float,
                 sampler: Optional[Sampler] = None):
        self.pipe, self.steps, self.seeds, self.labels = pipe, steps, list(seeds), list(labels)
        self.true_cfg_scale = true_cfg_scale
        self.sampler = sampler or digits_sampler(pipe, labels, true_cfg_scale)  # (transformer, seed, steps)
        self.calibrations: Dict[str, Any] = {}  # key -> value, written to the JSON report

    def once(self, key: str, compute: Callable[["SweepContext"], Any]) -> Any:
        if key not in self.calibrations:
            self.calibrations[key] = compute(self)
        return self.calibrations[key]


def calibrate_mag_ratios(ctx: SweepContext) -> List[float]:
    """MagCache's magnitude ratios of this pipeline at ``ctx.steps`` steps: one calibration generation
    (``MagCacheConfig(calibrate=True)``, first seed, the run's labels), as diffusers' calibrate mode does."""
    probe = compile_dit(ctx.pipe.transformer, passes=[passes.MagCache(calibrate=True, num_inference_steps=ctx.steps)],
                        keep_original=True)
    ctx.sampler(probe, ctx.seeds[0], ctx.steps)
    return probe.report("mag_cache").mag_ratios()


def _dbcache(threshold: float, ctx: SweepContext, calibrator=None) -> list:
    # F1B0 (the cut FirstBlockCache uses, so the two rules compare on the same work), 4 warm-up steps
    return [passes.DBCache(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold,
                           max_warmup_steps=4, calibrator=calibrator)]


# name -> (builder(threshold, ctx) -> passes, thresholds). TaylorSeerCache's "threshold" is its cache_interval.
SWEEP_METHODS: Dict[str, Tuple[Callable[[float, SweepContext], list], List[float]]] = {
    "dbcache_F1B0": (_dbcache, [0.08, 0.12, 0.18, 0.27, 0.4]),
    "dbcache_F1B0_taylorseer": (
        lambda t, ctx: _dbcache(t, ctx, TaylorSeerCalibratorConfig(taylorseer_order=1)), [0.08, 0.12, 0.18, 0.27, 0.4]),
    "first_block_cache": (lambda t, ctx: [passes.FirstBlockCache(threshold=t)], [0.06, 0.1, 0.15, 0.22, 0.33]),
    "mag_cache": (lambda t, ctx: [passes.MagCache(threshold=t, num_inference_steps=ctx.steps,
                                                  mag_ratios=ctx.once("mag_ratios", calibrate_mag_ratios))],
                  [0.03, 0.06, 0.12, 0.24, 0.5]),
    "taylorseer_cache": (lambda t, ctx: [passes.TaylorSeerCache(cache_interval=int(t))], [2, 3, 4, 6]),
    "sea_cache": (lambda t, ctx: [passes.SeaCache(threshold=t, num_inference_steps=ctx.steps)],
                  [0.05, 0.1, 0.15, 0.25, 0.4]),
    "tea_cache": (lambda t, ctx: [passes.TeaCache(threshold=t, num_inference_steps=ctx.steps)],
                  [0.2, 0.4, 0.6, 0.8, 1.2]),
    # FluxPipeline passes t / 1000: timestep_scale=1000 puts the skip ranges on diffusers' 0..1000 scale; the ranges
    # are widened from diffusers' defaults, which seldom apply over 28 steps of this model
    "pyramid_attention_broadcast": (lambda t, ctx: [passes.PyramidAttentionBroadcast(
        spatial_attention_block_skip_range=int(t), spatial_attention_timestep_skip_range=(100, 950),
        timestep_scale=1000)], [2, 3, 4, 6]),
    "faster_cache": (lambda t, ctx: [passes.FasterCache(
        spatial_attention_block_skip_range=int(t), spatial_attention_timestep_skip_range=(-1, 950),
        is_guidance_distilled=True, timestep_scale=1000)], [2, 3, 4, 6]),
}


def pareto_front(points: Sequence[Tuple[float, float]], x_lower_is_better: bool) -> List[int]:
    """Indices of the points no other point dominates, by increasing x. A point (x, y) is dominated when
    another is at least as good in both (x lower, or higher with ``x_lower_is_better=False``; y higher)
    and better in one. Points with a NaN coordinate are never on the front; ``inf`` y is the best y."""
    sign = 1.0 if x_lower_is_better else -1.0
    ok = [i for i, (x, y) in enumerate(points) if not (math.isnan(x) or math.isnan(y))]
    front = []
    for i in ok:
        xi, yi = sign * points[i][0], points[i][1]
        dominated = any(sign * points[j][0] <= xi and points[j][1] >= yi
                        and (sign * points[j][0] < xi or points[j][1] > yi) for j in ok if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], points[i][1]))


def work_fraction(config_report: dict) -> Tuple[float, str]:
    """(x, which x) of one config of a run_fidelity report: the executed block fraction when the method
    reports one, else the fraction of calls its cached modules ran (from the per-call decisions)."""
    stats_mean = config_report["stats_mean"]
    if BLOCK_X in stats_mean:
        return float(stats_mean[BLOCK_X]), BLOCK_X
    if "executed_attention_fraction" in stats_mean:  # attention-reuse caches count their module calls themselves
        return float(stats_mean["executed_attention_fraction"]), MODULE_X
    decisions = [bool(c) for run in config_report["stats"] for c in run.get("step_cached", [])]
    if not decisions:
        return float("nan"), MODULE_X
    return 1.0 - sum(decisions) / len(decisions), MODULE_X


def mark_fronts(points: Dict[str, List[dict]]) -> Dict[str, List[list]]:
    """Marks ``pareto_work`` / ``pareto_speed`` on the points of every method; returns both fronts as
    ``[method, threshold]`` pairs. The work front compares block fractions only: a point whose x is another
    quantity (an attention-level cache's module calls) is left off it (it stays on the speed front's)."""
    flat = [(m, p) for m, pts in points.items() for p in pts]
    fronts = {
        "work": pareto_front([(p["work_fraction"] if p["x"] == BLOCK_X else math.nan, p["psnr_mean"])
                              for _, p in flat], x_lower_is_better=True),
        "speed": pareto_front([(p["speedup"], p["psnr_mean"]) for _, p in flat], x_lower_is_better=False),
    }
    for key, idx in fronts.items():
        for i in idx:
            flat[i][1][f"pareto_{key}"] = True
    return {k: [[flat[i][0], flat[i][1]["threshold"]] for i in idx] for k, idx in fronts.items()}


def config_name(method: str, threshold: float) -> str:
    return f"{method}@{threshold:g}"


def _build(modules: dict, name: str, pass_list: list, original: torch.nn.Module) -> torch.nn.Module:
    modules[name] = compile_dit(original, passes=pass_list, keep_original=True)
    return modules[name]


def time_modules(sampler: Sampler, original: torch.nn.Module, modules: Dict[str, torch.nn.Module], seed: int,
                 steps: int, repeats: int) -> Dict[str, float]:
    """Median seconds of one sampling run per module (and ``"baseline"``: the original transformer), after one
    untimed round; the rounds interleave every module, so a change of the machine's load hits all alike. Every
    run goes through the same path (a fresh pipeline around the given transformer), the baseline's too."""
    runs = {"baseline": original, **modules}
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for r in range(repeats + 1):
        for name, module in runs.items():
            t0 = time.perf_counter()
            sampler(module, seed, steps)
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def run_sweep(methods: Sequence[str], seeds: Sequence[int], labels: Sequence[int], steps: int,
              thresholds: Optional[Dict[str, List[float]]] = None, *, pipe=None, true_cfg_scale: float = 1.0,
              device: str | torch.device = "cpu", harness_out: Optional[str | Path] = None,
              timing_repeats: int = 3, sampler: Optional[Sampler] = None) -> dict:
    """Every method x threshold against the uncached baseline in one run_fidelity; returns the sweep report
    (``points`` per method, the two ``pareto`` fronts as ``[method, threshold]`` pairs, ``calibrations``).
    Another model than the digits DiT: ``pipe=<its diffusers pipeline>, sampler=fidelity.pipeline_sampler(pipe,
    prompt=[...], ...)`` (``labels`` then unused)."""
    from .models.digits import load_digits_pipeline

    unknown = [m for m in methods if m not in SWEEP_METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; available: {', '.join(SWEEP_METHODS)}")
    if pipe is None:
        pipe, _ = load_digits_pipeline(device=device)
    ctx = SweepContext(pipe, steps, seeds, labels, true_cfg_scale, sampler)
    grid = {m: list((thresholds or {}).get(m) or SWEEP_METHODS[m][1]) for m in methods}
    configs, owner, modules = {}, {}, {}
    for method, values in grid.items():
        builder = SWEEP_METHODS[method][0]
        for t in values:
            built = builder(t, ctx)  # now: a calibration (ctx.once) runs before any timed run
            configs[config_name(method, t)] = functools.partial(_build, modules, config_name(method, t), built)
            owner[config_name(method, t)] = (method, t)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fidelity_sweep_") as tmp:
        fid = run_fidelity(configs, seeds=seeds, labels=labels, steps=steps, out_dir=harness_out or tmp,
                           pipe=pipe, true_cfg_scale=true_cfg_scale, device=device, sampler=ctx.sampler)
    seconds = time_modules(ctx.sampler, pipe.transformer, modules, seeds[0], steps, timing_repeats)
    points: Dict[str, List[dict]] = {m: [] for m in methods}
    for name, r in fid["configs"].items():
        method, t = owner[name]
        x, kind = work_fraction(r)
        points[method].append({
            "threshold": t, "config": name, "work_fraction": x, "x": kind,
            "psnr_mean": r["psnr_mean"], "psnr_min": r["psnr_min"], "ssim_mean": r["ssim_mean"],
            "speedup": seconds["baseline"] / seconds[name], "median_s": seconds[name], "capture_s": r["capture_s"],
            "cached_calls": (sum(sum(bool(c) for c in run.get("step_cached", [])) for run in r["stats"])
                             / len(r["stats"]) if r["stats"] else 0.0),
        })
    return {
        "model": ("trained digits DiT (Flux transformer, 12 blocks) through FluxPipeline" if sampler is None
                  else f"{type(pipe.transformer).__name__} through {type(pipe).__name__}"),
        "steps": steps, "seeds": list(seeds), "labels": list(labels), "true_cfg_scale": true_cfg_scale,
        "device": str(device), "threads": torch.get_num_threads(),
        "baseline_median_s": seconds["baseline"], "timing_repeats": timing_repeats, "sweep_s": time.perf_counter() - t0,
        "methods": points,
        "pareto": mark_fronts(points),
        "calibrations": ctx.calibrations,
    }


def format_table(report: dict) -> str:
    rows = ["| method | threshold | work executed | PSNR mean (min) dB | SSIM mean | cached calls | speedup | front |",
            "|---|---|---|---|---|---|---|---|"]
    for method, pts in report["methods"].items():
        for p in sorted(pts, key=lambda p: -p["work_fraction"] if math.isfinite(p["work_fraction"]) else 0):
            star = " / ".join(k for k in ("work", "speed") if p.get(f"pareto_{k}")) or ""
            x = f"{100 * p['work_fraction']:.1f}%" + (" (attn)" if p["x"] == MODULE_X else "")
            rows.append(f"| {method} | {p['threshold']:g} | {x} | {p['psnr_mean']:.2f} ({p['psnr_min']:.2f}) | "
                        f"{p['ssim_mean']:.4f} | {p['cached_calls']:.1f} | {p['speedup']:.2f}x | {star} |")
    return "\n".join(rows)


def front_line(report: dict, key: str) -> str:
    what = "block work executed" if key == "work" else "speedup"
    by = {(m, p["threshold"]): p for m, pts in report["methods"].items() for p in pts}
    parts = []
    for m, t in report["pareto"][key]:
        p = by[(m, t)]
        x = f"{100 * p['work_fraction']:.0f}%" if key == "work" else f"{p['speedup']:.2f}x"
        parts.append(f"{config_name(m, t)} ({x}, {p['psnr_mean']:.1f} dB)")
    return f"Pareto front, PSNR vs {what}: " + ", ".join(parts)


def write_markdown(report: dict, path: Path, command: str) -> None:
    lines = ["# Fidelity sweep: every caching method over its thresholds", "",
             f"Command: `{command}`", "",
             f"{report['model']}; {report['steps']} steps, seeds {report['seeds']}, labels {report['labels']}, "
             f"true CFG {report['true_cfg_scale']}; device {report['device']} ({report['threads']} threads); "
             f"{report.get('wall_s', report['sweep_s']):.0f} s in all. PSNR / SSIM against the uncached images; "
             f"work executed: the fraction of block work, or (attn) of the calls of the cached attention modules; "
             f"speedup: steady-state wall time (median of {report['timing_repeats']} interleaved runs, seed "
             f"{report['seeds'][0]}) of the uncached pipeline / the cached one (noisy on a shared CPU). "
             f"TaylorSeerCache's threshold is its cache_interval, PAB's and FasterCache's their spatial block "
             f"skip range.", "",
             format_table(report), "", front_line(report, "work") + ".", "", front_line(report, "speed") + ".", ""]
    if (path.parent / PLOT_NAME).exists():
        lines += [f"![PSNR vs work and speedup]({PLOT_NAME})", ""]
    path.write_text("\n".join(lines))


def write_plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:  # an optional dependency (the dev extras): the JSON and the table do not need it
        print(f"note: matplotlib is not installed, so {path.name} is not drawn; `pip install matplotlib` to get it")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [p["psnr_mean"] for pts in report["methods"].values() for p in pts if math.isfinite(p["psnr_mean"])]
    top = (max(finite) if finite else 60.0) + 4.0  # identical images (PSNR inf) are drawn on this line

    def y(p):
        return p["psnr_mean"] if math.isfinite(p["psnr_mean"]) else top

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    panels = (("work", "work_fraction", "fraction of work executed (block work; hollow: attention-module calls)"),
              ("speed", "speedup", "measured speedup over the uncached pipeline"))
    by = {(m, p["threshold"]): p for m, pts in report["methods"].items() for p in pts}
    for ax, (key, field, xlabel) in zip(axes, panels):
        for i, (method, pts) in enumerate(report["methods"].items()):
            pts = sorted(pts, key=lambda p: p[field])
            color = f"C{i}"
            hollow = pts and pts[0]["x"] == MODULE_X and key == "work"
            ax.plot([p[field] for p in pts], [y(p) for p in pts], "-o", color=color, lw=1.3, ms=5,
                    mfc="none" if hollow else color, label=method + (" (x: attention calls)" if hollow else ""))
            for p in pts:
                ax.annotate(f"{p['threshold']:g}", (p[field], y(p)), textcoords="offset points", xytext=(3, 3),
                            fontsize=6, color=color)
        front = [by[(m, t)] for m, t in report["pareto"][key]]
        ax.plot([p[field] for p in front], [y(p) for p in front], "k--", lw=1, zorder=0,
                label="Pareto front" + (" (block-work points)" if key == "work" else ""))
        ax.scatter([p[field] for p in front], [y(p) for p in front], s=110, facecolors="none", edgecolors="k", lw=1)
        if len(finite) < sum(len(v) for v in report["methods"].values()):
            ax.axhline(top, color="gray", lw=0.5, ls=":")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("PSNR vs uncached, dB (mean)")
        ax.grid(alpha=0.3)
    axes[0].invert_xaxis()  # less work to the right, as speed on the right panel
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{report['model']}: {report['steps']} steps, {len(report['seeds'])} seeds x {len(report['labels'])} "
                 f"labels (numbers: threshold; taylorseer_cache: cache_interval)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


QUICK = dict(steps=8, seeds=[0], labels=[1, 7])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dit-passes fidelity --sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(SWEEP_METHODS), help="comma-separated (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="list the methods and their thresholds and exit")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--labels", type=int, nargs="+", default=[0, 3, 5, 8])
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke test: the first and last threshold of each method, {QUICK}")
    p.add_argument("--true-cfg-scale", type=float, default=1.0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--timing-repeats", type=int, default=3, help="timed runs per config (median)")
    p.add_argument("--out", default="out/fidelity_sweep")
    p.add_argument("--pipeline", default=None, metavar="MODULE:FUNCTION",
                   help="another model: a function returning its diffusers pipeline (weights loaded as you like); "
                        "sampled with --prompt and --call-kwargs instead of the digits")
    p.add_argument("--prompt", nargs="+", default=None, help="with --pipeline: the prompts (one image each)")
    p.add_argument("--call-kwargs", default="{}", help="with --pipeline: JSON of further pipeline arguments "
                   "(height, width, guidance_scale, ...)")
    p.add_argument("--harness-out", default=None,
                   help="also keep run_fidelity's grid / per-step plot / full report there")
    return p


def user_pipeline(spec: str, prompts: Optional[List[str]], call_kwargs: str):
    """``--pipeline MODULE:FUNCTION``: (the pipeline that function returns, its sampler)."""
    import importlib

    from .fidelity import pipeline_sampler
    module, _, func = spec.partition(":")
    if not module or not func:
        raise SystemExit(f"--pipeline {spec!r}: use MODULE:FUNCTION (a function returning a diffusers pipeline)")
    if not prompts:
        raise SystemExit("--pipeline needs --prompt TEXT [TEXT ...] (one image per prompt)")
    try:
        extra = json.loads(call_kwargs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--call-kwargs is not JSON ({e}): e.g. '{{\"height\": 512, \"width\": 512}}'") from e
    pipe = getattr(importlib.import_module(module), func)()
    if not hasattr(pipe, "components") or not hasattr(pipe, "transformer"):
        raise SystemExit(f"--pipeline {spec}: returned {type(pipe).__name__}, not a diffusers pipeline with a "
                         f"transformer")
    return pipe, pipeline_sampler(pipe, prompt=list(prompts), **extra)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.list:
        print("\n".join(f"{m}: thresholds {v}" for m, (_, v) in SWEEP_METHODS.items()))
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    # every config compiles the same transformer at the same call: export it once, bind the rest (trace_templates)
    env.set_default(env.REUSE_TRACES, "1")
    thresholds = None
    if args.quick:
        args.steps, args.seeds, args.labels = QUICK["steps"], QUICK["seeds"], QUICK["labels"]
        thresholds = {m: [SWEEP_METHODS[m][1][0], SWEEP_METHODS[m][1][-1]] for m in methods if m in SWEEP_METHODS}
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    pipe = sampler = None
    if args.pipeline:
        pipe, sampler = user_pipeline(args.pipeline, args.prompt, args.call_kwargs)
    t0 = time.perf_counter()
    report = run_sweep(methods, args.seeds, args.labels, args.steps, thresholds, true_cfg_scale=args.true_cfg_scale,
                       device=device, harness_out=args.harness_out, pipe=pipe, sampler=sampler,
                       timing_repeats=1 if args.quick else args.timing_repeats)
    command = "dit-passes fidelity --sweep " + " ".join(shlex.quote(a) for a in argv)
    report["command"] = command.strip()
    report["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    has_plot = write_plot(report, out / PLOT_NAME)
    (out / JSON_NAME).write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    write_markdown(report, out / TABLE_NAME, report["command"])
    print(format_table(report))
    print(front_line(report, "work"))
    print(front_line(report, "speed"))
    written = [out / n for n in ((PLOT_NAME,) if has_plot else ()) + (JSON_NAME, TABLE_NAME)]
    print(f"wrote {', '.join(map(str, written))} ({report['wall_s']:.1f} s in all)")
    return 0


__all__ = ["SWEEP_METHODS", "SweepContext", "calibrate_mag_ratios", "pareto_front", "work_fraction", "run_sweep",
           "format_table", "main"]
