"""``dit-passes demo`` / ``dit-passes fidelity``: residual caching on the embedded trained digits DiT.

The demo samples the trained FluxTransformer2DModel (``dit_passes/assets``) through diffusers'
FluxPipeline, once with the original transformer and once per cache configuration (each a
``compile_dit(transformer, passes=[passes.DBCache(...)])`` dropped into the pipeline), and reports PSNR /
SSIM against the uncached images, the fraction of transformer-block work executed, the cached steps and
wall time. It writes a PNG grid (baseline row, then one row per configuration), a plot of per-step
diffs and decisions, and a JSON report.

    dit-passes demo                               # the default DBCache, a steps-mask preset, TaylorSeer
    dit-passes fidelity --configs dbcache,fast_mask_taylorseer --seeds 0 1 2 --steps 28 --out out/fid
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import compile_dit, passes
from .cache.config import TaylorSeerCalibratorConfig
from .cache.steps_mask import steps_mask


def presets(steps: int) -> Dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
    """Named cache configurations for a run of ``steps`` denoising steps (the digits DiT has 12 blocks)."""

    def dbcache(calibrator=None, **fields):
        return lambda model: compile_dit(model, passes=[passes.DBCache(calibrator=calibrator, **fields)])

    fast = dict(Fn_compute_blocks=1, steps_computation_mask=steps_mask(total_steps=steps, mask_policy="fast"),
                steps_computation_policy="static")
    ultra = dict(fast, steps_computation_mask=steps_mask(total_steps=steps, mask_policy="ultra"))
    return {
        # cache-dit's defaults: F8B0, 8 warm-up steps, threshold 0.08
        "dbcache": dbcache(),
        "dbcache_F1B0_R0.24": dbcache(Fn_compute_blocks=1, residual_diff_threshold=0.24, max_warmup_steps=4),
        "fast_mask": dbcache(**fast),
        "fast_mask_taylorseer": dbcache(TaylorSeerCalibratorConfig(taylorseer_order=1), **fast),
        "ultra_mask_taylorseer": dbcache(TaylorSeerCalibratorConfig(taylorseer_order=1), **ultra),
    }


DEMO_CONFIGS = ("dbcache", "fast_mask", "fast_mask_taylorseer")


def format_table(report: dict) -> str:
    head = ("| config | PSNR mean (min) dB | SSIM mean | blocks executed | cached steps | wall s | speedup | "
            "speedup after the first run |\n|---|---|---|---|---|---|---|---|")
    rows = [head, f"| baseline | - | - | 100% | 0 | {report['baseline']['wall_s']:.2f} | 1.00x | 1.00x |"]
    for name, r in report["configs"].items():
        st = r["stats_mean"]
        frac = st.get("executed_block_fraction")
        rows.append(f"| {name} | {r['psnr_mean']:.2f} ({r['psnr_min']:.2f}) | {r['ssim_mean']:.4f} | "
                    f"{'-' if frac is None else f'{100 * frac:.1f}%'} | {st.get('cached_steps', 0):.1f} | "
                    f"{r['wall_s']:.2f} | {r['speedup']:.2f}x | {r['steady_speedup']:.2f}x |")
    return "\n".join(rows)


def run(configs: Sequence[str], seeds: Sequence[int], labels: Sequence[int], steps: int, out: str,
        true_cfg_scale: float = 1.0) -> dict:
    from .fidelity import run_fidelity

    table = presets(steps)
    unknown = [c for c in configs if c not in table]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; available: {', '.join(table)}")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    t0 = time.perf_counter()
    report = run_fidelity({c: table[c] for c in configs}, seeds=seeds, labels=labels, steps=steps, out_dir=out,
                          true_cfg_scale=true_cfg_scale)
    print(f"# trained digits DiT (FluxTransformer2DModel, 12 blocks) through FluxPipeline, {steps} steps, "
          f"{len(seeds)} seed(s) x {len(labels)} label(s), true CFG {true_cfg_scale}")
    print(format_table(report))
    print(f"grid: {report['grid']}\nplot: {report['plot']}\nreport: {report['report']}  "
          f"({time.perf_counter() - t0:.1f} s in all)")
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
    p.add_argument("--out", default="out/demo")
    return p


def main(argv: Optional[List[str]] = None, prog: str = "dit-passes demo",
         default_configs: Sequence[str] = DEMO_CONFIGS) -> int:
    args = build_parser(prog, default_configs).parse_args(argv)
    if args.list:
        print("\n".join(presets(args.steps)))
        return 0
    run([c.strip() for c in args.configs.split(",") if c.strip()], args.seeds, args.labels, args.steps, args.out,
        args.true_cfg_scale)
    return 0
