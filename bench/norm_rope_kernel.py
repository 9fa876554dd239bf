"""The q / k RMSNorm + rotary embedding kernel (``dit_passes::rms_norm_rope``) on FLUX.1-dev's shapes, on one GPU.

Times the Triton kernel's launch choices (head rows per program x warps) against Inductor compiling the ATen ops
it replaces (``rms_norm_rope_reference`` under ``torch.compile``), on a single block's q (4608 tokens x 24 heads
x 128, bf16, fp32 cos / sin tables broadcast over the heads) and a double block's text + image q (512 + 4096
tokens concatenated), each timed as GPU time in a replayed CUDA graph. GB/s counts one read of x and one write of
the output (the tables are L2-resident).

    python bench/norm_rope_kernel.py --out $OUT [--half-split]  # writes norm_rope_kernel[_half_split].json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import capture  # noqa: E402


def _time_ms(fn, repeats: int = 20) -> float:
    """GPU ms per call: ``repeats`` calls captured in one CUDA graph and replayed (the launches' host time, which
    a CUDA-graph replay of the step hides too, left out)."""
    graph = capture(fn, repeats, warmup=3)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * repeats)


def main() -> int:
    from dit_passes.kernels import norm_rope_triton as k
    from dit_passes.passes.norm_rope import rms_norm_rope_reference

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out/norm_rope_kernel")
    p.add_argument("--half-split", action="store_true", help="the half-split rotation (pairs j, j + D/2) instead")
    a = p.parse_args()
    dev, dt, heads, d = "cuda", torch.bfloat16, 24, 128
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "half_split": a.half_split, "cases": {}}
    for case, parts in (("single", (4608,)), ("double", (512, 4096))):
        g = torch.Generator(device=dev).manual_seed(0)
        xs = [torch.randn(1, n, heads, d, device=dev, dtype=dt, generator=g) for n in parts]
        ws = [torch.randn(d, device=dev, dtype=dt, generator=g) for _ in parts]
        s = sum(parts)
        cos, sin = (torch.randn(1, s, 1, d, device=dev, generator=g) for _ in range(2))
        eps = [1e-6] * len(parts)
        gb = 2 * sum(x.numel() * x.element_size() for x in xs) / 1e9
        ref = rms_norm_rope_reference(xs, ws, eps, cos, sin, 1, half_split=a.half_split)
        inductor = torch.compile(rms_norm_rope_reference)
        rows = {"inductor": _time_ms(lambda: inductor(xs, ws, eps, cos, sin, 1, half_split=a.half_split))}
        out = torch.empty_like(ref)

        def ours(r, w):
            start = 0
            for x, wt, e in zip(xs, ws, eps):
                n = x.shape[1]
                k.rms_norm_rope_into(x, wt, e, cos.expand(out.shape).narrow(1, start, n),
                                     sin.expand(out.shape).narrow(1, start, n), out.narrow(1, start, n),
                                     half_split=a.half_split, rows=r, num_warps=w)
                start += n
        for r in (4, 8, 16, 32, 64):
            for w in (1, 2, 4, 8):
                if r * d // (32 * w) < 1:
                    continue
                ours(r, w)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                rows[f"rows{r}_warps{w}"] = _time_ms(lambda: ours(r, w))
                rows[f"rows{r}_warps{w}_maxrel"] = err
        res["cases"][case] = {"gb": gb, "ms": {n: v for n, v in rows.items() if not n.endswith("maxrel")},
                              "gbps": {n: gb / (v / 1e3) for n, v in rows.items() if not n.endswith("maxrel")},
                              "max_rel_err": max(v for n, v in rows.items() if n.endswith("maxrel"))}
        best = min((v, n) for n, v in res["cases"][case]["ms"].items())
        print(case, f"best {best[1]} {best[0] * 1e3:.1f} us ({gb / (best[0] / 1e3):.0f} GB/s); inductor "
              f"{rows['inductor'] * 1e3:.1f} us; default rows{k.ROWS}_warps{k.WARPS} "
              f"{rows[f'rows{k.ROWS}_warps{k.WARPS}'] * 1e3:.1f} us", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "norm_rope_kernel" + ("_half_split" if a.half_split else "") + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
