"""The ceiling of the per-linear target (SVDQuant W4 linear >= 1.3x bf16 ``torch.mm`` end to end), from a
measured ``quant_step.json``: what the fastest LUT GEMM we have leaves for the A operand's pre-pass, against the
bytes any pre-pass must move.

    python bench/quant_linear_ceiling.py bench/results/quant_step_h200.json --out bench/results

For each FLUX shape (M tokens, K x N), times without host time (``ms_graph``, a CUDA graph's replay, where the report
has it, else ``ms_b2b``, calls back to back):

* ``bf16``: ``bf16_mm``; ``gemm``: the fastest ``w4a8_gemm_lut_*`` row (the LUT GEMM alone, A already e4m3);
* ``budget_us``: what 1.3x leaves for everything before the GEMM, ``bf16 / 1.3 - gemm`` (< 0: the GEMM alone misses);
* the pre-pass's HBM bytes: x bf16 [M, K] read and the A operand e4m3 [M, K + C] written. Per-token scales need a
  token's whole row before its first e4m3 byte, so a pre-pass reads x twice (``two_reads``: statistics, then
  quantization, every design we have written) unless the rows stay on chip between the two (``one_read``);
* ``*_us_peak``: those bytes at the card's peak bandwidth; ``speedup_*``: bf16 / (gemm + that), an upper bound;
* ``*_us_best`` / ``speedup_*_best``: the same at the best bandwidth a memory-bound kernel of the report reached
  (its kernel time by the profiler: ``fp8_act`` / ``fp8_act_rowquant``, a bf16 read and an e4m3 write;
  ``w4_expand_kernel``, packed int4 read, e4m3 written), where it has one;
* ``one_read_l2_mb``: keeping rows on chip caps a CTA's tokens at ``SMEM / (2 K)`` (228 KB a Hopper SM), and each CTA
  reads all of lora_down [R, K] bf16 for its tokens' down projection: M / tokens x R K 2 bytes from L2, beside the
  HBM traffic (unless a cluster multicasts it).

Writes ``quant_linear_ceiling.{json,md}`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, Optional

TARGET = 1.3
PEAK_TB_S = {"H200": 4.8, "H100": 3.35}   # HBM3e / HBM3 (SXM) datasheet bandwidth
SMEM_BYTES = 228 * 1024                    # shared memory a Hopper SM offers one CTA at most (227 KB usable)
RANK = 32
BRANCH_COLS = 128                          # w4_lut.branch_cols(32): three planes of 32 rounded up to 64s
MEMORY_BOUND_ROWS = ("fp8_act", "fp8_act_rowquant", "w4_expand_kernel")  # their bytes counted as they move


def peak_tb_s(device: str) -> float:
    for name, bw in PEAK_TB_S.items():
        if name in device:
            return bw
    raise ValueError(f"quant_linear_ceiling: no peak bandwidth known for {device!r}; add it to PEAK_TB_S")


def shape_bound(m: int, k: int, bf16_us: float, gemm_us: float, tb_s: float, best_tb_s: Optional[float] = None,
                rank: int = RANK, cols: int = BRANCH_COLS) -> Dict[str, Any]:
    """The bounds of one shape (module docstring); times in microseconds, bandwidth in TB/s (= bytes / us / 1e6)."""
    x_bytes, a_bytes = 2 * m * k, m * (k + cols)
    tokens = max(1, SMEM_BYTES // (2 * k))
    out = {"m": m, "k": k, "bf16_us": bf16_us, "gemm_us": gemm_us, "gemm_speedup": bf16_us / gemm_us,
           "budget_us": bf16_us / TARGET - gemm_us,
           "one_read_tokens_per_cta": tokens, "one_read_l2_mb": -(-m // tokens) * rank * k * 2 / 1e6}
    for name, nbytes in (("one_read", x_bytes + a_bytes), ("two_reads", 2 * x_bytes + a_bytes)):
        out[f"{name}_mb"] = nbytes / 1e6
        for tag, bw in (("peak", tb_s), ("best", best_tb_s)):
            if bw:
                us = nbytes / (bw * 1e6)
                out[f"{name}_us_{tag}"] = us
                out[f"speedup_{name}" + ("" if tag == "peak" else "_best")] = bf16_us / (gemm_us + us)
    return out


def best_bandwidth(report: Dict[str, Any]) -> Optional[float]:
    """TB/s: the fastest memory-bound kernel of the report (kernel time by the profiler)."""
    rates = [v["gb_per_s_gpu"] / 1e3 for res in report["linears"].values() for d, v in res.items()
             if d in MEMORY_BOUND_ROWS and v.get("gb_per_s_gpu")]
    return max(rates) if rates else None


def _ms(row: Dict[str, Any]) -> Optional[float]:
    """A row's ms a call without host time: replayed from a CUDA graph where measured, else back to back."""
    return row.get("ms_graph") or row.get("ms_b2b")


def ceiling(report: Dict[str, Any]) -> Dict[str, Any]:
    tb_s, best = peak_tb_s(report["device"]), best_bandwidth(report)
    m = report["linear_m"]
    shapes = {}
    for key, res in report["linears"].items():
        gemms = [_ms(v) for d, v in res.items() if d.startswith("w4a8_gemm_lut") and _ms(v)]
        if not (res.get("bf16_mm") and _ms(res["bf16_mm"])) or not gemms:
            continue
        k = int(key.split("x")[0])
        shapes[key] = shape_bound(m, k, _ms(res["bf16_mm"]) * 1e3, min(gemms) * 1e3, tb_s, best)
    return {"source_command": report.get("command"), "device": report["device"], "peak_tb_s": tb_s, "best_tb_s": best,
            "target": TARGET, "shapes": shapes}


def markdown(c: Dict[str, Any], command: str) -> str:
    lines = [f"# The per-linear target's ceiling ({c['device']}, peak {c['peak_tb_s']} TB/s)", "", f"`{command}`",
             "", f"From `{c['source_command']}`.", "",
             "Bounds: bf16 / (GEMM + pre-pass bytes at the bandwidth) at peak"
             + (f" [at {c['best_tb_s']:.2f} TB/s, the best memory-bound row measured]" if c["best_tb_s"] else "")
             + ".", "",
             "| K x N | bf16 mm us | LUT GEMM us (x) | budget for 1.3x us | two reads: MB, us, bound | "
             "one read: MB, us, bound | one read: tokens a CTA, lora_down from L2 MB |",
             "|---|---|---|---|---|---|---|"]

    def cell(s, name):
        best = (f" [{s[name + '_us_best']:.1f}, {s['speedup_' + name + '_best']:.2f}x]"
                if name + "_us_best" in s else "")
        return f"{s[name + '_mb']:.0f}, {s[name + '_us_peak']:.1f}, {s['speedup_' + name]:.2f}x{best}"
    for key, s in c["shapes"].items():
        lines.append(f"| {key} | {s['bf16_us']:.1f} | {s['gemm_us']:.1f} ({s['gemm_speedup']:.2f}x) | "
                     f"{s['budget_us']:.1f} | {cell(s, 'two_reads')} | {cell(s, 'one_read')} | "
                     f"{s['one_read_tokens_per_cta']}, {s['one_read_l2_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="an quant_step.json with bf16_mm and a w4a8_gemm_lut_* row per shape")
    ap.add_argument("--out", default="", help="directory for quant_linear_ceiling.{json,md} (default: print)")
    args = ap.parse_args(argv)
    with open(args.report) as f:
        c = ceiling(json.load(f))
    command = "python bench/quant_linear_ceiling.py " + " ".join(argv if argv is not None else os.sys.argv[1:])
    md = markdown(c, command)
    if args.out:
        with open(os.path.join(args.out, "quant_linear_ceiling.json"), "w") as f:
            json.dump({**c, "command": command}, f, indent=1)
        with open(os.path.join(args.out, "quant_linear_ceiling.md"), "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
