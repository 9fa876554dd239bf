"""SVDQuant's int4 -> e4m3 weight expansion (``dit_passes::w4_lrcat_to_e4m3``, the Hopper default's B operand) on
FLUX.1-dev's linear shapes, on one GPU: where the expansion's time in a step goes.

Times, as GPU time in a replayed CUDA graph (``bench/norm_rope_kernel.py``'s ``_time_ms``) over enough distinct weights
that the int4 input is not in L2, each form of the kernel (``FORM``: a thread converts a packed byte or an int32 word)
at each of its autotune configurations, against two ATen copies of the same bytes (a broadcast copy reading K/2 and
writing K bytes a row; a plain copy of 0.75 K bytes each way). ``step_ms`` sums each variant over the linears of one
FLUX step (19 double blocks x 2 streams x 4 linears, 38 single blocks x 2), comparable with the profile's figure.

    python bench/w4_expand_kernel.py --out $OUT      # writes w4_expand_kernel.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from norm_rope_kernel import _time_ms  # noqa: E402

# (N, K) -> linears of that shape in one FLUX.1-dev step (q / k / v fused, the single blocks' qkv + MLP fused)
SHAPES = {(9216, 3072): 38, (3072, 3072): 38, (12288, 3072): 38, (3072, 12288): 38, (21504, 3072): 38,
          (3072, 15360): 38}
RANK = 32


def _gemv(l2_bytes: float) -> dict:
    """The modulation linears' weight-only int4 GEMV (``w4a16_rows_linear``, the same step's "GEMV" 1.9 ms): GB/s of
    its autotuned launch per FLUX shape (one conditioning row, bf16) and the step's sum."""
    from dit_passes.kernels import w4a16_rows_triton as w

    out, step = {}, 0.0
    for (n, kk), count in {(18432, 3072): 38, (9216, 3072): 38}.items():
        copies = max(2, int(l2_bytes // (n * kk // 2)) + 1)
        g = torch.Generator(device="cuda").manual_seed(1)
        qws = [torch.randint(0, 256, (n, kk // 2), device="cuda", dtype=torch.uint8, generator=g)
               for _ in range(copies)]
        ws = torch.rand(n, kk // 64, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(1, kk, device="cuda", generator=g).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        it = {"i": 0}

        def call():
            it["i"] += 1
            w.w4a16_rows_linear(x, qws[it["i"] % copies], ws, bias)
        ms = _time_ms(call)
        gb = (n * kk / 2 + n * kk // 64 * 2) / 1e9
        out[f"{n}x{kk}"] = {"count": count, "ms": ms, "gbps": gb / (ms / 1e3)}
        step += count * ms
        print(f"gemv {n}x{kk}: {ms * 1e3:.1f} us ({gb / (ms / 1e3):.0f} GB/s)", flush=True)
    out["step_ms"] = step
    print(f"gemv step: {step:.2f} ms", flush=True)
    return out


def main() -> int:
    import triton

    from dit_passes.kernels import w4_expand_triton as k

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="out/w4_expand_kernel")
    p.add_argument("--l2-bytes", type=float, default=200e6, help="distinct int4 weights per shape (past L2)")
    a = p.parse_args()
    dev = "cuda"
    tuner = k._w4_expand_kernel
    configs = list(tuner.configs)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shapes": {}, "step_ms": {}}
    for (n, kk), count in SHAPES.items():
        copies = max(2, int(a.l2_bytes // (n * kk // 2)) + 1)
        g = torch.Generator(device=dev).manual_seed(0)
        qws = [torch.randint(0, 256, (n, kk // 2), device=dev, dtype=torch.uint8, generator=g) for _ in range(copies)]
        ws = torch.rand(n, kk // 64, device=dev, generator=g).to(torch.bfloat16)
        lu = torch.randn(n, RANK, device=dev, generator=g).to(torch.bfloat16) * 0.01
        c = torch.rand(RANK, device=dev, generator=g) + 0.5
        gb = (n * kk * 1.5 + n * (kk // 64) * 2 + n * (3 * RANK) * 1) / 1e9
        rows, it = {}, {"i": 0}

        def call(form):
            qw = qws[it["i"] % copies]
            it["i"] += 1
            return k.w4_lrcat_to_e4m3(qw, ws, lu, c, split=True, form=form)

        want = k.w4_lrcat_to_e4m3(qws[0], ws, lu, c, split=True, form="bytes")
        for form in ("bytes", "words"):
            for cfg in configs:
                tuner.configs, tuner.cache = [cfg], {}  # one config: no autotuning, this launch
                got = k.w4_lrcat_to_e4m3(qws[0], ws, lu, c, split=True, form=form)
                same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1],
                                                                                                       want[1])
                name = f"{form}_bn{cfg.kwargs['BLOCK_N']}_w{cfg.num_warps}"
                rows[name] = {"ms": _time_ms(lambda: call(form)), "bytes_equal": same}
        tuner.configs, tuner.cache = configs, {}
        dst = torch.empty(n, kk // 2, 2, device=dev, dtype=torch.uint8)

        def broadcast_copy():
            it["i"] += 1
            dst.copy_(qws[it["i"] % copies][..., None].expand(n, kk // 2, 2))
        rows["aten_broadcast_copy"] = {"ms": _time_ms(broadcast_copy)}
        src = torch.empty(n, kk * 3 // 4, device=dev, dtype=torch.uint8)
        dst2 = torch.empty_like(src)
        rows["aten_copy"] = {"ms": _time_ms(lambda: dst2.copy_(src))}
        for r in rows.values():
            r["gbps"] = gb / (r["ms"] / 1e3)
        best = min((r["ms"], name) for name, r in rows.items() if not name.startswith("aten"))
        print(f"{n}x{kk}: best {best[1]} {best[0] * 1e3:.1f} us ({gb / (best[0] / 1e3):.0f} GB/s); broadcast copy "
              f"{rows['aten_broadcast_copy']['ms'] * 1e3:.1f} us; copy {rows['aten_copy']['ms'] * 1e3:.1f} us", flush=True)
        res["shapes"][f"{n}x{kk}"] = {"count": count, "gb": gb, "rows": rows}
        for name, r in rows.items():
            res["step_ms"][name] = res["step_ms"].get(name, 0.0) + count * r["ms"]
    best_per_shape = sum(s["count"] * min(r["ms"] for nm, r in s["rows"].items() if not nm.startswith("aten"))
                         for s in res["shapes"].values())
    res["step_ms"]["best_per_shape"] = best_per_shape
    for name, ms in sorted(res["step_ms"].items(), key=lambda t: t[1]):
        print(f"step {name}: {ms:.2f} ms")
    res["gemv"] = _gemv(a.l2_bytes)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "w4_expand_kernel.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
