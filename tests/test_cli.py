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


@pytest.mark.parametrize("command", ["demo", "fidelity", "bench"])
def test_delegated_commands_are_lazy(command, capsys):
    module = f"dit_passes.{command}"
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} exists: its own tests cover it")
    assert main([command, "--anything"]) == 2
    assert f"{module} does not exist yet" in capsys.readouterr().err


def test_console_entry_runs_as_a_process():
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "dit_passes.cli", "inspect", "sd3"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "block lists: transformer_blocks x2" in r.stdout
