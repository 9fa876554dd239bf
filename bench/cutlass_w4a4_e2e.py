"""One-call H200 benchmark of the SVDQuant W4A4 linear: CUTLASS fp8-groupwise path vs Triton.

    pip install --no-deps --no-build-isolation -e .       # once: dit_passes installed (editable)
    export DIT_PASSES_CUTLASS_CACHE=$PWD/.cutlass_build   # a carried prebuilt library is reused
    PYTHONPATH=/tmp/site OUT=/some/dir python3 bench/cutlass_w4a4_e2e.py   # /tmp/site: nvidia-cutlass

Stages (each guarded; ``$OUT/cutlass_w4a4_e2e.json`` is rewritten after every one; stages are skipped
once ``BUDGET_S`` is spent):

1. build or reuse the CUTLASS library (kernels/w4a4_cutlass.py), ptxas registers/spills;
2. ``bench/cutlass_w4a4_check.py``: accuracy vs an fp64 oracle, bit-exactness of the integer part and
   GEMM-only timings of every tile config (``$OUT/cutlass_w4a4.json``); the fastest exact config per
   shape is used below;
3. per FLUX shape (M = 4608, rank 32, K x N below): exactness of the e4m3 activation kernel and the weight
   unpack, end-to-end error of both backends vs ``dit_passes.quant.int4.w4a4_linear_reference``; median
   ms (``triton.testing.do_bench``, rotating input sets > L2) of bf16 ``torch.mm``, the CUTLASS GEMM
   alone, its three side kernels, the CUTLASS linear (per-call weight unpack, and with cached e4m3
   weights) and the Triton linear; tile-scheduler swizzle sweep of the GEMM;
4. the backend timing table (``$OUT/w4a4_backend_table.json`` and ``<cutlass cache>/``), and a check that
   ``torch.ops.dit_passes.svdq_w4a4_linear`` dispatches by it.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072)]  # K x N
M_TOKENS, RANK = 4608, 32
ROTATE_BYTES = 256 << 20
BUDGET_S = float(os.environ.get("W4A4_BENCH_BUDGET_S", "240"))
DEVICE = "cuda"  # (a CPU smoke test of this script swaps it, with the interpreter and tiny shapes)
T0 = time.time()


def _err(e):
    return f"{type(e).__name__}: {e}"[:1500]


def bench(fn_of_set, sets):
    """Median ms of fn over rotating sets (a different buffer set each call); one untimed call first."""
    import triton.testing
    i = [0]

    def call():
        i[0] += 1
        return fn_of_set(sets[i[0] % len(sets)])

    call()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))


def rel(a, b):
    a, b = a.double(), b.double()
    return {"rel_fro": float((a - b).norm() / b.norm().clamp_min(1e-300)),
            "max_abs_rel": float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)),
            "frac_equal": float((a == b).double().mean())}


def make_set(int4, m, k, n, seed):
    d = DEVICE
    g = torch.Generator(device=d).manual_seed(seed)
    x = torch.randn(m, k, device=d, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=d, generator=g) * 0.02).to(torch.bfloat16)
    qw, wscale = int4.quantize_weight_w4(w)
    return dict(x=x, w=w, qw=qw, wscale=wscale, si=torch.rand(k, device=d, generator=g) + 0.5,
                ld=(torch.randn(RANK, k, device=d, generator=g) * 0.02).to(torch.bfloat16),
                lu=(torch.randn(n, RANK, device=d, generator=g) * 0.02).to(torch.bfloat16),
                bias=(torch.randn(n, device=d, generator=g) * 0.1).to(torch.bfloat16))


def run_shape(L, int4, k, n, cfg, res, m=M_TOKENS):
    C, T = L.C, L.T
    flops = 2.0 * m * n * k
    res.update(M=m, K=k, N=n, rank=RANK, config=cfg, timings={}, checks={}, errors={})
    res["weight_bytes"] = {"bf16": n * k * 2, "w4a4_stored": n * k // 2 + n * (k // 64) * 2 + RANK * (k + n) * 2 + k * 4,
                           "e4m3_cache_extra": n * k + n * (k // 64) * 4}
    res["weight_bytes"]["ratio_stored"] = res["weight_bytes"]["w4a4_stored"] / (n * k * 2)
    per_set = m * k * 3 + n * k * 3.5 + m * n * 4
    sets = [make_set(int4, m, k, n, i) for i in range(max(2, min(8, math.ceil(ROTATE_BYTES / per_set))))]
    s0 = sets[0]
    try:  # ---- exactness on set 0
        a8, asc, la = L.fused_act_quant_e4m3(s0["x"], s0["si"], s0["ld"])
        qx_r, as_r, la_r = int4.fused_act_quant_reference(s0["x"], s0["si"], s0["ld"])
        ck = res["checks"]
        ck["act_e4m3_values_exact"] = bool(torch.equal(a8.float(), int4.unpack_int4(qx_r).float()))
        ck["act_scales_exact"] = bool(torch.equal(asc, as_r))
        ck["lora_act_rel_fro"] = rel(la, la_r)["rel_fro"]
        w8, wsc = L.unpack_weight_e4m3(s0["qw"], s0["wscale"])
        ck["weight_unpack_exact"] = bool(torch.equal(w8.float(), int4.unpack_int4(s0["qw"]).float())
                                         and torch.equal(wsc, s0["wscale"].float()))
        ref = int4.w4a4_linear_reference(s0["x"], s0["qw"], s0["wscale"], s0["ld"], s0["lu"], s0["si"], s0["bias"])
        out_c = L.w4a4_linear(s0["x"], s0["qw"], s0["wscale"], s0["ld"], s0["lu"], s0["si"], s0["bias"], config=cfg)
        out_t = T.w4a4_linear(s0["x"], s0["qw"], s0["wscale"], s0["ld"], s0["lu"], s0["si"], s0["bias"])
        ck["cutlass_vs_reference"] = rel(out_c.float(), ref.float())
        ck["triton_vs_reference"] = rel(out_t.float(), ref.float())
        del a8, w8, ref, out_c, out_t
    except Exception as e:  # noqa: BLE001
        res["errors"]["checks"] = _err(e)
        traceback.print_exc()
    for s in sets:  # operands of the GEMM-only timing
        s["a8"], s["asc"], s["la"] = L.fused_act_quant_e4m3(s["x"], s["si"], s["ld"])
        s["w8"], s["wsc"] = L.unpack_weight_e4m3(s["qw"], s["wscale"])
        s["c"] = L.lowrank_up_bias(s["la"], s["lu"], s["bias"], m, n, DEVICE)
        s["wt"] = s["w"].t()
    lin = ("x", "qw", "wscale", "ld", "lu", "si", "bias")
    cases = {
        "bf16 torch.mm": lambda s: torch.mm(s["x"], s["wt"]),
        "cutlass gemm": lambda s: C.w4a4_gemm_fp8(s["a8"], s["asc"], s["w8"], s["wsc"], s["c"], config=cfg),
        "act quant e4m3": lambda s: L.fused_act_quant_e4m3(s["x"], s["si"], s["ld"]),
        "weight unpack": lambda s: L.unpack_weight_e4m3(s["qw"], s["wscale"]),
        "lowrank up + bias": lambda s: L.lowrank_up_bias(s["la"], s["lu"], s["bias"], m, n, DEVICE),
        "cutlass linear": lambda s: L.w4a4_linear(*(s[a] for a in lin), config=cfg, cache_weights=False),
        "cutlass linear, cached weights": lambda s: L.w4a4_linear(*(s[a] for a in lin), config=cfg, cache_weights=True),
        "triton linear": lambda s: T.w4a4_linear(*(s[a] for a in lin)),
    }
    for name, fn in cases.items():
        try:
            ms = bench(fn, sets)
            res["timings"][name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as e:  # noqa: BLE001
            res["errors"][name] = _err(e)
            traceback.print_exc()
        print(f"  K={k} N={n} {name}: {res['timings'].get(name, res['errors'].get(name))}", flush=True)
    L.clear_weight_cache()
    if time.time() - T0 < BUDGET_S * 0.7:
        try:
            sweep = {}
            for sw in (2, 4, 8):
                C.set_scheduler(sw)
                sweep[f"swizzle{sw}"] = bench(cases["cutlass gemm"], sets)
            C.set_scheduler(1)
            res["timings"]["cutlass gemm swizzle sweep ms"] = sweep
        except Exception as e:  # noqa: BLE001
            res["errors"]["swizzle"] = _err(e)
    del sets
    torch.cuda.empty_cache()


def main() -> int:
    out_dir = os.environ.get("OUT") or os.path.join(REPO, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, "cutlass_w4a4_e2e.json")
    res = {"stages": {}, "errors": [], "shapes": []}

    def dump():
        res["elapsed_s"] = round(time.time() - T0, 1)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    def stage(name, fn):
        if time.time() - T0 > BUDGET_S:
            res["stages"][name] = "skipped (time budget)"
            dump()
            return None
        t = time.time()
        try:
            out = fn()
            res["stages"][name] = f"ok {time.time() - t:.1f}s"
            return out
        except Exception as e:  # noqa: BLE001
            res["stages"][name] = "failed: " + _err(e)[:300]
            res["errors"].append(f"{name}: {traceback.format_exc()[-3000:]}")
            traceback.print_exc()
            return None
        finally:
            print(f"[{time.time() - T0:6.1f}s] {name}: {res['stages'][name]}", flush=True)
            dump()

    def env():
        import triton
        res["env"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "triton": triton.__version__, "python": sys.version.split()[0]}

    def imports():
        from dit_passes.kernels import w4a4_cutlass_linear as L
        from dit_passes.quant import dispatch as D, int4
        res["modules"] = {"linear": L.__file__, "int4": int4.__file__}
        return L, int4, D

    def build(C):
        prebuilt = C.built_library()
        t = time.time()
        so = C.build()
        d = os.path.dirname(so)
        res["build"] = {"so": so, "reused_prebuilt": prebuilt == so, "seconds": round(time.time() - t, 1),
                        "resource_usage": C.resource_usage(so), "is_available": C.is_available(),
                        "dir_bytes": sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)}
        try:
            res["build"]["build_json"] = json.load(open(os.path.join(d, "build.json")))
        except (OSError, ValueError):
            pass

    def check(C):
        import cutlass_w4a4_check as chk  # the sibling script (bench/ is sys.path[0])
        r = chk.run_checks(C, chk.SHAPES, os.path.join(out_dir, "cutlass_w4a4.json"))
        if r.get("fatal"):
            raise RuntimeError("; ".join(r["errors"])[:500])
        res["check_summary"] = [{k: c.get(k) for k in ("M", "K", "N", "config", "ms", "tflops", "ms_no_c", "rel_fro_err",
                                                         "exact", "exact_mismatches")} for c in r.get("cases", [])]
        return chk.best_configs(r)

    stage("env", env)
    mods = stage("import", imports)
    if mods is None:
        return 1
    L, int4, D = mods
    stage("build", lambda: build(L.C))
    best = stage("cutlass checks", lambda: check(L.C)) or {}
    for k, n in SHAPES:
        entry = {}
        res["shapes"].append(entry)
        stage(f"shape K={k} N={n}", lambda: run_shape(L, int4, k, n, best.get((M_TOKENS, n, k), "auto"), entry))

    def table():
        entries = []
        for s in res["shapes"]:
            tm = s.get("timings", {})
            ok = s.get("checks", {}).get("cutlass_vs_reference", {}).get("rel_fro", 1.0) < 1e-2
            cm, tt = tm.get("cutlass linear", {}).get("ms"), tm.get("triton linear", {}).get("ms")
            if cm is None and tt is None:
                continue
            backend = "cutlass" if (ok and cm is not None and (tt is None or cm < tt)) else "triton"
            entries.append({"M": s["M"], "N": s["N"], "K": s["K"], "backend": backend, "config": s.get("config"),
                            "cutlass_ms": cm, "triton_ms": tt})
        if not entries:
            raise RuntimeError("no timings: no table written")
        meta = {"device": res.get("env", {}).get("device"), "written_by": "bench/cutlass_w4a4_e2e.py"}
        res["table"] = {"entries": entries, "paths": [D.write_table(entries, os.path.join(out_dir, "w4a4_backend_table.json"), **meta),
                                                      D.write_table(entries, D.table_path(), **meta)]}

    stage("backend table", table)

    def dispatch():
        from dit_passes.infra import env
        os.environ[env.W4A4_TABLE] = os.path.join(out_dir, "w4a4_backend_table.json")
        D.reset()
        s = make_set(int4, M_TOKENS, 3072, 3072, 99)
        args = (s["x"], s["qw"], s["wscale"], s["ld"], s["lu"], s["si"], s["bias"])
        got = torch.ops.dit_passes.svdq_w4a4_linear(*args)
        choice = "cutlass" if D.use_cutlass(s["x"], s["qw"]) else "triton"
        config = D.cutlass_config(M_TOKENS, 3072, 3072)
        want = L.w4a4_linear(*args, config=config) if choice == "cutlass" else L.T.w4a4_linear(*args)
        res["dispatch"] = {"choice_3072x3072": choice, "op_equals_choice": bool(torch.equal(got, want))}

    stage("dispatch", dispatch)
    print_table(res)
    dump()
    print(f"wrote {out_path} ({time.time() - T0:.0f}s)")
    return 0


def print_table(res):
    cols = ["bf16 torch.mm", "cutlass gemm", "act quant e4m3", "weight unpack", "lowrank up + bias",
            "cutlass linear", "cutlass linear, cached weights", "triton linear"]
    print("\nM=4608 rank 32; ms (TFLOP/s = 2MNK/t)")
    print(f"{'case':<32}" + "".join(f"{s.get('K', '?')}x{s.get('N', '?')}".ljust(18) for s in res["shapes"]))
    for c in cols:
        row = f"{c:<32}"
        for s in res["shapes"]:
            t = s.get("timings", {}).get(c)
            row += f"{t['ms']:.3f} ({t['tflops']:.0f})".ljust(18) if t else "-".ljust(18)
        print(row)
    for key in ("cutlass_vs_reference", "triton_vs_reference"):
        print(f"{key + ' rel_fro':<32}" + "".join(
            (f"{s['checks'][key]['rel_fro']:.1e}" if key in s.get("checks", {}) else "-").ljust(18) for s in res["shapes"]))
    print(f"{'act/weight exact':<32}" + "".join(
        f"{s.get('checks', {}).get('act_e4m3_values_exact')}/{s.get('checks', {}).get('weight_unpack_exact')}".ljust(18)
        for s in res["shapes"]))
    print("configs:", [s.get("config") for s in res["shapes"]], "build:", {k: res.get("build", {}).get(k) for k in
          ("reused_prebuilt", "seconds")}, "dispatch:", res.get("dispatch"))
    print("stages:", json.dumps(res["stages"]))


if __name__ == "__main__":
    sys.exit(main())
