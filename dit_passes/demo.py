"""``dit-passes demo`` / ``dit-passes fidelity``: residual caching on the embedded trained digits DiT.

The demo samples the trained Flux transformer (``dit_passes/assets``) through diffusers'
FluxPipeline, once with the original transformer and once per cache configuration (each a
``compile_dit(transformer, passes=[passes.DBCache(...)])`` dropped into the pipeline), and reports PSNR /
SSIM against the uncached images, the fraction of transformer-block work executed, the cached steps and
the steady-state speedup (each config's capture and passes are timed on their own line, before). It
writes a PNG grid (baseline row, then one row per configuration), a plot of per-step diffs and decisions
(with matplotlib), and a JSON report.

    dit-passes demo                               # the default DBCache, a steps-mask preset, TaylorSeer
    dit-passes demo --device cuda                 # on the GPU
    dit-passes fidelity --configs dbcache,fast_mask_taylorseer --seeds 0 1 2 --steps 28 --out out/fid
    dit-passes fidelity --sweep                   # every caching method over its thresholds: one plot

Layering: this module (the commands) uses :mod:`dit_passes.fidelity` (the harness) and
:mod:`dit_passes.cache.presets` (the configurations); neither imports it.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import compile_dit, passes
from .cache.presets import DEMO_PRESETS, cache_presets
from .fidelity import run_fidelity

DEMO_CONFIGS = DEMO_PRESETS
# timed-only rounds after the image runs (each: the baseline, then every config, interleaved): the speedup is the
# median of the per-round ratios (~0.25 s runs on a shared 2-core machine vary by tens of percent alone)
TIMING_ROUNDS = 4


def presets(steps: int) -> Dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
    """name -> ``original -> compile_dit(original, passes=[DBCache(preset)])`` for every cache preset."""
    def make(preset):
        return lambda model: compile_dit(model, passes=[passes.DBCache(config=preset.config,
                                                                       calibrator=preset.calibrator)])

    return {name: make(p) for name, p in cache_presets(steps).items()}


def format_table(report: dict) -> str:
    head = ("| config | PSNR mean (min) dB | SSIM mean | blocks executed | cached steps | wall s | speedup (median) |\n"
            "|---|---|---|---|---|---|---|")
    rows = [head, f"| baseline | - | - | 100% | 0 | {report['baseline']['wall_s']:.2f} | 1.00x |"]
    for name, r in report["configs"].items():
        st = r["stats_mean"]
        frac = st.get("executed_block_fraction")
        rows.append(f"| {name} | {r['psnr_mean']:.2f} ({r['psnr_min']:.2f}) | {r['ssim_mean']:.4f} | "
                    f"{'-' if frac is None else f'{100 * frac:.1f}%'} | {st.get('cached_steps', 0):.1f} | "
                    f"{r['wall_s']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(rows)


def takeaway(report: dict) -> str:
    """One line: the fastest config that keeps PSNR >= 30 dB, and the most faithful one."""
    configs = report["configs"]
    if not configs:
        return ""

    def psnr(name):
        p = configs[name]["psnr_mean"]
        return p if math.isfinite(p) else float("inf")

    def describe(name):
        p = configs[name]["psnr_mean"]
        return f"{name} runs {configs[name]['speedup']:.2f}x the uncached speed at " + \
            (f"{p:.1f} dB PSNR" if math.isfinite(p) else "identical images")

    good = [n for n in configs if psnr(n) >= 30.0] or list(configs)
    fastest = max(good, key=lambda n: configs[n]["speedup"])
    faithful = max(configs, key=psnr)
    line = f"Takeaway: {describe(fastest)}"
    if faithful != fastest:
        line += f"; the most faithful, {describe(faithful)}"
    return line + "."


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("dit-passes demo: --device cuda, but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use --device cpu")
    return dev


def _device_line(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"device: {dev} ({torch.cuda.get_device_name(dev)})"
    return f"device: cpu ({torch.get_num_threads()} threads)"


def run(configs: Sequence[str], seeds: Sequence[int], labels: Sequence[int], steps: int, out: str,
        true_cfg_scale: float = 1.0, device: str = "cpu") -> dict:
    table = presets(steps)
    unknown = [c for c in configs if c not in table]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; available: {', '.join(table)}")
    dev = _device(device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    print(f"# trained digits DiT (Flux transformer, 12 blocks) through FluxPipeline, {steps} steps, "
          f"{len(seeds)} seed(s) x {len(labels)} label(s), true CFG {true_cfg_scale}; {_device_line(dev)}",
          flush=True)
    t0 = time.perf_counter()
    report = run_fidelity({c: table[c] for c in configs}, seeds=seeds, labels=labels, steps=steps, out_dir=out,
                          true_cfg_scale=true_cfg_scale, device=dev, timing_rounds=TIMING_ROUNDS)
    report["device"] = str(dev)
    for name, r in report["configs"].items():
        print(f"capture + passes, {name}: {r['capture_s']:.2f} s (once per input shape; not in the times below)")
    print(format_table(report))
    print(takeaway(report))
    plot = f"plot: {report['plot']}\n" if report["plot"] else ""
    print(f"grid: {report['grid']}\n{plot}report: {report['report']}  ({time.perf_counter() - t0:.1f} s in all)")
    return report


def build_parser(prog: str, default_configs: Sequence[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(default_configs),
                   help="comma-separated preset names (default: %(default)s); see --list")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--labels", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--true-cfg-scale", type=float, default=1.0,
                   help="> 1: true CFG with the null class (two transformer calls per step)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (cuda when present)")
    p.add_argument("--out", default="out/demo")
    return p


def main(argv: Optional[List[str]] = None, prog: str = "dit-passes demo",
         default_configs: Sequence[str] = DEMO_CONFIGS) -> int:
    args = build_parser(prog, default_configs).parse_args(argv)
    if args.list:
        print("\n".join(f"{name}: {p.summary}" for name, p in cache_presets(args.steps).items()))
        return 0
    run([c.strip() for c in args.configs.split(",") if c.strip()], args.seeds, args.labels, args.steps, args.out,
        args.true_cfg_scale, args.device)
    return 0


def fidelity_main(argv: Optional[List[str]] = None) -> int:
    """``dit-passes fidelity``: the demo's harness with every preset by default (see ``--list``);
    ``dit-passes fidelity --sweep ...``: every caching method over its thresholds (:mod:`dit_passes.fidelity_sweep`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sweep" in argv:
        from .fidelity_sweep import main as sweep_main
        return sweep_main([a for a in argv if a != "--sweep"])
    return main(argv, prog="dit-passes fidelity", default_configs=tuple(cache_presets(28)))
