"""The report of ``bench/quant_step.py``: the summary keys, the targets, the markdown table and the files
(a module of its own to keep the script short; it imports nothing from the script)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence


def summarize(r: Dict[str, Any]) -> None:
    rows = r["rows"]
    r["step_ms"] = {name: row["step_ms"] for name, row in rows.items()}
    bf16 = "bf16" if "bf16" in rows else "bf16_graphed" if "bf16_graphed" in rows else None
    if bf16:
        r["bf16_compiled_ms"] = rows[bf16]["step_ms"]
    svdq = {n: v["step_ms"] for n, v in rows.items() if n.startswith("svdq_w4")}
    if svdq:
        best = min(svdq, key=svdq.get)
        r["svdq_w4_compiled_ms"], r["svdq_w4_design"] = svdq[best], best
    fp8 = {n: v["step_ms"] for n, v in rows.items() if n.startswith("fp8")}
    if fp8:
        best = min(fp8, key=fp8.get)
        r["fp8_compiled_ms"], r["fp8_design"] = fp8[best], best
    if bf16:  # a graphed row against the graphed bf16 step where measured: like against like
        def base(n):
            return rows["bf16_graphed" if n.endswith("_graphed") and "bf16_graphed" in rows else bf16]["step_ms"]
        r["speedup_vs_bf16"] = {n: base(n) / v["step_ms"] for n, v in rows.items()}
    r["linear_ms"] = {shape: {d: v["ms"] for d, v in res.items()} for shape, res in r.get("linears", {}).items()}
    r["memory"] = memory_ratios(rows)


def memory_ratios(rows: Dict[str, Any]) -> Dict[str, Any]:
    """The FLUX-size memory keys: each quantized row's resident weights and step peak against the bf16 row's
    (resident = every tensor the lowered graph holds plus what the original module still keeps)."""
    if "bf16" not in rows:
        return {}
    def resident(v):
        return v["weights_gib"] + v["original_only_gib"]
    base = rows["bf16"]
    out: Dict[str, Any] = {"bf16_weights_gib": resident(base), "bf16_peak_gib": base["peak_gib"]}
    for key, prefix in (("svdq_w4", "svdq_w4_all"), ("svdq_w4_blocks", "svdq_w4_fp8"), ("fp8", "fp8")):
        row = next((v for n, v in rows.items() if n.startswith(prefix)), None)
        if row is None:
            continue
        out[f"{key}_weights_gib"], out[f"{key}_peak_gib"] = resident(row), row["peak_gib"]
        out[f"{key}_weight_ratio"] = resident(row) / max(resident(base), 1e-12)
        out[f"{key}_peak_ratio"] = row["peak_gib"] / max(base["peak_gib"], 1e-12)
    return out


def targets(r: Dict[str, Any]) -> List[str]:
    """The targets, each with what this run measured."""
    out = []
    sp = r.get("speedup_vs_bf16", {})
    for key, design, goal in (("fp8", r.get("fp8_design"), 1.32), ("svdq_w4", r.get("svdq_w4_design"), 1.25)):
        if design in sp:
            got = sp[design]
            out.append(f"{key} step >= {goal}x compiled bf16: {got:.3f}x ({design}) -- {'met' if got >= goal else 'missed'}")
    per = {shape: max((v["speedup_vs_bf16_mm"] or 0 for d, v in res.items() if d.startswith("svdq") and "tflops" in v),
                      default=None) for shape, res in r.get("linears", {}).items()}
    if per and all(v is not None for v in per.values()):
        ok = all(v >= 1.3 for v in per.values())
        out.append("svdq W4 linear >= 1.3x bf16 mm on each shape: "
                   + ", ".join(f"{s} {v:.2f}x" for s, v in per.items()) + f" -- {'met' if ok else 'missed'}")
    for key, what in (("speedup_b2b_vs_bf16_mm", "calls back to back (GPU time, CPU overhead hidden)"),
                      ("speedup_graph_vs_bf16_mm", "calls replayed from one CUDA graph (as the graphed step runs)")):
        per = {shape: max((v.get(key) or 0 for d, v in res.items() if d.startswith("svdq")), default=0)
               for shape, res in r.get("linears", {}).items()}
        if per and all(per.values()):
            ok = all(v >= 1.3 for v in per.values())
            out.append(f"the same, {what}: " + ", ".join(f"{s} {v:.2f}x" for s, v in per.items())
                       + f" -- {'met' if ok else 'missed'}")
    return out or ["(no rows to compare)"]


def markdown(r: Dict[str, Any], order: Sequence[str] = ()) -> str:
    """The results as markdown; ``order``: the per-linear designs' row order (others after them)."""
    lines = [f"# FLUX.1-dev-size step, quantization rows ({r['device']}, torch {r['torch']})", "",
             f"`{r['command']}`; {r['tokens']}; RegionalCompile ({r['compile']}) on every row.", "",
             "| row | step ms | vs bf16 | rel. err vs bf16 | weights GiB | original kept GiB | peak GiB | first call s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in r["rows"].items():
        sp = r.get("speedup_vs_bf16", {}).get(name)
        lines.append(f"| {name} | {v['step_ms']:.2f} | {'' if sp is None else f'{sp:.3f}x'} | "
                     f"{v['rel_err_vs_bf16']:.4f} | {v['weights_gib']:.2f} | {v['original_only_gib']:.2f} | "
                     f"{v['peak_gib']:.2f} | {v['first_call_s']:.1f} |")
    for k in ("skipped", "errors"):
        if r.get(k):
            lines += ["", f"{k}: {r[k]}"]
    lines += ["", "Against the targets:", ""] + [f"- {t}" for t in targets(r)]
    if r.get("linears"):
        designs = sorted({d for res in r["linears"].values() for d in res},
                         key=lambda d: (tuple(order) + (d,)).index(d))
        lines += ["", f"Per linear, M = {r['linear_m']}: ms [/ ms per call back to back] (TFLOP/s, speedup vs bf16 mm, "
                  "rel. err vs fp32 [vs the bf16 linear]; for SVDQuant also true W4A4's rel. err on the same "
                  "weights; b2b: the speedup with calls back to back; graph: ms per call replayed from one CUDA "
                  "graph; GPU: kernel time per call by the profiler, and its speedup over bf16_mm's)", "",
                  "| design | " + " | ".join(r["linears"]) + " |", "|---|" + "---|" * len(r["linears"])]
        for d in designs:
            cells = []
            for res in r["linears"].values():
                v = res.get(d)
                if v is None:
                    cells.append("")
                    continue
                extra = [f"{v['tflops']:.0f}" if "tflops" in v else f"{v['gb_per_s']:.0f} GB/s"]
                if "gb_per_s_b2b" in v:
                    extra.append(f"b2b {v['gb_per_s_b2b']:.0f} GB/s")
                if v.get("speedup_vs_bf16_mm") is not None:
                    extra.append(f"{v['speedup_vs_bf16_mm']:.2f}x")
                if "rel_err_vs_fp32" in v:
                    extra.append(f"{v['rel_err_vs_fp32']:.2e}" + (f" [bf16 {v['rel_err_vs_bf16']:.2e}]"
                                                                    if v.get("rel_err_vs_bf16") else ""))
                if "rel_err_w4a4_reference" in v:
                    extra.append(f"W4A4 {v['rel_err_w4a4_reference']:.2e}")
                b2b = "" if v.get("ms_b2b") is None else f" / {v['ms_b2b']:.3f}"
                if v.get("speedup_b2b_vs_bf16_mm") is not None:
                    extra.append(f"b2b {v['speedup_b2b_vs_bf16_mm']:.2f}x")
                if v.get("ms_graph") is not None:
                    extra.append(f"graph {v['ms_graph']:.3f} ms" + (f" = {v['speedup_graph_vs_bf16_mm']:.2f}x"
                                                                   if "speedup_graph_vs_bf16_mm" in v else ""))
                if v.get("gpu_ms") is not None:  # kernel time by the profiler: no host time in it
                    extra.append(f"GPU {v['gpu_ms']:.3f} ms" + (f" = {v['gb_per_s_gpu']:.0f} GB/s"
                                                               if "gb_per_s_gpu" in v else
                                                               f" = {v['speedup_gpu_vs_bf16_mm']:.2f}x"
                                                               if "speedup_gpu_vs_bf16_mm" in v else ""))
                cells.append(f"{v['ms']:.3f}{b2b} ({', '.join(extra)})")
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def save(r: Dict[str, Any], out: str, order: Sequence[str] = ()) -> None:
    os.makedirs(out, exist_ok=True)
    summarize(r)
    with open(os.path.join(out, "quant_step.json"), "w") as f:
        json.dump(r, f, indent=1)
    with open(os.path.join(out, "quant_step.md"), "w") as f:
        f.write(markdown(r, order))
    if r.get("memory"):
        with open(os.path.join(out, "memory.json"), "w") as f:
            json.dump({"command": r["command"], "device": r["device"], "torch": r["torch"], **r["memory"]}, f, indent=1)
