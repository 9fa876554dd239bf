"""The soak benchmark's own check (``dit_passes.soak``): a short stream on one served digits pipeline, its requests
run alone on fresh pipelines (in this process here, for speed; ``dit-passes soak`` runs them in a fresh one), the
summary's fields, and a reference off by one ulp counted as a mismatch (bitwise comparison)."""
from __future__ import annotations

import dataclasses

import torch

from dit_passes import soak

PROFILE = soak.Profile(sizes=(16,), unseen_size=16, steps=(2,), batches=(1,), cfg_scale=3.0, caches=("f1b0",),
                       pool=1, requests=6, interrupts=1, lora=False)


def test_soak_summary_and_a_one_ulp_mismatch_detected():
    stream = soak.make_stream(PROFILE, PROFILE.requests, seed=0)
    interrupted = [r for r in stream if r.interrupt_at is not None]
    assert len(interrupted) == 1 and len({r.key() for r in stream}) == 3  # CFG on and off, one interrupted
    model = soak.Model("digits", "cpu")
    refs = soak.run_alone(model, soak.reference_specs(stream), PROFILE)
    assert all(r["error"] is None for r in refs.values())
    bad = interrupted[0].key()  # its latents at the interrupted step, one ulp off in one element
    off = refs[bad]["output"].clone()
    off.view(-1)[0] = torch.nextafter(off.view(-1)[0], torch.tensor(float("inf")))
    refs = {**refs, bad: dict(refs[bad], output=off)}
    records, events = soak.serve(model, stream, PROFILE, refs, tolerance=0.0)
    summary = soak.judge(records, refs, 0.0, "cpu", events["graph_limit"])
    assert {"requests", "mismatches", "memory_growth", "graphs_max", "graph_limit", "latency_ratio_max",
            "device"} <= set(summary)
    assert summary["requests"] == 6 and summary["interrupted"] == 1 and summary["errors"] == 0
    assert summary["mismatches"] == 1  # the tampered one; every other request bitwise equal to it run alone
    assert [r["match"] for r in records] == [r.interrupt_at is None for r in stream]
    assert 0 < records[interrupted[0].index]["difference"] < 1e-6
    assert summary["graphs_max"] == 1 and summary["graph_limit"] == 8 and summary["lowered"] == 1
    assert summary["memory_growth"] > -1 and summary["device"] == "cpu"
    assert soak.verdicts(summary)["mismatches"] is False and "| 1 of 6 |" in soak.markdown(
        dict(summary=summary, verdicts=soak.verdicts(summary), model="digits", command="test", environment=dict(
            torch=torch.__version__, cpus=2, threads=1, load_before="", load_after=""), serve_seconds=0.0,
            reference_seconds=0.0, reference_specs=3, profile=dataclasses.asdict(PROFILE), events=events,
            records=records))
