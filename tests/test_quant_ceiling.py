"""``bench/quant_linear_ceiling.py``: the per-linear target's bound from a step report (what the fastest LUT GEMM
leaves for the activation pre-pass). The arithmetic on a report small enough to check by hand, the choice of GEMM and
bandwidth rows, and the error for a card it has no bandwidth for."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "quant_linear_ceiling.py")
_spec = importlib.util.spec_from_file_location("quant_linear_ceiling", _PATH)
ceil = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ceil)


def _report(device="NVIDIA H200"):
    # M 1000, K 1000: x 2 MB bf16, A 1000 x 1128 e4m3 = 1.128 MB
    res = {"bf16_mm": {"ms_b2b": 0.013}, "w4a8_gemm_lut_a": {"ms_b2b": 0.009}, "w4a8_gemm_lut_b": {"ms_b2b": 0.008},
           "fp8_act_rowquant": {"gb_per_s_gpu": 2000.0}, "lrcat_act": {"gb_per_s_gpu": 9000.0}}
    return {"device": device, "linear_m": 1000, "command": "x", "linears": {"1000x64": res}}


def test_bounds_by_hand():
    c = ceil.ceiling(_report())
    s = c["shapes"]["1000x64"]
    assert c["peak_tb_s"] == 4.8 and c["best_tb_s"] == 2.0  # lrcat_act (it reads x twice) is not a bandwidth row
    assert s["gemm_us"] == pytest.approx(8.0) and s["budget_us"] == pytest.approx(13 / 1.3 - 8)
    assert s["one_read_mb"] == pytest.approx(3.128) and s["two_reads_mb"] == pytest.approx(5.128)
    assert s["one_read_us_peak"] == pytest.approx(3.128 / 4.8)
    assert s["speedup_two_reads_best"] == pytest.approx(13 / (8 + 5.128 / 2.0))
    assert s["one_read_tokens_per_cta"] == 228 * 1024 // 2000
    assert s["one_read_l2_mb"] == pytest.approx(-(-1000 // 116) * 32 * 1000 * 2 / 1e6)


def test_main_writes_both_files(tmp_path):
    src = tmp_path / "step.json"
    src.write_text(json.dumps(_report()))
    assert ceil.main([str(src), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "quant_linear_ceiling.md").read_text()
    assert "| 1000x64 | 13.0 | 8.0 (1.62x) |" in md
    assert json.loads((tmp_path / "quant_linear_ceiling.json").read_text())["shapes"]["1000x64"]["k"] == 1000


def test_unknown_card_is_named():
    with pytest.raises(ValueError, match="no peak bandwidth known for 'NVIDIA A100'"):
        ceil.ceiling(_report("NVIDIA A100"))
