"""cache-dit's utility names, each against cache-dit 1.5.3 itself: the profiler helpers (same signatures, defaults,
trace file), ``set_compile_configs`` (the same torch config afterwards), ``supported_pipelines`` /
``supported_matrix`` (cache-dit's format, our list from the coverage benchmark), ``parse_extra_modules`` (the same
modules from the same pipeline)."""
from __future__ import annotations

import gzip
import inspect
import json
import logging
import math
import pathlib
import types

import pytest
import torch

import dit_passes as dp

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


# ------------------------------------------------------------------------------------------------ profiler
@pytest.mark.parity("ProfilerContext", "profile_function", "create_profiler_context")
def test_profiler_writes_cache_dits_trace_file(tmp_path, caplog):
    cache_dit = pytest.importorskip("cache_dit")
    for name in ("profile_function", "create_profiler_context", "get_profiler_output_dir", "set_profiler_output_dir"):
        assert _params(getattr(dp, name)) == _params(getattr(cache_dit, name)), name
    assert _params(dp.ProfilerContext.__init__) == _params(cache_dit.ProfilerContext.__init__)

    a = torch.randn(16, 16)
    with dp.ProfilerContext(activities=["CPU"], output_dir=str(tmp_path), profile_name="run") as prof:
        a @ a
    assert prof.trace_path == tmp_path / "run.trace.json.gz"  # cache-dit's name on one rank
    events = json.loads(gzip.decompress(prof.trace_path.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)

    @dp.profile_function(activities=["CPU"], output_dir=str(tmp_path / "fn"))
    def step(x):
        return x + 1

    assert torch.equal(step(a), a + 1) and (tmp_path / "fn" / "step.trace.json.gz").is_file()
    with dp.create_profiler_context(output_dir=str(tmp_path / "off")):  # disabled unless asked, as cache-dit's
        a @ a
    assert not (tmp_path / "off").exists()
    with pytest.raises(ValueError, match="unknown \\['GPUS'\\]"):
        dp.ProfilerContext(activities=["GPUS"])
    if not torch.cuda.is_available():
        with caplog.at_level(logging.WARNING), dp.ProfilerContext(activities=["CPU", "GPU"],
                                                                   output_dir=str(tmp_path / "g")):
            pass
        assert "need CUDA" in caplog.text and (tmp_path / "g").is_dir()


@pytest.mark.parity("get_profiler_output_dir", "set_profiler_output_dir")
def test_profiler_output_dir_default_and_override(tmp_path, monkeypatch):
    cache_dit = pytest.importorskip("cache_dit")
    monkeypatch.delenv("CACHE_DIT_TORCH_PROFILER_DIR", raising=False)
    before = dp.get_profiler_output_dir()
    assert before == cache_dit.get_profiler_output_dir()  # cache-dit's default directory
    try:
        dp.set_profiler_output_dir(str(tmp_path))
        assert dp.get_profiler_output_dir() == str(tmp_path)
        assert dp.ProfilerContext().output_dir == tmp_path and dp.ProfilerContext(output_dir="/x").output_dir \
            == pathlib.Path("/x")
    finally:
        dp.set_profiler_output_dir(before)


# ------------------------------------------------------------------------------------------------ compile configs
def _configs():
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor
    return {"dynamo": dynamo, "inductor": inductor}


def _snapshot():
    out = {}
    for prefix, cfg in _configs().items():
        out.update({(prefix, k): v for k, v in cfg.get_config_copy().items()})
        out[(prefix, "force_disable_caches")] = getattr(cfg, "force_disable_caches", None)
    return out


def _effect(fn, **kwargs):
    """The torch config after ``fn(**kwargs)``; the config put back as it was."""
    before = _snapshot()
    try:
        fn(**kwargs)
        return _snapshot()
    finally:
        after = _snapshot()
        for (prefix, key), value in before.items():
            if after[(prefix, key)] != value and key != "force_disable_caches":
                setattr(_configs()[prefix], key, value)
        _configs()["inductor"].force_disable_caches = before[("inductor", "force_disable_caches")]


@pytest.mark.parity("set_compile_configs")
def test_set_compile_configs_sets_what_cache_dit_sets(monkeypatch):
    cache_dit = pytest.importorskip("cache_dit")
    for var in ("CACHE_DIT_FORCE_DISABLE_CUSTOM_COMPILE_CONFIG", "CACHE_DIT_EPILOGUE_PROLOGUE_FUSION"):
        monkeypatch.delenv(var, raising=False)
    assert _params(dp.set_compile_configs) == _params(cache_dit.set_compile_configs)
    untouched = _snapshot()
    for kwargs in ({}, {"descent_tuning": False}, {"force_disable_compile_caches": True, "cuda_graphs": True},
                   {"ulysses_anything": True, "use_fast_math": True}, {"epilogue_prologue_fusion": True},
                   {"capture_scalar_outputs": False, "capture_dynamic_output_shape_ops": True,
                    "cutedsl_enable_autotuning": False, "fx_graph_remote_cache": True}):
        ours, theirs = _effect(dp.set_compile_configs, **kwargs), _effect(cache_dit.set_compile_configs, **kwargs)
        diff = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
        assert not diff, (kwargs, diff)
        assert ours != untouched and theirs != untouched, kwargs  # each did set something
    assert _snapshot() == untouched
    with pytest.raises(TypeError, match="unknown keyword.*'dynamic'"):
        dp.set_compile_configs(dynamic=True)  # cache-dit drops it


# ------------------------------------------------------------------------------------------------ supported
def _coverage():
    return json.loads((ROOT / "bench" / "results" / "coverage.json").read_text())


@pytest.mark.parity("supported_pipelines", "supported_matrix")
def test_supported_lists_are_the_coverage_benchmarks_in_cache_dits_format():
    cache_dit = pytest.importorskip("cache_dit")
    from dit_passes.models.supported import SUPPORTED

    def exact(row, *cols):
        return all(row["cells"].get(c, {}).get("status") == "exact" for c in cols)

    rows = [r for r in _coverage()["rows"] if exact(r, "capture", "dbcache")]
    assert sorted(cls for cls, _, _ in SUPPORTED.values()) == sorted(r["class"] for r in rows)
    flags = {r["class"]: (exact(r, "ulysses", "ring"), exact(r, "tp")) for r in rows}
    assert all(flags[cls] == (cp, tp) for cls, cp, tp in SUPPORTED.values())
    assert all(cls.startswith(name) for name, (cls, _, _) in SUPPORTED.items())

    count, names = dp.supported_pipelines()
    ref_count, ref_names = cache_dit.supported_pipelines()
    assert (type(count), type(names), count) == (type(ref_count), type(ref_names), len(names)) and count == len(rows)
    assert {"Flux", "Wan", "QwenImage", "CogVideoX", "HunyuanVideo"} <= set(names) & set(ref_names)  # same naming

    matrix, ref = dp.supported_matrix(), cache_dit.supported_matrix()
    lines, ref_lines = matrix.splitlines(), ref.splitlines()
    assert lines[:2] == ref_lines[:2] and len(lines) == 2 + math.ceil(count / 2)
    assert all(line.count("|") == ref_lines[2].count("|") for line in lines[2:])
    assert "| **🎉Flux** | ✅ | ✅ | ✅ " in matrix


# ------------------------------------------------------------------------------------------------ extra modules
@pytest.mark.parity("parse_extra_modules")
def test_parse_extra_modules_finds_cache_dits_modules(caplog):
    cache_dit = pytest.importorskip("cache_dit")
    from diffusers import DiffusionPipeline

    class TwoEncoders(DiffusionPipeline):  # Flux's layout: a small first encoder, the large one second
        def __init__(self, text_encoder, text_encoder_2, vae):
            super().__init__()
            self.register_modules(text_encoder=text_encoder, text_encoder_2=text_encoder_2, vae=vae)

    pipe = TwoEncoders(torch.nn.Linear(2, 2), torch.nn.Linear(8, 8), torch.nn.Conv2d(1, 1, 1))
    own = torch.nn.Linear(3, 3)
    assert _params(dp.parse_extra_modules) == _params(cache_dit.parse_extra_modules)
    for args in ((pipe, ["text_encoder", "vae", own]), (pipe, ["text_encoder"], True), (pipe, []),
                 (types.SimpleNamespace(pipe=pipe), ["vae", "text_encoder_2"]), (object(), ["vae"]),
                 (pipe, ["unet", "vae"])):
        ours, theirs = dp.parse_extra_modules(*args), cache_dit.parse_extra_modules(*args)
        assert [id(m) for m in ours] == [id(m) for m in theirs], args
    assert dp.parse_extra_modules(pipe, ["text_encoder"]) == [pipe.text_encoder_2]
    assert "unet" in caplog.text  # the missing name is warned of, as cache-dit does
