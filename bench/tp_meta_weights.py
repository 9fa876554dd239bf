"""Per-rank weight bytes of tensor-parallel FLUX.1-dev, planned on the meta device (no weight allocated).

    .venv/bin/python -P bench/tp_meta_weights.py [--size 2] [--out bench/results]

Each of ``size`` gloo ranks builds FluxTransformer2DModel with the FLUX.1-dev config on ``torch.device("meta")``
in bf16 and runs ``compile_dit(model, passes=[TensorParallel(size, modulation=...)], example_inputs=<meta>)``:
capture and sharding run on shapes only. The weights the lowered graph holds on a rank (each tensor once) are
what that rank keeps resident, and, built with ``weights=<checkpoint>``, exactly what it reads from the
checkpoint (tests/test_weight_source.py checks the equality on tiny models). Ratio: those bytes over the model's
(single-GPU) weight bytes, ``tp2_rank_weight_ratio`` (target <= 0.55), for both modulation modes.
Writes ``tp_meta_weights.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_flux_full import build_meta  # noqa: E402  (the FLUX.1-dev config and 1024x1024 meta inputs)

COMMAND = ".venv/bin/python -P bench/tp_meta_weights.py --size 2"
GIB = 2 ** 30


def _rank(rank: int, world: int, modulation: str) -> dict:
    from dit_passes import compile_dit
    from dit_passes.passes import TensorParallel

    model, inputs = build_meta()
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    t0 = time.perf_counter()
    c = compile_dit(model, passes=[TensorParallel(world, modulation=modulation)], example_inputs=inputs)
    seconds = time.perf_counter() - t0
    gm = c.graph_module
    held = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    tensors = {target: functools.reduce(getattr, target.split("."), gm) for target in held}
    assert all(t.is_meta for t in tensors.values()), "a weight was allocated"
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rec = [r for r in c._current().manager.records if r.name == "tensor_parallel"][0]
    return {"full_bytes": full, "rank_bytes": rank_bytes, "seconds": seconds, "counts": rec.result.counts}


def _all_modes(rank: int, world: int) -> dict:
    return {m: _rank(rank, world, m) for m in ("replicate", "column")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    from dit_passes.testing.multiproc import run_ranks

    from tp_meta_weights import _all_modes as by_module  # importable by the rank processes (not __main__'s)
    per_rank = run_ranks(by_module, args.size, timeout=1800)
    out = {"command": COMMAND, "torch": torch.__version__, "model": "FluxTransformer2DModel, FLUX.1-dev config, bf16",
           "tp_size": args.size}
    lines = ["# Tensor-parallel FLUX.1-dev: weight bytes per rank (meta device, nothing allocated)", "",
             f"Command: `{COMMAND}`", "", "| modulation | single-GPU GiB | rank GiB (each rank) | ratio | "
             "all-reduces / all-gathers a step | lowering s |", "|---|---|---|---|---|---|"]
    for mode in ("replicate", "column"):
        full = per_rank[0][mode]["full_bytes"]
        ranks = [r[mode]["rank_bytes"] for r in per_rank]
        ratio = max(ranks) / full
        key = f"tp{args.size}_rank_weight_ratio" + ("" if mode == "column" else "_modulation_replicate")  # default
        out[key] = round(ratio, 4)
        out[f"tp{args.size}_{mode}_rank_weight_bytes"] = ranks
        out["single_gpu_weight_bytes"] = full
        out[f"tp{args.size}_{mode}_counts"] = per_rank[0][mode]["counts"]
        counts = per_rank[0][mode]["counts"]
        collectives = (f"{counts['all_reduce'] + counts['norm_all_reduce']} / "
                       f"{counts['all_gather'] + counts['norm_all_gather'] + counts['fallback_all_gather']}")
        lines.append(f"| {mode} | {full / GIB:.2f} | {', '.join(f'{b / GIB:.2f}' for b in ranks)} | {ratio:.3f} | "
                     f"{collectives} | {max(r[mode]['seconds'] for r in per_rank):.1f} |")
    lines += ["", f"Host: torch {torch.__version__}, CPU, 1 torch thread per rank (a shared 2-core machine: the lowering "
              "seconds are contended, not a timing result).", "", "Ratio: the largest rank's bytes over the single-GPU weight bytes (target <= 0.55). With "
              "`modulation=\"column\"` (the default) the AdaLN modulation linears, about a quarter of FLUX's "
              "weights, are sharded too, each one's output all-gathered (one all-gather per modulation linear, "
              "small: at most B x 6 x 3072 values); `\"replicate\"` keeps them whole on every rank, no all-gather.",
              "Built with `compile_dit(..., weights=<checkpoint>)` a rank reads exactly these bytes from the "
              "checkpoint (tests/test_weight_source.py checks it on tiny Flux)."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tp_meta_weights.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "tp_meta_weights.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
