"""Image fidelity of the quantization passes on the trained digits DiT (PSNR / SSIM vs the fp32 model).

    .venv/bin/python bench/quant_fidelity.py [--steps 28] [--seeds 0 1 2] [--out bench/results] [--modulation M]

Samples the trained digits FluxPipeline (dit_passes.models.digits, 4 double + 8 single blocks, hidden
size 64) with the unquantized transformer and with every config below, same seeds and labels (one image
per digit 0..9 per seed), and writes ``quant_fidelity.json`` + ``quant_fidelity.md`` (the grid of
images goes to ``<out>/quant_fidelity/``). The PTQ configs calibrate on a separate seed (1000), all ten
digits, through the pipeline holding the original transformer.

Configs: SVDQuant W4A4 PTQ rank 16 and 32, SVDQuant W4A4 DQ rank 32 (no calibration, weight-only
smoothing), plain W4A4 (rank 0, no smoothing: the baseline SVDQuant improves on), the same three (rank 32) in NVFP4
(``precision="nvfp4"``: e2m1 values, e4m3 scales per 16, fp32 global; the reference on CPU), fp8 e4m3 per row,
int8 per row. All quantize the same linears: every linear of the 12 blocks (their K is 64 or a multiple, so none
is skipped for int4); embedders and the final projection stay. The AdaLN modulation linears (``--modulation``):
``w8a16`` (default, the passes' default) SVDQuant gives them weight-only int8 per row, fp8 / int8 their own form;
``w4a16`` SVDQuant weight-only int4; ``w4a16_lr`` weight-only int4 of the residual after a low-rank branch of the
config's rank; ``svdq`` (or ``--modulation`` alone) W4A4 like the rest; ``none`` none of the
configs quantizes them. ``svdq_r32_ptq_fused`` / ``svdq_r32_dq_fused``: ``FuseSiblingLinears`` first (the step
benchmark's fused rows; SVDQuant gives a fused linear rank x members: 96 / 128, capped at K = 64 here, so
their branch holds the whole weight); ``svdq_r8_*``: rank 8 unfused and fused (24 / 32 < K: a comparison that still
truncates). ``stack_dbcache`` / ``stack_dbcache_fp8``: the fastest preset's stacks (DBCache's forced schedule
F8B0, 8 warm-up steps, then always cached; and the same with sibling linears fused and fp8 per row);
``stack_fastest`` / ``stack_fastest_fp8``: the bench preset's stacks, those plus the lossless fusions
(SplitConcatLinear, FuseLinearGelu, FuseNormRope, FuseNormModulate; on the CPU their ops are the ATen ops they
replace).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time

import torch

COMMAND = ".venv/bin/python bench/quant_fidelity.py"
CALIB_SEED = 1000
NUMERICS = {"auto": "W4A4 (true 4-bit activations, the reference)",
            "fp8": "W4A8 (Hopper design: int4 weights expanded to e4m3, e4m3 activations per token)",
            "lrcat": "W4A8 lrcat (Hopper design: int4 weights expanded to e4m3, e4m3 activations per token, the "
                     "low-rank branch folded into the GEMM's K in e4m3)",
            "lrcat_split": "W4A8 lrcat_split (as lrcat, the branch's operands as e4m3 hi / lo pairs: 3R columns)",
            "lut": "W4A8 lut (Hopper design: int4 weights read through per-group e4m3 tables inside the GEMM, e4m3 "
                   "activations per token, the branch in K as int4 digit planes of lora_up against the e4m3 hi / lo "
                   "of h; lut_planes=2: against h in e4m3)"}


def svdq_forms(form: str, act_quant: str, precision: str = "int4") -> dict:
    """SVDQuantW4A4's form arguments for ``--w4a4-backend`` / ``--act-quant`` (only those the configuration writes:
    the pass refuses one it would not act on)."""
    if precision == "nvfp4":  # written as the op or the fp8 split GEMM
        return {"form": form if form in ("auto", "op", "fp8") else "op"}
    out = {"form": form}
    if form in ("auto", "fp8", "lrcat", "lrcat_split", "lut"):
        out["act_quant"] = "kernel" if act_quant == "mm" else act_quant
    if form in ("auto", "lrcat", "lrcat_split"):
        out["lrcat_act"] = "mm" if act_quant == "mm" else "stats"
    return out


def make_configs(pipe, steps: int, workdir: str, built: dict, modulation: str = "w8a16", form: str = "auto",
                 act_quant: str = "graph"):
    from dit_passes import compile_dit
    from dit_passes.models.digits import sample
    from dit_passes.bench import schedules
    from dit_passes.passes import (DBCache, FuseLinearGelu, FuseNormModulate, FuseNormRope, FuseSiblingLinears,
                                   SplitConcatLinear)
    from dit_passes.passes.quantize import Fp8Linear, Int8Linear, SVDQuantW4A4

    exclude = ("modulation",) if modulation == "none" else ()
    mod = dict(modulation=None if modulation == "none" else modulation)
    svdq, nvfp4 = {**mod, **svdq_forms(form, act_quant)}, {**mod, **svdq_forms(form, act_quant, "nvfp4")}
    fp8 = {"act_quant": "kernel" if act_quant == "mm" else act_quant}

    def calibrate():
        # Runs inside the first call of the quantized module, i.e. in the middle of a pipeline run: it
        # gets its own scheduler (sharing the outer run's would reset its step index) and the original
        # transformer (the pipeline components still hold it).
        from diffusers import FluxPipeline

        own = FluxPipeline(**{**pipe.components, "scheduler": copy.deepcopy(pipe.scheduler)})
        own.set_progress_bar_config(disable=True)
        sample(own, list(range(10)), seed=CALIB_SEED, steps=steps, cond=pipe.digits_cond)

    def ptq(rank, precision="int4", tag=""):  # tag: its own serialization folder (another graph, other tables)
        return lambda: SVDQuantW4A4(rank=rank, calibrate_fn=calibrate, precision=precision,
                                    serialize_to=os.path.join(workdir, f"{precision}_r{rank}{tag}"),
                                    **(nvfp4 if precision == "nvfp4" else svdq))

    makers = {
        "svdq_r16_ptq": ptq(16),
        "svdq_r32_ptq": ptq(32),
        "svdq_r32_dq": lambda: SVDQuantW4A4(rank=32, dynamic=True, **svdq),
        # the Hopper step rows' stack: q / k / v (+ proj_mlp) fused first, SVDQuant of the concatenated weights
        "svdq_r32_ptq_fused": lambda: [FuseSiblingLinears(), ptq(32, tag="_fused")()],
        "svdq_r32_dq_fused": lambda: [FuseSiblingLinears(), SVDQuantW4A4(rank=32, dynamic=True, **svdq)],
        # rank 8: the fused linears' rank x members (24 / 32) stays below K = 64, unlike rank 32's (96 / 128: their
        # low-rank branch then holds the whole weight), so this pair compares the two at a rank that still truncates
        "svdq_r8_ptq": ptq(8),
        "svdq_r8_ptq_fused": lambda: [FuseSiblingLinears(), ptq(8, tag="_fused")()],
        "svdq_r8_dq": lambda: SVDQuantW4A4(rank=8, dynamic=True, **svdq),
        "svdq_r8_dq_fused": lambda: [FuseSiblingLinears(), SVDQuantW4A4(rank=8, dynamic=True, **svdq)],
        "w4a4_plain_r0": lambda: SVDQuantW4A4(rank=0, dynamic=True, smooth="none", **svdq),
        "svdq_nvfp4_r32_ptq": ptq(32, "nvfp4"),
        "svdq_nvfp4_r32_dq": lambda: SVDQuantW4A4(rank=32, dynamic=True, precision="nvfp4", **nvfp4),
        "nvfp4_plain_r0": lambda: SVDQuantW4A4(rank=0, dynamic=True, smooth="none", precision="nvfp4", **nvfp4),
        "fp8_per_row": lambda: Fp8Linear("per_row", exclude=exclude, **fp8),
        "int8_per_row": lambda: Int8Linear(exclude=exclude),
        # the fastest preset's stacks (dit-passes bench --preset fastest): its forced schedule (F8B0, 8 warm-up steps, then
        # always cached) alone, and with the fp8 linears of the fp8 row (sibling linears fused first)
        "stack_dbcache": lambda: [DBCache(**schedules()["always"])],
        "stack_dbcache_fp8": lambda: [DBCache(**schedules()["always"]), FuseSiblingLinears(),
                                      Fp8Linear("per_row", exclude=exclude, **fp8)],
        # the preset's full stacks: plus the lossless fusions (epilogues, q / k RMSNorm + RoPE as one op)
        "stack_fastest": lambda: [DBCache(**schedules()["always"]), SplitConcatLinear(), FuseLinearGelu(),
                                  FuseNormRope(), FuseNormModulate()],
        "stack_fastest_fp8": lambda: [DBCache(**schedules()["always"]), FuseSiblingLinears(),
                                      Fp8Linear("per_row", exclude=exclude, **fp8), FuseNormRope(), FuseNormModulate()],
    }

    def config(name, make_pass):
        def build(original):
            made = make_pass()
            module = compile_dit(original, passes=made if isinstance(made, list) else [made],
                                 keep_original=True)  # the next configs reuse it
            built[name] = module
            return module
        return build

    return {name: config(name, mk) for name, mk in makers.items()}


def pass_result(module):
    records = module._current().manager.records
    # the quantization pass's record (a stack also holds cache / fusion passes), else the last one
    rec = next((r for r in reversed(records) if "replaced" in r.result.counts), records[-1])
    return {"counts": dict(rec.result.counts), "report": rec.result.report}


def quantized_linears(module):
    gm = module.graph_module
    out = {}
    for n in gm.graph.nodes:  # the node that took a linear's place: an op, or the last node of a graph form
        if n.op == "call_function" and n.meta.get("dit_quant"):
            out.setdefault(n.meta["dit_quant"], []).append(n.meta.get("dit_module_path"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="quant_fidelity", help="base name of the .json / .md / grid folder")
    ap.add_argument("--w4a4-backend", choices=tuple(NUMERICS), default="auto",
                    help="fp8: SVDQuant's linears in the Hopper design's numerics (W4A8, e4m3 activations per token); "
                         "lrcat: the same with the low-rank branch in the GEMM's K (e4m3 branch); lrcat_split: "
                         "the branch as e4m3 hi / lo pairs")
    ap.add_argument("--modulation", nargs="?", const="svdq", default="w8a16",
                    choices=("w8a16", "w4a16", "w4a16_lr", "svdq", "none"),
                    help="the AdaLN modulation linears under SVDQuant: weight-only int8 (default), weight-only int4, "
                         "weight-only int4 + low-rank branch (w4a16_lr), "
                         "W4A4 like the rest (the flag alone), or none (every config leaves them unquantized)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these configs (e.g. svdq_r32_ptq svdq_r32_dq)")
    ap.add_argument("--act-quant", choices=("graph", "kernel", "mm"), default="graph",
                    help="kernel: the fp8 / lrcat forms' activations through their ops (act_quant='kernel'; "
                         "on the CPU the ops' references, the kernels' specifications); mm: the lrcat A operand "
                         "from the smoothed activation in x.dtype and aten.mm (lrcat_act='mm')")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from dit_passes.fidelity import run_fidelity
    from dit_passes.models.digits import load_digits_pipeline

    pipe, _ = load_digits_pipeline()
    built: dict = {}
    labels = list(range(10))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        configs = make_configs(pipe, args.steps, work, built, args.modulation, args.w4a4_backend, args.act_quant)
        if args.only:
            unknown = set(args.only) - set(configs)
            if unknown:
                raise SystemExit(f"--only: unknown config(s) {sorted(unknown)}; known: {sorted(configs)}")
            configs = {k: v for k, v in configs.items() if k in args.only}
        report = run_fidelity(configs, seeds=args.seeds, labels=labels,
                              steps=args.steps, out_dir=os.path.join(args.out, args.name), pipe=pipe)
    wall = time.perf_counter() - t0
    linears = max((quantized_linears(m) for m in built.values()), key=len)  # a cache-only stack quantizes none
    paths = sorted({p for ps in linears.values() for p in ps})
    all_linears = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    k_dims = sorted({all_linears[p].in_features for p in paths})
    not_quantized = sorted(set(all_linears) - set(paths))
    result = {
        "command": COMMAND + (f" --steps {args.steps}" if args.steps != 28 else "")
        + (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds != [0, 1, 2] else "")
        + (f" --name {args.name}" if args.name != "quant_fidelity" else "")
        + (f" --w4a4-backend {args.w4a4_backend}" if args.w4a4_backend != "auto" else "")
        + (f" --modulation {args.modulation}" if args.modulation != "w8a16" else "")
        + (f" --only {' '.join(args.only)}" if args.only else "")
        + (f" --act-quant {args.act_quant}" if args.act_quant != "graph" else ""),
        "w4a4_numerics": NUMERICS[args.w4a4_backend],
        "modulation": args.modulation, "modulation_quantized": args.modulation != "none",
        "model": "digits FluxTransformer2DModel (4 double + 8 single blocks, hidden 64), fp32, CPU",
        "steps": args.steps, "seeds": args.seeds, "labels": labels, "num_samples": report["num_samples"],
        "calibration": {"seed": CALIB_SEED, "labels": labels, "steps": args.steps},
        "quantized_linears": paths, "quantized_k_dims": k_dims, "not_quantized": not_quantized,
        "configs": {name: {k: report["configs"][name][k] for k in ("psnr_mean", "psnr_min", "ssim_mean",
                                                                     "ssim_min", "max_abs_diff")}
                    | pass_result(built[name]) for name in built},
        "grid": report["grid"], "wall_s": wall,
        "host": f"torch {torch.__version__}, Python {platform.python_version()}, 1 torch thread",
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(render_markdown(result))
    print(render_markdown(result))
    return 0


def render_markdown(r: dict) -> str:
    lines = ["# Quantization fidelity on the trained digits DiT", "",
             f"Command: `{r['command']}`", "",
             f"{r['model']}; FluxPipeline, {r['steps']} steps, seeds {r['seeds']}, digits 0..9 "
             f"({r['num_samples']} images per config), compared with the unquantized model's images from the "
             f"same noise. PTQ calibration: seed {r['calibration']['seed']}, digits 0..9, {r['steps']} steps.", "",
             f"SVDQuant numerics: {r.get('w4a4_numerics', 'W4A4')}.", "",
             "| config | PSNR mean (dB) | PSNR min | SSIM mean | SSIM min | max abs diff | linears | bytes (quantized / fp32) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in r["configs"].items():
        cnt = c["counts"]
        lines.append(f"| {name} | {c['psnr_mean']:.2f} | {c['psnr_min']:.2f} | {c['ssim_mean']:.4f} | "
                     f"{c['ssim_min']:.4f} | {c['max_abs_diff']:.4f} | {cnt.get('replaced', 0)} | "
                     f"{cnt.get('bytes_after', 0)} / {cnt.get('bytes_before', 0)} |")
    skipped = max(c["counts"].get("skipped_k", 0) for c in r["configs"].values())
    roles = {k[len("replaced_"):]: v for k, v in next(iter(r["configs"].values()))["counts"].items()
             if k.startswith("replaced_")}
    svdq_kinds = ", ".join(f"{k[len('kind_'):]}={v}" for k, v in sorted(r["configs"].get("svdq_r32_dq", {}).get(
        "counts", {}).items()) if k.startswith("kind_"))
    which = {"w8a16": "the AdaLN modulation ones included (SVDQuant: weight-only int8 per row, W8A16; fp8 / int8: "
                      "their own form)",
             "w4a16": "the AdaLN modulation ones included (SVDQuant: weight-only int4, W4A16; fp8 / int8: their own "
                      "form)",
             "w4a16_lr": "the AdaLN modulation ones included (SVDQuant: weight-only int4 of the residual after a "
                         "low-rank branch of the config's rank, W4A16_LR; fp8 / int8: their own form)", "svdq": "the AdaLN modulation ones included (SVDQuant: W4A4 like the rest)",
             "none": "except the AdaLN modulation ones"}[r.get("modulation") or
                                                          ("svdq" if r.get("modulation_quantized") else "none")]
    lines += ["", f"Quantized linears ({len(r['quantized_linears'])}, every config the same): every linear of "
              f"the 12 blocks {which}; per role " +
              ", ".join(f"{k}={v}" for k, v in sorted(roles.items())) +
              f"; SVDQuant's by kind {svdq_kinds or 'svdq_w4a4 (all)'}. Their K are {r['quantized_k_dims']}; int4 "
              f"skipped {skipped} linear(s) for K % 64 != 0. Not quantized "
              f"({len(r['not_quantized'])}): " + ", ".join(f"`{p}`" for p in r["not_quantized"]) + ".", "",
              "Notes: the bytes column counts the quantized tensors against the same linears' fp32 weights; at "
              "hidden size 64 a rank-32 low-rank branch is half the width, so W4A4 saves little here (on "
              "a FLUX-size 3072x3072 linear the rank-32 factors are ~2% of its bf16 weight). W4A4 runs the reference op "
              "on CPU (the same arithmetic as the Triton kernels).", "",
              f"Grid: `{r['grid']}`. Wall time {r['wall_s']:.0f} s on {r['host']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
