"""Where a compiled FLUX.1-dev-size step spends its GPU time.

Builds the bench's full-size FluxTransformer2DModel (random bf16 weights, 4096 + 512 tokens), lowers it with
``compile_dit(passes=[DBCache(F8B0, W8, threshold 0 | forced)], torch_compile={"regional": True})`` and profiles
``--steps`` back-to-back compute steps and cached steps with torch.profiler (and timed without it). CUDA kernel time is grouped by what the kernel does
(GEMM: cuBLAS / CUTLASS / Triton mm templates; attention: cuDNN / flash / efficient; Inductor's fused
pointwise + reduction kernels; copies; the rest), with the top kernels by time, and set against the FLOP floor
of the step's linears and attentions at the GEMM and attention rates measured in the same run.

    python bench/profile_flux_step.py --steps 10 --out bench/results/flux_step_profile_h200.json   # bench/profile_flux_step.sh
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch


def _category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("fmha", "flash", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "sm90_xmma", "cutlass", "triton_mm", "triton_tem", "cublas", "matmul")):
        return "gemm"
    if "w4_expand" in n:  # kernels/w4_expand_triton.py: SVDQuant's int4 weights to e4m3, per call
        return "w4_expand"
    if ("triton" in n and "amax" in n) or "rowquant" in n or n.startswith("_lrcat_"):
        # a fused activation quantization (its per-token scale is an amax: fp8 / SVDQuant rows), or
        # dit_passes::fp8_quantize_rows' kernels (kernels/fp8_rowquant_triton.py), the lrcat A operand's
        # (kernels/lrcat_act_triton.py: _lrcat_stats_kernel, _lrcat_quant_kernel; not Inductor's producers of it,
        # whose names carry the op's, lrcat_quantize_rows)
        return "quantize"
    if n.startswith("triton_") or "triton" in n:
        return "inductor_fused"
    if any(s in n for s in ("memcpy", "memset", "copy", "cat")):
        return "copy"
    return "other"


def _profile(fn, steps: int):
    """GPU kernel time per call over ``steps`` back-to-back calls, against the wall time per call (a gap between
    the two is GPU idle time: host launch overhead or syncs)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    calls = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time / steps  # us
            calls[e.name] += 1 / steps
    cats = collections.Counter()
    for name, us in kernels.items():
        cats[_category(name)] += us
    top = [{"kernel": k[:160], "ms": us / 1000, "calls": round(calls[k]), "category": _category(k)}
           for k, us in kernels.most_common(15)]
    return {"steps": steps, "wall_ms_unprofiled": wall_ms, "gpu_ms": sum(kernels.values()) / 1000, "by_category_ms": {k: v / 1000 for k, v in cats.most_common()},
            "kernels": len(kernels), "launches": round(sum(calls.values())), "top": top}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="flux_step_profile.json")
    p.add_argument("--steps", type=int, default=10, help="back-to-back calls profiled (and timed) per row")
    a = p.parse_args(argv)
    from dit_passes import compile_dit, passes
    from dit_passes.bench import build_model, make_inputs, schedules

    dev, dt = torch.device("cuda"), torch.bfloat16
    model = build_model("full", dev, dt)
    kw = make_inputs("full", dev, dt)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    t0 = time.perf_counter()
    # "always" with warm-up 1: the first call computes, every later call takes the cached branch
    compute = compile_dit(model, passes=[passes.DBCache(**schedules()["never"])], example_inputs=kw,
                          torch_compile={"regional": True})
    cached = compile_dit(model, passes=[passes.DBCache(**{**schedules()["always"], "max_warmup_steps": 1})],
                         example_inputs=kw, torch_compile={"regional": True})
    res["build_s"] = time.perf_counter() - t0
    with torch.inference_mode():
        res["compute_step"] = _profile(lambda: compute(**kw), a.steps)
        res["cached_step"] = _profile(lambda: cached(**kw), a.steps)
        n = 4608
        x = torch.randn(n, 3072, device=dev, dtype=dt)
        w = torch.randn(12288, 3072, device=dev, dtype=dt)
        torch.nn.functional.linear(x, w)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            torch.nn.functional.linear(x, w)
        e.record()
        e.synchronize()
        gemm_tflops = 2 * n * 3072 * 12288 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12
    # the step's FLOPs: every linear of the 19 double + 38 single blocks over 4608 tokens (226.5 MFLOP/token
    # per block either kind), and 57 attentions of 4 S^2 D H
    linear_flops = 57 * 4608 * 2 * 3072 * (3 * 3072 + 3072 + 2 * 12288)
    attn_flops = 57 * 4 * 4608 ** 2 * 128 * 24
    res["floor"] = {"gemm_tflops_measured": gemm_tflops, "linear_ms_at_that_rate": linear_flops / gemm_tflops / 1e9,
                    "attention_ms_at_612_tflops": attn_flops / 612e12 * 1e3}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
