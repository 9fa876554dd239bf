"""The ``dit-passes`` console script (dit_passes.cli:main)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from dit_passes.cli import available_passes, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_inspect_prints_structure_and_passes(capsys):
    assert main(["inspect", "flux"]) == 0
    out = capsys.readouterr().out
    assert "block lists: transformer_blocks x2" in out and "single_transformer_blocks x2" in out
    assert "4 blocks, 2 residual stream(s)" in out
    assert "== cleanup()" in out and "assert_removed=" in out and "+++ after" in out
    assert "## graph" not in out


def test_inspect_graph_variant_and_no_passes(capsys):
    assert main(["inspect", "wan", "--passes", "", "--variant", "alt_resolution", "--graph"]) == 0
    out = capsys.readouterr().out
    assert "variant=alt_resolution" in out and "blocks x2" in out
    assert "no passes ran" in out  # --passes "" disables even cleanup
    assert "## graph" in out and "torch.ops.aten.scaled_dot_product_attention.default" in out


def test_inspect_bad_arguments(capsys):
    assert main(["inspect", "not_a_model"]) == 2
    assert "unknown model 'not_a_model'; zoo families: flux" in capsys.readouterr().err
    assert main(["inspect", "flux", "--variant", "huge"]) == 2
    assert "has no variant 'huge'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"unknown pass\(es\) \['nope'\]; available: .*cleanup"):
        main(["inspect", "flux", "--passes", "cleanup,nope"])


def test_pass_registry_names():
    reg = available_passes()
    assert "cleanup" in reg and all(cls.name == name for name, cls in reg.items())


def test_delegated_command_missing_module_is_a_clear_error(monkeypatch, capsys):
    from dit_passes import cli
    monkeypatch.setitem(cli.DELEGATED, "demo", ("dit_passes.no_such_module", "x"))
    assert main(["demo", "--anything"]) == 2
    assert "dit_passes.no_such_module does not exist yet" in capsys.readouterr().err


def test_fidelity_and_bench_commands_run(tmp_path, capsys):
    # (the demo itself runs in tests/test_demo_plain_install.py, as a plain install runs it)
    import json
    assert main(["fidelity", "--list"]) == 0
    assert "ultra_mask_taylorseer" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown config"):
        main(["fidelity", "--configs", "nope", "--out", str(tmp_path / "f")])
    assert main(["bench", "--size", "tiny", "--rows", "graph,dbcache_always", "--repeats", "1",
                 "--out", str(tmp_path / "bench")]) == 0
    report = json.loads((tmp_path / "bench" / "bench_flux_tiny.json").read_text())
    assert report["rows"]["dbcache_always"]["cached_steps"] == 20  # 28 steps, 8 warm-up: every other step cached
    assert "| dbcache_always |" in capsys.readouterr().out


def test_console_entry_runs_as_a_process():
    # The installed package (the one mechanism); -P keeps the repository root off sys.path, where its kernels/
    # folder would shadow the PyPI package `kernels` that transformers imports.
    r = subprocess.run([sys.executable, "-P", "-m", "dit_passes.cli", "inspect", "sd3"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "block lists: transformer_blocks x2" in r.stdout
