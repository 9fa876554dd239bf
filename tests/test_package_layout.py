"""kernels/ and patterns/ reach Python only as dit_passes.kernels / dit_passes.patterns, through an install.

One mechanism: the package is installed (regular or editable); a bare source checkout fails at
``import dit_passes`` with one error that says to ``pip install -e .``; imported as top-level ``kernels`` (the
repository root on sys.path), the folder hands the name over to the PyPI package that transformers imports.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import dit_passes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, cwd="/",
                          timeout=120)


def test_installed_package_maps_the_top_level_folders():
    import dit_passes.kernels
    import dit_passes.patterns

    assert os.path.dirname(dit_passes.kernels.__file__) == os.path.join(REPO, "kernels") or \
        not dit_passes.__file__.startswith(REPO)  # a regular install holds its own copy
    assert dit_passes.patterns.__name__ == "dit_passes.patterns"


def test_no_loader_workarounds_besides_the_top_level_hand_over():
    # kernels/__init__.py touches sys.modules only under the top-level name `kernels` (the hand-over below);
    # nothing else loads our files by path
    src = open(os.path.join(REPO, "kernels", "__init__.py")).read()
    assert src.count('if __name__ == "kernels":') == 1
    for path in ("dit_passes/quant/dispatch.py", "dit_passes/quant/custom_ops.py", "dit_passes/passes/quantize.py",
                 "kernels/w4a4_cutlass_linear.py", "kernels/w4a4_triton.py"):
        text = open(os.path.join(REPO, path)).read()
        assert "spec_from_file_location" not in text and "_sibling" not in text, path


def test_bare_checkout_fails_with_one_clear_error():
    # -S: no site-packages (hence no editable finder, no install), -P: no cwd; only the repository root.
    r = _run(f"import sys; sys.path[:] = [{REPO!r}] + [p for p in sys.path if 'site-packages' not in p]; "
             "import dit_passes", "-S", "-P")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: dit_passes was imported from") and "pip install -e ." in last, r.stderr


def test_top_level_kernels_is_never_this_folder():
    # the repository root on sys.path (a script or a Ray worker started there): `import kernels`, as transformers
    # does, gets the PyPI package, not this folder
    r = _run(f"import sys; sys.path.insert(0, {REPO!r}); import kernels; print(kernels.__file__)", "-P")
    assert r.returncode == 0, r.stderr
    assert not r.stdout.strip().startswith(os.path.join(REPO, "kernels")), r.stdout
