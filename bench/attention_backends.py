"""Time ``F.scaled_dot_product_attention`` per backend at FLUX.1-dev's attention shape on the GPU.

FLUX.1-dev at 1024²: 4096 image + 512 text tokens, 24 heads of 128 channels, bf16; q, k, v laid out as
the transformer hands them over ((B, S, H, D) memory viewed as (B, H, S, D)). Per backend: median time of
``--iters`` calls (CUDA events), effective TFLOP/s (4·S²·D·H flops), the output's strides, and the max
error relative to the fp32 math kernel. Also ``dit_passes::sdpa_backend`` (the AttentionBackend pass's op)
with cuDNN first, to show the op adds nothing. Writes ``--out`` (JSON) and prints a markdown table.

    python bench/attention_backends.py --out bench/results/attention_backends_h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4608)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="attention_backends.json")
    a = p.parse_args(argv)
    from dit_passes.passes import attention_backend  # noqa: F401  registers dit_passes::sdpa_backend

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, a.tokens, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
               .transpose(1, 2) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4 * a.tokens ** 2 * a.head_dim * a.heads
    calls = {name: (lambda b=b: _with(b, q, k, v)) for name, b in (
        ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    calls["default"] = lambda: F.scaled_dot_product_attention(q, k, v)
    calls["sdpa_backend_op"] = lambda: torch.ops.dit_passes.sdpa_backend(q, k, v, None, False, None,
                                                                      "cudnn,flash,efficient,math")
    rows = {}
    for name, fn in calls.items():
        try:
            out = fn()
            ms = _time(fn, a.iters)
            rows[name] = {"ms": ms, "tflops": flops / ms / 1e9, "stride": list(out.stride()),
                          "max_rel_err_vs_fp32": ((out.float() - ref).abs().max() / ref.abs().max()).item()}
        except RuntimeError as e:
            rows[name] = {"error": str(e)[:300]}
        print(name, rows[name], flush=True)
    res = {"shape": [1, a.heads, a.tokens, a.head_dim], "dtype": "bfloat16", "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "command": " ".join(sys.argv),
           "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("| backend | ms | TFLOP/s | max rel err vs fp32 |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | " + (f"{r['ms']:.3f} | {r['tflops']:.0f} | {r['max_rel_err_vs_fp32']:.1e} |" if "ms" in r
                                else f"error: {r['error'][:80]} | | |"))
    return 0


def _with(backend, q, k, v):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v)


def _time(fn, iters):
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
