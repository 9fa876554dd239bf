"""``dit-passes fidelity --sweep`` (dit_passes.fidelity_sweep): the Pareto front, the x of a point, the CLI's files."""
from __future__ import annotations

import json
import math
import sys

import pytest

from dit_passes import fidelity_sweep as fs
from dit_passes.cli import main


def test_pareto_front_less_work_more_psnr():
    pts = [(1.0, 60.0),   # 0: most work, best PSNR: on the front
           (0.8, 50.0),   # 1: on
           (0.8, 45.0),   # 2: same work as 1, worse PSNR: off
           (0.9, 48.0),   # 3: more work than 1 and worse: off
           (0.5, 30.0),   # 4: on
           (0.5, 30.0),   # 5: a tie with 4 (neither better in one): both on
           (0.6, 29.0),   # 6: dominated by 4: off
           (0.3, float("nan")),  # 7: NaN: never on
           (0.9, float("inf"))]  # 8: identical images: dominates 0 (less work, PSNR inf)
    assert fs.pareto_front(pts, x_lower_is_better=True) == [4, 5, 1, 8]


def test_pareto_front_more_speed_more_psnr():
    pts = [(1.0, 60.0), (2.0, 50.0), (1.5, 40.0), (3.0, 20.0), (3.0, 25.0), (0.9, 70.0)]
    # 2 is beaten by 1 (faster and better), 3 by 4 (as fast, better); sorted by speed
    assert fs.pareto_front(pts, x_lower_is_better=False) == [5, 0, 1, 4]
    assert fs.pareto_front([], x_lower_is_better=False) == []


def test_work_fraction_block_or_module_calls():
    block = {"stats_mean": {"executed_block_fraction": 0.625}, "stats": []}
    assert fs.work_fraction(block) == (0.625, fs.BLOCK_X)
    # an attention-level cache reports decisions only: the fraction of calls its modules ran, over every run
    module = {"stats_mean": {}, "stats": [{"step_cached": [False, True, True, False]},
                                          {"step_cached": [False, False, True, False]}]}
    assert fs.work_fraction(module) == (1 - 3 / 8, fs.MODULE_X)
    x, kind = fs.work_fraction({"stats_mean": {}, "stats": [{}]})
    assert math.isnan(x) and kind == fs.MODULE_X


def test_work_front_compares_block_fractions_only():
    pts = {"fbc": [{"threshold": 0.1, "work_fraction": 0.5, "x": fs.BLOCK_X, "psnr_mean": 40.0, "speedup": 2.0},
                   {"threshold": 0.2, "work_fraction": 0.4, "x": fs.BLOCK_X, "psnr_mean": 35.0, "speedup": 1.5}],
           "attn": [{"threshold": 2, "work_fraction": 0.3, "x": fs.MODULE_X, "psnr_mean": 50.0, "speedup": 1.2}]}
    fronts = fs.mark_fronts(pts)
    # the attention-level point would dominate both on x: it is another quantity, so it is off the work front
    assert fronts["work"] == [["fbc", 0.2], ["fbc", 0.1]]
    assert fronts["speed"] == [["attn", 2], ["fbc", 0.1]]  # fbc@0.2 is slower and worse than fbc@0.1
    assert [p.get("pareto_work", False) for p in pts["fbc"] + pts["attn"]] == [True, True, False]


def test_sweep_context_computes_a_calibration_once():
    ctx = fs.SweepContext(pipe=None, steps=4, seeds=[0], labels=[1], true_cfg_scale=1.0)
    calls = []
    for _ in range(3):
        assert ctx.once("ratios", lambda c: calls.append(c.steps) or [1.0] * c.steps) == [1.0] * 4
    assert calls == [4] and ctx.calibrations == {"ratios": [1.0] * 4}


def test_every_method_builds_its_passes():
    ctx = fs.SweepContext(pipe=None, steps=8, seeds=[0], labels=[1], true_cfg_scale=1.0)
    ctx.calibrations["mag_ratios"] = [1.0] * 8  # stands for the calibration (no pipeline here)
    for name, (builder, thresholds) in fs.SWEEP_METHODS.items():
        assert len(thresholds) >= 2 and thresholds == sorted(thresholds), name
        built = builder(thresholds[0], ctx)
        assert built and all(hasattr(p, "run") for p in built), name


def test_no_matplotlib_notice(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert fs.write_plot({"methods": {}}, tmp_path / fs.PLOT_NAME) is False
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / fs.PLOT_NAME).exists()


def test_cli_sweep_writes_plot_json_and_table(tmp_path, capsys):
    """One method (MagCache: its calibration runs first) x 2 thresholds, --quick (8 steps, 1 seed, 2 labels)."""
    out = tmp_path / "sweep"
    assert main(["fidelity", "--sweep", "--quick", "--methods", "mag_cache", "--out", str(out)]) == 0
    report = json.loads((out / fs.JSON_NAME).read_text())
    assert report["steps"] == 8 and report["seeds"] == [0] and report["labels"] == [1, 7]
    assert report["command"] == f"dit-passes fidelity --sweep --quick --methods mag_cache --out {out}"
    thresholds = fs.SWEEP_METHODS["mag_cache"][1]
    pts = report["methods"]["mag_cache"]
    assert [p["threshold"] for p in pts] == [thresholds[0], thresholds[-1]]
    ratios = report["calibrations"]["mag_ratios"]
    assert len(ratios) == 8 and ratios[0] == 1.0 and all(0.5 < r < 1.5 for r in ratios[1:])
    for p in pts:
        assert p["x"] == fs.BLOCK_X and p["speedup"] > 0 and 0 < p["ssim_mean"] <= 1
        # MagCache skips the whole block range: the work executed is the calls computed
        assert p["work_fraction"] == pytest.approx(1 - p["cached_calls"] / 8)
    assert pts[1]["cached_calls"] >= pts[0]["cached_calls"] and pts[1]["cached_calls"] > 0  # the loose threshold skips
    # the fronts in the file are the front of its points
    for key, field, lower in (("work", "work_fraction", True), ("speed", "speedup", False)):
        psnr = [math.inf if p["psnr_mean"] == "inf" else p["psnr_mean"] for p in pts]
        front = fs.pareto_front([(p[field], y) for p, y in zip(pts, psnr)], x_lower_is_better=lower)
        assert report["pareto"][key] == [["mag_cache", pts[i]["threshold"]] for i in front]
        assert [bool(p.get(f"pareto_{key}")) for p in pts] == [i in front for i in range(len(pts))]
    md = (out / fs.TABLE_NAME).read_text()
    assert report["command"] in md and md.count("| mag_cache |") == 2 and "Pareto front" in md
    assert (out / fs.PLOT_NAME).stat().st_size > 10_000  # matplotlib is a dev extra, so present here
    assert "| mag_cache |" in capsys.readouterr().out


def _generic_sampler(pipe, labels):
    """The digits pipeline driven as any diffusers pipeline is: by its call arguments (here, embeddings)."""
    from dit_passes.fidelity import pipeline_sampler
    embeds, pooled = pipe.digits_cond(labels)
    size = pipe.digits_image_size
    return pipeline_sampler(pipe, prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=size, width=size,
                            guidance_scale=1.0)


def test_pipeline_sampler_is_the_digits_sampler_on_the_digits_pipeline():
    import torch

    from dit_passes import compile_dit, passes
    from dit_passes.fidelity import digits_sampler
    from dit_passes.models.digits import load_digits_pipeline
    pipe, _ = load_digits_pipeline()
    generic, digits = _generic_sampler(pipe, [1, 7]), digits_sampler(pipe, [1, 7])
    assert torch.equal(generic(None, 3, 4), digits(None, 3, 4))
    cached = compile_dit(pipe.transformer, passes=[passes.FirstBlockCache(threshold=0.2)], keep_original=True)
    a, b = generic(cached, 3, 6), digits(cached, 3, 6)  # each call starts a new generation
    assert torch.equal(a, b) and a.shape == (2, 1, pipe.digits_image_size, pipe.digits_image_size)


def test_sweep_on_another_pipeline():
    from dit_passes.models.digits import load_digits_pipeline
    pipe, _ = load_digits_pipeline()
    report = fs.run_sweep(["first_block_cache"], seeds=[0], labels=[], steps=6,
                          thresholds={"first_block_cache": [0.05, 0.5]}, pipe=pipe,
                          sampler=_generic_sampler(pipe, [2, 4]), timing_repeats=1)
    points = report["methods"]["first_block_cache"]
    assert [p["threshold"] for p in points] == [0.05, 0.5]
    assert report["model"] == "FluxTransformer2DModel through FluxPipeline"
    assert points[0]["work_fraction"] > points[1]["work_fraction"]  # the higher threshold skips more


def test_user_pipeline_bad_input():
    with pytest.raises(SystemExit, match="MODULE:FUNCTION"):
        fs.user_pipeline("no_colon_here", ["a cat"], "{}")
    with pytest.raises(SystemExit, match="--prompt"):
        fs.user_pipeline("dit_passes.models.digits:load_digits_pipeline", None, "{}")
    with pytest.raises(SystemExit, match="not JSON"):
        fs.user_pipeline("dit_passes.models.digits:load_digits_pipeline", ["x"], "{height: 1}")
    with pytest.raises(SystemExit, match="not a diffusers pipeline"):  # it returns (pipe, info), not a pipeline
        fs.user_pipeline("dit_passes.models.digits:load_digits_pipeline", ["x"], "{}")
