"""The fastest-stack table: the fastest FLUX.1-dev-size generation on one GPU, our stacks and their step profile.

Rows (``dit_passes.bench``'s model: FLUX.1-dev config, random bf16 weights, 4096 + 512 tokens, its 28-step toy
loop and forced schedule F8B0, 8 warm-up steps, then always cached: 20 of 28 steps cached):

* ``reference``: the model itself, eager, no cache: the output every row's relative error is measured against;
* ``ours_bf16_eagerstep``: ``compile_dit(DBCache)`` + ``torch_compile={"regional": True}`` (the step's top graph
  eager, one host read of the cache decision per step);
* ``ours_bf16``: the same with ``"mode": "reduce-overhead"``: the step replayed as one CUDA graph, the cache
  decision a conditional node (``dit_passes/infra/cuda_graph_step.py``);
* ``ours_bf16_epilogue``: ``ours_bf16`` plus ``SplitConcatLinear`` and ``FuseLinearGelu`` (still bf16: the single
  blocks' proj_out reads its two parts in place, the MLPs' GELU runs in the GEMM's epilogue);
* ``ours_bf16_rope``: ``ours_bf16_epilogue`` plus ``FuseNormRope`` (the q / k RMSNorm and rotary embedding as one
  op of ours, lossless); ``ours_fp8_rope``: ``ours_fp8`` plus ``FuseNormRope``; ``ours_{bf16,fp8}_pointwise``:
  the ``_rope`` rows plus ``FuseNormModulate`` (AdaLN's LayerNorm + modulation as one op of ours, lossless);
* ``ours_fp8``: ``ours_bf16`` plus ``FuseSiblingLinears`` and ``Fp8Linear`` on every block linear (fast
  accumulation), built last: it releases the bf16 block weights from the model; where torch has no CUDA-graph IF
  nodes, with the step eager.

Each row: capture + passes (``build_s``), the first generation (compile and CUDA-graph capture included, cold
Inductor cache where ``bench/device_env.sh`` set one), the median of ``--repeats`` more, the relative error of
the final latents vs ``reference``, resident and peak GPU bytes. Then the step profile of the graphed step:
wall time per call (back to back, no sync between) against the GPU kernel time torch.profiler records, for a
computed step and a cached step. cache-dit + ``compile_repeated_blocks`` runs in its own process
(``bench/flux_peers.py --rows cacheditregional_always``, same model, inputs and schedule: one process cannot
hold both patched models' compiles cleanly) and ``--peers`` merges its JSON into this table.

``--generation-profile`` profiles one more generation of each bf16 row (:func:`generation_profile`). Measured so
on an H100: a module built after another in the same process loses ~2.6 ms on each computed step where the GPU
enters the conditional node's body (~0.2 ms for the first module): list the row to compare first, or run it alone.

    python bench/fastest_stack.py --out $OUT --peers $OUT/flux_peers.json     # bench/fastest_stack.sh
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict

import torch

from dit_passes import bench as B


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def step_profile(fn: Callable[[], Any], steps: int = 10) -> Dict[str, float]:
    """Wall ms per call over ``steps`` back-to-back calls, and the GPU kernel ms per call in a profiled run
    (``profile_flux_step._profile``'s measure, beside this script)."""
    from profile_flux_step import _profile
    with torch.inference_mode():
        p = _profile(fn, steps)
    return {"wall_ms": p["wall_ms_unprofiled"], "kernel_ms": p["gpu_ms"], "kernels_per_step": p["launches"] / steps}


def generation_profile(module, inputs) -> Dict[str, Any]:
    """One whole generation under torch.profiler: where its wall time goes beyond the steps' kernels. GPU busy
    time is the union of the kernel / copy intervals; idle is the rest of the span between the first and the last.
    Each of the largest idle gaps names the GPU work on either side and the host calls made while the GPU waited
    (a ``cudaGraphLaunch`` in the gap: the host was late; none: the wait is on the device, e.g. a conditional
    node's body launch); device-to-host copies and host syncs counted (the target: none per step)."""
    import collections

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = B.generation(module, inputs)
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    cpu = sorted((e.time_range.start, e.name) for e in events if e.device_type != torch.autograd.DeviceType.CUDA)
    busy, gaps, end = 0.0, [], None
    for i, (t0, t1, name) in enumerate(spans):
        if end is not None and t0 > end:
            gaps.append((t0 - end, end, t0, i))
        if end is None or t0 > end:
            busy += t1 - t0
        elif t1 > end:
            busy += t1 - end
        end = t1 if end is None else max(end, t1)
    span_us = (spans[-1][1] - spans[0][0]) if spans else 0.0
    gaps.sort(reverse=True)

    def gap_detail(g):
        us, g0, g1, i = g
        host = collections.Counter(n for t, n in cpu if g0 <= t < g1)
        return {"us": round(us, 1), "at_ms": round((g0 - spans[0][0]) / 1000, 2),
                "before": [n[:80] for _, _, n in spans[max(0, i - 3):i]],
                "after": [n[:80] for _, _, n in spans[i:i + 2]],
                "host_calls": dict(host.most_common(6))}
    kinds = collections.Counter("memset" if "Memset" in n else "HtoD" if "HtoD" in n else "DtoH" if "DtoH" in n
                                else "DtoD" if "DtoD" in n else "kernel" for _, _, n in spans)
    return {"wall_s": wall, "gpu_span_ms": span_us / 1000, "gpu_busy_ms": busy / 1000,
            "gpu_idle_ms": (span_us - busy) / 1000, "gaps_over_50us": sum(g[0] > 50 for g in gaps),
            "idle_in_gaps_over_50us_ms": sum(g[0] for g in gaps if g[0] > 50) / 1000,
            "top_gaps": [gap_detail(g) for g in gaps[:10]], "gpu_events": dict(kinds),
            "dtoh_copies": kinds.get("DtoH", 0),
            "host_syncs": sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
                              for _, n in cpu),
            "graph_launches": sum(n == "cudaGraphLaunch" for _, n in cpu)}


# our rows are dit-passes bench's (the command users run: dit-passes bench --size full --preset fastest)
ROW_OF = {"ours_bf16_eagerstep": "compiled_regional_always", "ours_bf16": "graphed_regional_always",
          "ours_bf16_epilogue": "graphed_regional_epilogue_always", "ours_fp8": "graphed_regional_fp8_always",
          "ours_bf16_rope": "graphed_regional_epilogue_rope_always",
          "ours_fp8_rope": "graphed_regional_fp8_rope_always",
          "ours_bf16_pointwise": "graphed_regional_epilogue_pointwise_always",
          "ours_fp8_pointwise": "graphed_regional_fp8_pointwise_always"}
# the summary's rows: the bench preset users run (dit-passes bench --preset fastest), its bf16 and its fp8 stack
PRESET_ROWS = [n for n, r in ROW_OF.items() if r in B.PRESETS["fastest"].split(",")]


# one epilogue pass alone (which of the two a finding belongs to): built here, not rows users run
ONE_EPILOGUE = {"ours_bf16_split": "SplitConcatLinear", "ours_bf16_gelu": "FuseLinearGelu"}


def build_row(name: str, model, inputs):
    if name in ONE_EPILOGUE:
        from dit_passes import compile_dit, passes
        chosen = [passes.DBCache(**B.schedules()["always"]), getattr(passes, ONE_EPILOGUE[name])()]
        return ONE_EPILOGUE[name], compile_dit(model, passes=chosen, example_inputs=dict(inputs),
                                               torch_compile={"regional": True, "mode": "reduce-overhead"})
    row = ROW_OF[name]
    if name.startswith("ours_fp8"):  # one fp8 row per process (it releases the bf16 block weights): graphed if it can
        from dit_passes.infra.cuda_graph_step import CudaGraphUnavailable, conditional_capture_mode
        try:
            conditional_capture_mode()
        except CudaGraphUnavailable:
            row = row.replace("graphed_", "compiled_") if name == "ours_fp8" else row  # no eager-step rope row
    return row, B.row_factories(model, inputs, {})[row]()


def measure(name: str, module, inputs, repeats: int, ref) -> Dict[str, Any]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    first, x = B.generation_latents(module, inputs)
    runs = [B.generation(module, inputs) for _ in range(repeats)]
    row = {"first_generation_s": first, "generation_s": statistics.median(runs), "runs_s": runs,
           "resident_gib": torch.cuda.memory_allocated() / 2 ** 30,
           "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
    if ref is not None:
        row["rel_err_vs_reference"] = rel_err(x, ref)
    summary = getattr(module, "cache_summary", None)
    if callable(summary):
        row["cached_steps"] = len(module.cache_summary(as_dict=True)[-1]["cached_steps"])
    return row, x


def write(res: Dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fastest_stack.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Fastest FLUX.1-dev-size generation ({res['gpu']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`", "",
             "| row | first generation s | 28 steps s | rel. err vs uncached | cached steps | resident GiB "
             "| peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:150]} | | | | | |")
            continue
        lines.append(f"| {name} | {r.get('first_generation_s', float('nan')):.2f} | {r['generation_s']:.3f} | "
                     f"{r.get('rel_err_vs_reference', float('nan')):.4f} | {r.get('cached_steps', '')} | "
                     f"{r.get('resident_gib', float('nan')):.2f} | {r.get('peak_gib', float('nan')):.2f} |")
    for name, r in res["rows"].items():
        g = r.get("generation_profile")
        if g:
            lines.append(f"\n{name}, one generation profiled: wall {g['wall_s']:.3f} s, GPU span "
                         f"{g['gpu_span_ms']:.1f} ms, busy {g['gpu_busy_ms']:.1f} ms, idle {g['gpu_idle_ms']:.1f} ms "
                         f"({g['gaps_over_50us']} gaps over 50 us: {g['idle_in_gaps_over_50us_ms']:.1f} ms), "
                         f"{g['dtoh_copies']} device-to-host copies, {g['host_syncs']} host syncs")
    for k in ("compute_step", "cached_step"):
        if k in res:
            p = res[k]
            lines.append(f"\n{k} (graphed): wall {p['wall_ms']:.2f} ms, kernels {p['kernel_ms']:.2f} ms, "
                         f"{p['kernels_per_step']:.0f} kernels")
    lines.append("\n```\n" + json.dumps(res.get("summary", {}), indent=1) + "\n```")
    with open(os.path.join(out, "fastest_stack.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out/fastest")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peers", default=None, help="flux_peers.py's JSON with the cacheditregional_always row")
    p.add_argument("--rows", default="reference,ours_bf16_eagerstep,ours_bf16,ours_bf16_epilogue,profile,ours_fp8")
    p.add_argument("--profile-stack", default="ours_bf16_pointwise", choices=("ours_bf16", "ours_bf16_epilogue",
                                                                         "ours_bf16_rope", "ours_bf16_pointwise"),
                   help="the bf16 stack the profile row's steps use")
    p.add_argument("--generation-profile", action="store_true",
                   help="profile one more generation of each ours_bf16* row (GPU busy / idle, largest gaps)")
    a = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    model = B.build_model("full", dev, dt)
    inputs = B.make_inputs("full", dev, dt)
    res: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "command": "python bench/fastest_stack.py " + " ".join(sys.argv[1:]), "rows": {}}
    ref, latents = None, {}  # latents: each row's final latents, for a reference listed after it
    for name in a.rows.split(","):
        t0 = time.perf_counter()
        try:
            if name == "reference":
                res["rows"][name], ref = measure(name, model, inputs, 1, None)
                for earlier, x in latents.items():  # rows measured before it (the first generation of a process
                    res["rows"][earlier]["rel_err_vs_reference"] = rel_err(x, ref)  # is the row listed first)
            elif name == "profile":  # the graphed step, computed and cached, back to back
                from dit_passes import compile_dit, passes
                extra = [] if a.profile_stack == "ours_bf16" else [passes.SplitConcatLinear(), passes.FuseLinearGelu()]
                extra += [passes.FuseNormRope()] if a.profile_stack in ("ours_bf16_rope", "ours_bf16_pointwise") else []
                extra += [passes.FuseNormModulate()] if a.profile_stack == "ours_bf16_pointwise" else []
                for key, sched in (("compute_step", "never"), ("cached_step", "always")):
                    s = {**B.schedules()[sched], "max_warmup_steps": 1}
                    m = compile_dit(model, passes=[passes.DBCache(**s), *extra], example_inputs=dict(inputs),
                                    torch_compile={"regional": True, "mode": "reduce-overhead"})
                    res[key] = step_profile(lambda: m(**inputs))
                    del m
            else:
                bench_row, module = build_row(name, model, inputs)
                build_s = time.perf_counter() - t0
                row, latents[name] = measure(name, module, inputs, a.repeats, ref)
                if a.generation_profile and name.startswith("ours_bf16"):
                    row["generation_profile"] = generation_profile(module, inputs)
                res["rows"][name] = {"bench_row": bench_row, "build_s": build_s, **row}
                res["rows"][name]["first_generation_s"] += build_s  # capture + passes count in the first one
                del module
        except Exception as e:  # noqa: BLE001 - a failed row is recorded, the others still run
            import traceback
            res["rows"][name] = {"error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-2000:]}
        print(name, json.dumps({k: v for k, v in res["rows"].get(name, {}).items() if k != "trace"}), flush=True)
        torch.cuda.empty_cache()
        write(res, a.out)
    peers = {}
    if a.peers and os.path.exists(a.peers):
        peers = json.load(open(a.peers))["rows"].get("cacheditregional_always", {})
        if "generation_s" in peers:
            res["rows"]["cachedit_compiled (separate process)"] = peers
    rows = res["rows"]

    def get(row, key):
        return rows.get(row, {}).get(key)
    # the summary's bf16 row: the fastest preset's stack (with the epilogue passes) where this run measured it
    def pick(prefix):  # the preset's row of this precision where measured, else the first measured one
        names = [n for n in PRESET_ROWS if n.startswith(prefix)] + [n for n in rows if n.startswith(prefix)]
        return next((n for n in names if get(n, "generation_s") is not None), None)
    best, fp8 = pick("ours_bf16"), pick("ours_fp8")
    res["summary"] = {
        "cachedit_compiled_s": peers.get("generation_s"), "cachedit_compiled_first_s": peers.get("first_generation_s"),
        "ours_bf16_s": get(best, "generation_s"), "ours_bf16_first_s": get(best, "first_generation_s"),
        "ours_bf16_row": best,
        "ours_fp8_s": get(fp8, "generation_s"), "ours_fp8_row": fp8,
        "cached_step_wall_ms": res.get("cached_step", {}).get("wall_ms"),
        "cached_step_kernel_ms": res.get("cached_step", {}).get("kernel_ms"),
        "compute_step_wall_ms": res.get("compute_step", {}).get("wall_ms"),
        "compute_step_kernel_ms": res.get("compute_step", {}).get("kernel_ms")}
    write(res, a.out)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
