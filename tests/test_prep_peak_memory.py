"""Peak memory while preparing a model from a checkpoint: ``bench/prep_peak_memory.py --size tiny``'s
logic in this process. SVDQuant W4 r32 lowered from a checkpoint never holds more than its final bytes plus one bf16
block, and what it keeps afterwards is what ``memory_report`` shows (plus the 8 KiB fingerprint per released weight,
which once kept the whole bf16 weight of a CPU model alive: ``ownership.weight_sample`` returned a view of it)."""
from __future__ import annotations

import importlib.util
import os

import torch

from dit_passes.infra.ownership import weight_sample

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "prep_peak_memory.py")
_spec = importlib.util.spec_from_file_location("prep_peak_memory", _PATH)
prep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prep)


def test_live_tensor_bytes_counts_storages_once_until_freed():
    with prep.LiveTensorBytes() as meter:
        a = torch.ones(1000, dtype=torch.float32)
        view = a[10:20]          # a view: no new storage
        a.add_(1)                # in place: none either
        b = a * 2
        assert meter.live == meter.peak == 8000
        del a, b
        assert meter.live == 4000  # a's storage lives on in the view
        del view
        assert meter.live == 0 and meter.peak == 8000


def test_weight_sample_holds_no_view_of_the_weight():
    w = torch.randn(64, 64, dtype=torch.bfloat16)  # bf16 on the CPU: to() and cpu() would return w's storage
    assert weight_sample(w).untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_svdquant_from_checkpoint_peak_within_final_plus_one_block(tmp_path):
    ckpt = prep.write_checkpoint(prep.config_for("tiny"), str(tmp_path), torch.device("cpu"))
    assert ckpt["written"] and prep.write_checkpoint(prep.config_for("tiny"), str(tmp_path), torch.device("cpu")) \
        == {**ckpt, "written": False}  # a second call finds it
    r = prep.prepare_row(0, 1, "svdq_w4_r32", "tiny", str(tmp_path), "cpu")
    assert r["bytes_read"] == ckpt["bytes"]  # every weight read, once
    assert r["report_bytes"] < ckpt["bytes"] and r["released"] > 0
    assert r["peak_bytes"] <= r["final_bytes"] + r["block_bytes"], r
    # what stays is what the report counts, plus the fingerprints of the released weights (8 KiB each, at most)
    assert r["report_bytes"] <= r["final_bytes"] <= r["report_bytes"] + 8192 * r["released"], r


def test_quantizing_in_memory_replaces_the_model_block_by_block():
    """A bf16 model already in memory, quantized by ``compile_dit(model, passes=[Fp8Linear()])`` (and an SVDQuant
    form), the caller's reference dropped: each original weight leaves the graph and the model as soon as its
    quantized table exists, so the peak stays within one bf16 block of the larger of the model and the result
    (before, every original stayed until the last table was made: 1.6-1.7x the model here). The meter counts the
    model's own storages and every storage made while lowering, until each is freed (``LiveTensorBytes``)."""
    for row in ("fp8", "svdq_w4_r32_mw8"):
        r = prep.prepare_in_memory_row(0, 1, row, "tiny", "cpu")
        assert r["released"] > 0 and r["final_bytes"] < r["model_bytes"], r
        assert r["peak_bytes"] <= r["bound_bytes"] == max(r["model_bytes"], r["final_bytes"]) + r["block_bytes"], r
        assert r["report_bytes"] <= r["final_bytes"] <= r["report_bytes"] + 8192 * r["released"], r
