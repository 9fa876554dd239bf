"""``dit-passes demo`` from a plain install: the dev-only packages absent, the report still written.

The demo runs in a subprocess whose import system cannot see the packages that only the ``dev`` extras
install (matplotlib, scikit-learn, cache-dit, peft, pytest): a ``sitecustomize`` on ``PYTHONPATH``
replaces the path finder by one that answers "not found" for them, which is what a plain ``pip install .``
environment answers (``importlib.util.find_spec`` is None, ``import`` raises ModuleNotFoundError).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV_ONLY = ("matplotlib", "sklearn", "cache_dit", "peft", "pytest", "_pytest", "pluggy")

HIDE = f'''
import sys
from importlib.machinery import PathFinder

HIDDEN = {set(DEV_ONLY)!r}


class HidingPathFinder(PathFinder):
    """PathFinder that does not find the dev-only packages."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [HidingPathFinder if f is PathFinder else f for f in sys.meta_path]
'''


def test_demo_runs_without_dev_packages(tmp_path):
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)
    out = tmp_path / "demo"
    path = [str(tmp_path / "hide")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}  # one thread: CI's setting
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            f"print([n for n in {DEV_ONLY!r} if u.find_spec(n) is not None])"],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", (probe.stdout, probe.stderr[-2000:])

    # the default configurations (no --configs): the demo a user runs
    r = subprocess.run([sys.executable, "-m", "dit_passes.cli", "demo", "--steps", "4", "--seeds", "0", "--labels",
                        "3", "--out", str(out)],  # one image: the plain-install path is the same for any batch
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "note: matplotlib is not installed" in r.stdout
    assert "device: cpu" in r.stdout and "Takeaway:" in r.stdout
    assert "capture + passes, dbcache:" in r.stdout
    for name in ("baseline", "dbcache", "fast_mask", "fast_mask_taylorseer"):
        assert f"| {name} |" in r.stdout, r.stdout
    assert (out / "fidelity_grid.png").is_file() and not (out / "fidelity_steps.png").exists()
    report = json.loads((out / "fidelity_report.json").read_text())
    assert report["plot"] is None and set(report["configs"]) == {"dbcache", "fast_mask", "fast_mask_taylorseer"}
    assert report["num_samples"] == 1
