"""What the lrcat design's extra K columns cost the fp8 GEMM: ``torch._scaled_mm`` (row-wise scales, bf16
bias, fast accumulation) at FLUX.1-dev's M = 4608 on the fused step's shapes, K grown by the branch's columns (rank 32:
96 split; the fused linears' rank x members: 288 / 384) and by the same rounded up to a multiple of 128 (is it the
columns or the alignment of K?). Kernel time by CUDA events over back-to-back calls; one GPU.

    python3 bench/fp8_gemm_k_growth.py --out $OUT      # -> fp8_gemm_k_growth.json, ~20 s
"""
from __future__ import annotations

import argparse
import json
import os

import torch

M = 4608
# (N, K, extra column counts): the single blocks' fused q/k/v/proj_mlp (rank 128 fused), the double blocks' fused
# q/k/v (rank 96), their attention out projection and the MLP down projections (rank 32)
CASES = ((21504, 3072, (0, 96, 128, 384)), (9216, 3072, (0, 96, 128, 288, 384)), (3072, 3072, (0, 96, 128)),
         (3072, 12288, (0, 96, 128)), (3072, 15360, (0, 96, 128)))


def time_ms(fn, repeats: int = 50, batch: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats // batch):
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / batch)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_k_growth: needs a CUDA GPU with fp8 tensor cores (sm_89+)")
    rows = []
    for n, k, extras in CASES:
        base = None
        for extra in extras:
            kk = k + extra
            a = torch.randn(M, kk, device="cuda").to(torch.float8_e4m3fn)
            b = torch.randn(n, kk, device="cuda").to(torch.float8_e4m3fn)
            sa, sb = torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            ms = time_ms(lambda: torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True))
            base = ms if extra == 0 else base
            row = dict(n=n, k=k, extra_cols=extra, k_total=kk, k_mod_128=kk % 128, ms=round(ms, 4),
                       tflops=round(2 * M * n * kk / ms / 1e9, 1), vs_k=round(ms / base, 4),
                       cols_share=round(kk / k, 4))
            rows.append(row)
            print(row, flush=True)
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, m=M, rows=rows,
               command="python3 bench/fp8_gemm_k_growth.py --out $OUT")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_gemm_k_growth.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
