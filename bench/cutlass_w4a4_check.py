"""Device check + benchmark of the CUTLASS W4A4 (fp8 groupwise) GEMM, kernels/w4a4_cutlass.{cu,py}.

Needs CUDA on an sm_90 GPU, nvcc (CUDA_HOME / PATH / /usr/local/cuda) and the nvidia-cutlass headers
(``pip install --target /tmp/site nvidia-cutlass==4.2.0.0`` + ``PYTHONPATH=/tmp/site``), and dit_passes
installed (``pip install --no-deps --no-build-isolation -e .``). Run from the repo root with
``PYTHONPATH=/tmp/site python bench/cutlass_w4a4_check.py``.

For each shape (FLUX M=4608 with K x N in 3072x3072, 3072x12288, 12288x3072, 15360x3072, plus the odd
M=777, K=192, N=256) and each compiled config:

* accuracy: random int4 values (as e4m3), random positive scales, random bf16 c, against an fp64 oracle
  of ``sum_g ascale*wscale*dot_g + c`` (max-abs error relative to max|ref|, relative Frobenius error);
* exactness: unit scales and c=None -- the fp32 accumulator must hold the exact integer dot, so the
  bf16 output must equal the exact integer rounded once to bf16, bit for bit (mismatch count);
* speed: ``triton.testing.do_bench(..., return_mode="median")`` over rotating input sets (> 256 MB in
  total, so L2 does not serve them), with and without c, and bf16 ``torch.mm`` of the same shape.

Writes ``$OUT/cutlass_w4a4.json`` (OUT defaults to bench/results). Every failure is recorded; the
script continues with the next case.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072), (4608, 15360, 3072), (777, 192, 256)]
ROTATE_BYTES = 320 << 20
MAX_SETS = 512


def _load_module():
    from dit_passes.kernels import w4a4_cutlass
    return w4a4_cutlass


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def make_inputs(M, K, N, gen, unit=False, with_c=True):
    G = K // 64
    a = torch.randint(-8, 8, (M, K), device="cuda", generator=gen, dtype=torch.int8)
    w = torch.randint(-8, 8, (N, K), device="cuda", generator=gen, dtype=torch.int8)
    if unit:
        asc = torch.ones(M, G, device="cuda")
        wsc = torch.ones(N, G, device="cuda")
    else:
        asc = torch.rand(M, G, device="cuda", generator=gen) * 0.05 + 0.005
        wsc = torch.rand(N, G, device="cuda", generator=gen) * 0.05 + 0.005
    c = (torch.randn(M, N, device="cuda", generator=gen) * 4).to(torch.bfloat16) if with_c else None
    return dict(a=a, w=w, a8=a.float().to(torch.float8_e4m3fn), w8=w.float().to(torch.float8_e4m3fn),
                asc=asc.t().contiguous().t(), wsc=wsc.t().contiguous().t(), c=c)


def oracle(x):
    """fp64: sum_k (a*ascale)(m,k) * (w*wscale)(n,k) (+ c) == sum_g ascale*wscale*dot_g (+ c)."""
    M, K = x["a"].shape
    a_s = (x["a"].double().view(M, -1, 64) * x["asc"].double()[:, :, None]).view(M, K)
    N = x["w"].shape[0]
    w_s = (x["w"].double().view(N, -1, 64) * x["wsc"].double()[:, :, None]).view(N, K)
    ref = a_s @ w_s.T
    if x["c"] is not None:
        ref += x["c"].double()
    return ref


def check_accuracy(mod, cfg, x, ref):
    out = mod.w4a4_gemm_fp8(x["a8"], x["asc"], x["w8"], x["wsc"], x["c"], config=cfg)
    torch.cuda.synchronize()
    d = out.double() - ref
    scale = ref.abs().max().item()
    # bf16 has 8 significant bits: a correctly rounded result is within 2^-8 relative of ref
    within = (d.abs() <= ref.abs() * 2.0 ** -8 + 1e-30).float().mean().item()
    return {"max_abs_err_rel": d.abs().max().item() / max(scale, 1e-30),
            "rel_fro_err": (d.norm() / ref.norm()).item(),
            "frac_within_bf16_rounding": within,
            "finite": bool(torch.isfinite(out).all().item())}


def check_exact(mod, cfg, xu):
    out = mod.w4a4_gemm_fp8(xu["a8"], xu["asc"], xu["w8"], xu["wsc"], None, config=cfg)
    torch.cuda.synchronize()
    exact = (xu["a"].double() @ xu["w"].double().T).to(torch.bfloat16)  # exact int, rounded once
    bad = out.float() != exact.float()  # bit-exact up to the sign of zero
    return {"exact_mismatches": int(bad.sum().item()), "exact": not bool(bad.any().item())}


def bench(fn_list):
    from triton.testing import do_bench
    i = [0]

    def step():
        fn_list[i[0] % len(fn_list)]()
        i[0] += 1

    return do_bench(step, warmup=50, rep=300, return_mode="median")


def main() -> int:
    out_dir = os.environ.get("OUT") or os.path.join(REPO, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    res = run_checks(_load_module(), SHAPES, os.path.join(out_dir, "cutlass_w4a4.json"))
    return 1 if res.get("fatal") else 0


def best_configs(res) -> dict:
    """{(M, N, K): fastest config (by ms with c)} from :func:`run_checks`' cases that were also exact."""
    best = {}
    for c in res.get("cases", []):
        if c.get("config") in res.get("configs", []) and isinstance(c.get("ms"), float) and c.get("exact") is True:
            key = (c["M"], c["N"], c["K"])
            if key not in best or c["ms"] < best[key][1]:
                best[key] = (c["config"], c["ms"])
    return {k: v[0] for k, v in best.items()}


def run_checks(mod, shapes, out_path, timings: bool = True) -> dict:
    """Build (or reuse), then per shape and config: accuracy, exactness and (``timings``) speed.
    Writes ``out_path`` after every case and returns the results (``fatal`` set when nothing could run)."""
    res = {"torch": torch.__version__, "cuda": torch.version.cuda, "shapes_MKN": shapes, "cases": [], "errors": []}

    def dump():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)

    if not torch.cuda.is_available():
        res["errors"].append("CUDA not available")
        res["fatal"] = True
        dump()
        print("CUDA not available", file=sys.stderr)
        return res
    res["device"] = torch.cuda.get_device_name()
    try:
        res["cutlass_include"] = mod.find_cutlass_include()
        res["cutlass_version"] = mod.cutlass_version()
        t0 = time.time()
        res["so"] = mod.build(verbose=False)
        res["build_or_reuse_s"] = time.time() - t0
        res["resource_usage"] = mod.resource_usage(res["so"])
        res["is_available"] = mod.is_available()
        res["configs"] = mod.configs()
    except Exception as e:  # noqa: BLE001
        res["errors"].append("build: " + _err(e))
        res["traceback"] = traceback.format_exc()
        res["fatal"] = True
        dump()
        print(res["errors"][-1], file=sys.stderr)
        return res
    print(f"library {res['so']} ({res['build_or_reuse_s']:.1f}s); ptxas: {res['resource_usage']}", flush=True)
    dump()

    gen = torch.Generator(device="cuda").manual_seed(1234)
    for (M, K, N) in shapes:
        shape = {"M": M, "K": K, "N": N}
        try:
            x = make_inputs(M, K, N, gen)
            ref = oracle(x)
            xu = make_inputs(M, K, N, gen, unit=True, with_c=False)
            auto = mod._auto_config(M, N, K, torch.device("cuda"))
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"inputs {shape}: {_err(e)}")
            dump()
            continue
        set_bytes = M * K + N * K + 4 * (M + N) * (K // 64) + 2 * M * N * 2
        n_sets = max(2, min(MAX_SETS, -(-ROTATE_BYTES // set_bytes)))
        sets, mm_sets = [], []
        try:
            for _ in range(n_sets):
                s = make_inputs(M, K, N, gen)
                sets.append(dict(a8=s["a8"], w8=s["w8"], asc=s["asc"], wsc=s["wsc"], c=s["c"]))
                mm_sets.append((s["a"].to(torch.bfloat16), s["w"].to(torch.bfloat16)))
                del s
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"rotating sets {shape}: {_err(e)}")
        flops = 2.0 * M * N * K
        try:
            ms = bench([lambda p=p: torch.mm(p[0], p[1].T) for p in mm_sets]) if mm_sets and timings else None
            res["cases"].append({**shape, "config": "torch.mm bf16", "ms": ms, "tflops": flops / ms / 1e9 if ms else None,
                                 "rotating_sets": len(mm_sets)})
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"torch.mm {shape}: {_err(e)}")
        del mm_sets
        for cfg in mod.configs():
            case = {**shape, "config": cfg, "auto_choice": cfg == auto, "rotating_sets": len(sets)}
            for name, fn in (("accuracy", lambda: check_accuracy(mod, cfg, x, ref)),
                             ("exactness", lambda: check_exact(mod, cfg, xu))):
                try:
                    case.update(fn())
                except Exception as e:  # noqa: BLE001
                    case[name + "_error"] = _err(e)
                    res["errors"].append(f"{name} {shape} {cfg}: {_err(e)}")
            for key, use_c in ((("ms", True), ("ms_no_c", False)) if timings else ()):
                try:
                    fns = [lambda s=s: mod.w4a4_gemm_fp8(s["a8"], s["asc"], s["w8"], s["wsc"],
                                                         s["c"] if use_c else None, config=cfg) for s in sets]
                    ms = bench(fns)
                    case[key] = ms
                    case["tflops" if use_c else "tflops_no_c"] = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001
                    case[key + "_error"] = _err(e)
                    res["errors"].append(f"bench {shape} {cfg} c={use_c}: {_err(e)}")
            res["cases"].append(case)
            dump()
        del sets, x, xu, ref
        torch.cuda.empty_cache()

    hdr = f"{'M':>5} {'K':>6} {'N':>6} {'config':<18} {'ms':>8} {'TFLOP/s':>8} {'ms_noc':>8} {'relerr':>9} {'exact':>6}"
    print(hdr)
    for c in res["cases"]:
        def f(k, fmt):
            v = c.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"
        print(f"{c['M']:>5} {c['K']:>6} {c['N']:>6} {c['config']:<18} {f('ms', '8.4f')} {f('tflops', '8.1f')} "
              f"{f('ms_no_c', '8.4f')} {f('rel_fro_err', '9.2e')} {str(c.get('exact', '-')):>6}")
    if res["errors"]:
        print(f"{len(res['errors'])} error(s):", *res["errors"], sep="\n  ")
    dump()
    print(f"wrote {out_path}")
    return res


if __name__ == "__main__":
    sys.exit(main())
