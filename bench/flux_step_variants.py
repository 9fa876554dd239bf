"""One FLUX.1-dev-size transformer step on a GPU: bf16 against the quantized linears, and the attention backends.

Run from the repository root on a CUDA machine (diffusers installed, dit_passes importable):

    OUT=/some/dir python bench/flux_step_variants.py [--rows bf16,svdq_r32,fp8_per_row] [--attention]

Rows (all eager, one denoising step at 1024², batch 1, the inputs of ``dit_passes.bench``):

* ``bf16``: the diffusers transformer;
* ``svdq_r32``: ``compile_dit`` with ``SVDQuantW4A4(rank=32, dynamic=True)`` on every block linear, i.e. the Triton
  W4A4 kernels through ``dit_passes::svdq_w4a4_linear``, the AdaLN modulation ones weight-only int8 (W8A16, the
  pass's default; the figures in ``bench/results/flux_step_variants*.json`` predate that: their modulation linears
  stayed bf16);
* ``fp8_per_row``: ``compile_dit`` with ``Fp8Linear("per_row")`` (the modulation linears included).

Each row: pass time (host), median step ms over ``--repeats`` steps after two warm-ups (device sync around
each step), relative error of the output against bf16 (random weights, so only a sanity figure), peak
memory and the bytes of the block-linear weights. ``--attention`` also times ``F.scaled_dot_product_attention``
at the FLUX shape (1 x 24 heads x 4608 tokens x 128) under each SDPA backend, and the bf16 step with each.
Writes ``flux_step_variants.json`` to ``$OUT`` (default bench/results) after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_ms(module, inputs, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            module(**inputs)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def linear_weight_bytes(module) -> int:
    gm = getattr(module, "graph_module", None)
    named = dict(gm.named_parameters()) | dict(gm.named_buffers()) if gm is not None else {}
    if gm is None:
        named = {n: p for n, p in module.named_parameters() if "blocks" in n and "norm" not in n}
    return sum(t.numel() * t.element_size() for n, t in named.items() if "blocks" in n)


def attention_rows(results, repeats: int):
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(1, 24, 4608, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4 * 4608 * 4608 * 128 * 24
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        try:
            backend = getattr(SDPBackend, name)
            with sdpa_kernel([backend]):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                             warmup=25, rep=200, return_mode="median")
            results["attention"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": rel_err(out, ref)}
        except Exception as e:  # noqa: BLE001 - record and go on
            results["attention"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print("attention", name, results["attention"][name], flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="bf16,svdq_r32,fp8_per_row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--attention", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/flux_step_variants.py needs a CUDA GPU")
    from dit_passes import compile_dit
    from dit_passes.bench import build_model, make_inputs
    from dit_passes.passes.quantize import Fp8Linear, SVDQuantW4A4

    out_dir = os.environ.get("OUT") or os.path.join(REPO, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    results = {"command": "python bench/flux_step_variants.py " + " ".join(argv or sys.argv[1:]),
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}, "attention": {}}

    def save():
        with open(os.path.join(out_dir, "flux_step_variants.json"), "w") as f:
            json.dump(results, f, indent=1)

    if args.attention:
        attention_rows(results, args.repeats)
        save()
    model = build_model("full", dev, dtype)
    inputs = make_inputs("full", dev, dtype)
    with torch.inference_mode():
        ref = model(**inputs)[0].float()
    # every row quantizes the same model: keep_original=True keeps it whole for the next (its bf16 weights stay
    # resident, as in the figures recorded before weights were released by default)
    makers = {"bf16": lambda: model,
              "svdq_r32": lambda: compile_dit(model, passes=[SVDQuantW4A4(rank=32, dynamic=True)],
                                              example_inputs=inputs, keep_original=True),
              "fp8_per_row": lambda: compile_dit(model, passes=[Fp8Linear("per_row")], example_inputs=inputs,
                                                 keep_original=True)}
    for name in [r for r in args.rows.split(",") if r]:
        try:
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            module = makers[name]()
            build_s = time.perf_counter() - t0
            with torch.inference_mode():
                out = module(**inputs)[0].float()
            row = {"build_s": build_s, "step_ms": step_ms(module, inputs, args.repeats), "rel_err_vs_bf16": rel_err(out, ref),
                   "block_weight_bytes": linear_weight_bytes(module), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            if name == "bf16" and args.attention:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                    try:
                        with sdpa_kernel([getattr(SDPBackend, backend)]):
                            row[f"step_ms_{backend}"] = step_ms(module, inputs, args.repeats)
                    except Exception as e:  # noqa: BLE001
                        row[f"step_ms_{backend}"] = f"{type(e).__name__}: {str(e)[:200]}"
            del module
        except Exception as e:  # noqa: BLE001 - record and go on with the other rows
            traceback.print_exc()
            row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        results["rows"][name] = row
        print(name, json.dumps(row), flush=True)
        torch.cuda.empty_cache()
        save()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
