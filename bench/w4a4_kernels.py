"""W4A4 Triton kernels on the FLUX linear shapes (M = 4608 tokens): correctness, then timings.

Run from the repository root on a CUDA machine, dit_passes installed (``pip install --no-deps
--no-build-isolation -e .``):

    OUT=/some/dir python bench/w4a4_kernels.py          # all four shapes
    python bench/w4a4_kernels.py --shapes 3072x3072     # one shape (K x N)

For each K x N: (1) correctness against a PyTorch oracle of the spec (packed activations and scales
bit-exact, the integer GEMM part exact on a 256 x 256 sub-block with unit scales and a zero low-rank
branch, relative error of the bf16 end-to-end output); (2) medians of ``triton.testing.do_bench`` over
rotating input buffers (several sets of activations and weights, more than the L2 cache together) for
bf16 ``torch.mm``, fp8 rowwise ``torch._scaled_mm`` (GEMM only, operands pre-quantized),
``fused_act_quant``, ``w4a4_gemm`` (int8 and fp8 tensor-core variants), the ``w4a4_gemm_dot_ceiling``
diagnostic (same loads and dots, no per-group scales) and the end-to-end ``w4a4_linear`` (rank 32).
Writes ``w4a4_kernels.json`` and ``w4a4_kernels.md`` to ``$OUT`` (default ``bench/results``) and prints
the table last. A failing measurement is recorded as an error and the others still run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072)]  # K x N
M_TOKENS, RANK, G = 4608, 32, 64
ROTATE_BYTES = 256 << 20  # buffers per timing: enough sets to exceed the 50 MB L2 several times


def load_kernels():
    """The kernel module (dit_passes installed: ``pip install --no-deps --no-build-isolation -e .``)."""
    from dit_passes.kernels import w4a4_triton
    return w4a4_triton


# ------------------------------------------------------------------------------------------ oracle


def pack(q):
    q = q.to(torch.int32)
    return ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)


def unpack(p):
    p = p.to(torch.int32)
    nib = torch.stack((p & 0xF, (p >> 4) & 0xF), dim=-1).reshape(p.shape[0], -1)
    return torch.where(nib >= 8, nib - 16, nib)


def oracle_act_quant(x, smooth_inv, lora_down):
    xs = x.float() * smooth_inv
    m, k = xs.shape
    g = xs.reshape(m, k // G, G)
    ascale = g.abs().amax(-1) / torch.full((), 7.0, device=x.device)  # tensor divisor: IEEE division
    ascale = torch.where(ascale == 0, torch.ones_like(ascale), ascale)
    q = torch.clamp(torch.round(g / ascale[..., None]), -8, 7).reshape(m, k)
    return pack(q), ascale, xs.to(x.dtype).float() @ lora_down.float().t()


def oracle_gemm(qx, ascale, qw, wscale, lora_act, lora_up, bias):
    """fp32 in the spec's order; each group's dot in fp32 is exact (|sum| <= 4096, TF32 off)."""
    qa, qb = unpack(qx).float(), unpack(qw).float()
    acc = torch.zeros(qa.shape[0], qb.shape[0], device=qx.device)
    for i in range(qa.shape[1] // G):
        sl = slice(i * G, (i + 1) * G)
        acc += (ascale[:, i:i + 1] * wscale[:, i].float()[None, :]) * (qa[:, sl] @ qb[:, sl].t())
    return acc + lora_act @ lora_up.float().t() + bias.float()


# -------------------------------------------------------------------------------------------- data


def make_set(m, k, n, seed, dev):
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    si = torch.rand(k, device=dev, generator=gen) + 0.5
    qw = pack(torch.randint(-8, 8, (n, k), device=dev, generator=gen))
    wscale = (torch.rand(n, k // G, device=dev, generator=gen) * 0.004 + 0.001).to(torch.bfloat16)
    ld = (torch.randn(RANK, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    lu = (torch.randn(n, RANK, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(n, device=dev, generator=gen) * 0.1).to(torch.bfloat16)
    return dict(x=x, w=w, si=si, qw=qw, wscale=wscale, ld=ld, lu=lu, bias=bias)


def fp8_rowwise(t):
    """e4m3 rows with fp32 per-row scales (amax / 448)."""
    s = (t.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (t.float() / s).to(torch.float8_e4m3fn), s


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300)), float((a - b).abs().max() / b.abs().max())


# ------------------------------------------------------------------------------------------ timing


def bench(fn_of_set, sets):
    """Median ms of fn over rotating sets (a different buffer set each call)."""
    import triton.testing  # noqa: PLC0415
    state = [0]

    def call():
        state[0] += 1
        return fn_of_set(sets[state[0] % len(sets)])

    call()  # autotune / compile outside the timed region
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median"))


def best_config(kernel):
    cfg = getattr(kernel, "best_config", None)
    return None if cfg is None else str(cfg)


def check_shape(K, s, res, mmas=("int8", "fp8")):
    """Correctness of the kernels on one data set ``s`` against the oracle; results go into ``res``."""
    qx, ascale, la = K.fused_act_quant(s["x"], s["si"], s["ld"])
    qx_r, as_r, la_r = oracle_act_quant(s["x"], s["si"], s["ld"])
    res["act_packed_bit_exact"] = bool(torch.equal(qx, qx_r))
    res["act_scales_bit_exact"] = bool(torch.equal(ascale, as_r))
    res["lora_act_rel_err"] = rel(la, la_r)[0]
    sub = slice(0, 256)
    exact = unpack(qx_r[sub]).double() @ unpack(s["qw"][sub]).double().t()
    ref = oracle_gemm(qx_r, as_r, s["qw"], s["wscale"], la_r, s["lu"], s["bias"])
    for mma in mmas:
        # unit scales and a zero low-rank branch and bias (same kernel variant as the timed one): the
        # output is then the exact integer sum of the group dots
        out = K.w4a4_gemm(qx_r, torch.ones_like(as_r), s["qw"], torch.ones_like(s["wscale"]), torch.zeros_like(la_r),
                          torch.zeros_like(s["lu"]), torch.zeros_like(s["bias"]), torch.float32, mma=mma)
        res[f"int_part_exact_{mma}"] = bool(torch.equal(out[sub, sub].double(), exact))
        o = K.w4a4_linear(s["x"], s["qw"], s["wscale"], s["ld"], s["lu"], s["si"], s["bias"], mma=mma)
        res[f"linear_bf16_rel_err_{mma}"], res[f"linear_bf16_max_rel_{mma}"] = rel(o.float(), ref)
    ceil = K.w4a4_gemm_dot_ceiling(qx_r, as_r, s["qw"], s["wscale"])
    res["dot_ceiling_int_exact"] = bool(torch.equal(ceil[sub, sub].double(), exact))


def run_shape(K, k, n, dev):
    res = {"M": M_TOKENS, "K": k, "N": n, "rank": RANK, "errors": {}}
    flops = 2.0 * M_TOKENS * n * k
    base = make_set(M_TOKENS, k, n, 0, dev)
    res["weight_bytes"] = {
        "bf16": n * k * 2,
        "w4a4": n * k // 2 + n * (k // G) * 2 + RANK * (k + n) * 2 + k * 4,
    }
    res["weight_bytes"]["ratio"] = res["weight_bytes"]["w4a4"] / res["weight_bytes"]["bf16"]
    try:
        check_shape(K, base, res)
    except Exception as e:  # record and continue with the timings
        res["errors"]["correctness"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()

    # ---- timings
    per_set = M_TOKENS * k * 2 + n * k * 2 + n * k // 2 + M_TOKENS * n * 2
    nsets = max(2, min(8, math.ceil(ROTATE_BYTES / per_set)))
    sets = [base] + [make_set(M_TOKENS, k, n, i, dev) for i in range(1, nsets)]
    for s in sets:
        s["wt"] = s["w"].t()
        s["x8"], s["sx"] = fp8_rowwise(s["x"])
        w8, sw = fp8_rowwise(s["w"])
        s["w8t"], s["sw"] = w8.t(), sw.t().contiguous()
        s["qx"], s["ascale"], s["la"] = K.fused_act_quant(s["x"], s["si"], s["ld"])
    torch.cuda.synchronize()
    cases = {
        "bf16 torch.mm": (lambda s: torch.mm(s["x"], s["wt"]), None),
        "fp8 rowwise _scaled_mm (GEMM only)": (lambda s: torch._scaled_mm(
            s["x8"], s["w8t"], scale_a=s["sx"], scale_b=s["sw"], out_dtype=torch.bfloat16), None),
        "fused_act_quant": (lambda s: K.fused_act_quant(s["x"], s["si"], s["ld"]), K._fused_act_quant_kernel),
        "w4a4_gemm int8": (lambda s: K.w4a4_gemm(s["qx"], s["ascale"], s["qw"], s["wscale"], s["la"], s["lu"],
                                                  s["bias"], torch.bfloat16, mma="int8"), K._w4a4_gemm_kernel),
        "w4a4_gemm fp8": (lambda s: K.w4a4_gemm(s["qx"], s["ascale"], s["qw"], s["wscale"], s["la"], s["lu"],
                                                 s["bias"], torch.bfloat16, mma="fp8"), K._w4a4_gemm_kernel),
        "diag: int8 dots, no group scales": (lambda s: K.w4a4_gemm_dot_ceiling(
            s["qx"], s["ascale"], s["qw"], s["wscale"]), K._w4a4_gemm_kernel),
        "w4a4_linear int8 (end to end)": (lambda s: K.w4a4_linear(
            s["x"], s["qw"], s["wscale"], s["ld"], s["lu"], s["si"], s["bias"], mma="int8"), None),
        "w4a4_linear fp8 (end to end)": (lambda s: K.w4a4_linear(
            s["x"], s["qw"], s["wscale"], s["ld"], s["lu"], s["si"], s["bias"], mma="fp8"), None),
    }
    res["timings"] = {}
    for name, (fn, kern) in cases.items():
        try:
            ms = bench(fn, sets)
            entry = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
            if name == "fused_act_quant":
                moved = M_TOKENS * k * 2 + M_TOKENS * k // 2 + M_TOKENS * (k // G) * 4 + RANK * k * 2
                entry["GB_per_s"] = moved / (ms * 1e-3) / 1e9
            if kern is not None:
                entry["config"] = best_config(kern)
            res["timings"][name] = entry
        except Exception as e:
            res["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"  {k}x{n} {name}: {res['timings'].get(name, res['errors'].get(name))}", flush=True)
    del sets
    torch.cuda.empty_cache()
    return res


def markdown(results, device, elapsed):
    names = []
    for r in results:
        names += [n for n in r.get("timings", {}) if n not in names]
    lines = [f"W4A4 kernels, M = {M_TOKENS}, rank {RANK}, {device}; ms (effective TFLOP/s = 2MNK / t); "
             f"{elapsed:.0f} s total", "",
             "| case | " + " | ".join(f"K={r['K']} N={r['N']}" for r in results) + " |",
             "|---|" + "---|" * len(results)]
    for n in names:
        cells = []
        for r in results:
            t = r.get("timings", {}).get(n)
            cells.append("error" if t is None else f"{t['ms']:.3f} ({t['tflops']:.0f})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    rows = [("act packed+scales bit-exact",
             lambda r: f"{r.get('act_packed_bit_exact')}/{r.get('act_scales_bit_exact')}"),
            ("int part exact int8/fp8/diag", lambda r: f"{r.get('int_part_exact_int8')}/{r.get('int_part_exact_fp8')}/"
                                                       f"{r.get('dot_ceiling_int_exact')}"),
            ("bf16 out rel err int8 / fp8", lambda r: f"{r.get('linear_bf16_rel_err_int8', float('nan')):.1e} / "
                                                      f"{r.get('linear_bf16_rel_err_fp8', float('nan')):.1e}"),
            ("act-quant GB/s", lambda r: f"{r.get('timings', {}).get('fused_act_quant', {}).get('GB_per_s', 0):.0f}"),
            ("weight bytes W4A4 / bf16", lambda r: f"{r['weight_bytes']['w4a4'] / 2**20:.1f} MiB / "
                                                   f"{r['weight_bytes']['bf16'] / 2**20:.1f} MiB "
                                                   f"({r['weight_bytes']['ratio']:.3f})")]
    for label, f in rows:
        lines.append(f"| {label} | " + " | ".join(f(r) for r in results) + " |")
    errs = [f"- K={r['K']} N={r['N']} {k}: {v}" for r in results for k, v in r["errors"].items()]
    if errs:
        lines += ["", "Errors:"] + errs
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=None, help="K x N pairs such as 3072x12288 (default: all four)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/w4a4_kernels.py needs a CUDA GPU")
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's fp32 group dots must be exact
    out_dir = os.environ.get("OUT") or os.path.join(REPO, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    K = load_kernels()
    dev = torch.device("cuda")
    device = torch.cuda.get_device_name(dev)
    results = []
    for k, n in shapes:
        print(f"shape K={k} N={n} ({time.time() - t0:.0f} s)", flush=True)
        results.append(run_shape(K, k, n, dev))
    elapsed = time.time() - t0
    meta = {"device": device, "torch": torch.__version__, "triton": __import__("triton").__version__,
            "elapsed_s": elapsed, "kernel_module": K.__file__}
    with open(os.path.join(out_dir, "w4a4_kernels.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    md = markdown(results, device, elapsed)
    with open(os.path.join(out_dir, "w4a4_kernels.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
