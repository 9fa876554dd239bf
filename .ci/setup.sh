#!/usr/bin/env bash
# Creates .venv (if missing) and installs dit_passes: with its test dependencies (`bash .ci/setup.sh`, the
# default), or only what the library and the demo need (`bash .ci/setup.sh main`, what .ci/demo.sh uses).
# On machines without CUDA, torch is pinned to the local CPU build (torch==2.13.0) through a
# constraints file, so no multi-GB CUDA wheel is pulled in by any dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
CONSTRAINTS=.ci/constraints-cpu.txt
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  CONSTRAINTS=.ci/constraints-gpu.txt
fi
if [ "${1:-dev}" = main ]; then TARGET="."; else TARGET=".[dev]"; fi
# Skipped when this very install already ran into this .venv (same target, constraints, pyproject and script):
# pip's no-op run still resolves every requirement and rebuilds the editable wheel (~15 s of CPU). Remove the
# stamp to force the install.
STAMP=.venv/.dit_passes_setup
WANT="$TARGET $(cat "$CONSTRAINTS" pyproject.toml .ci/setup.sh | cksum)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
# One pip run (one resolution) for torch / triton and the package: the constraints pin torch either way.
# --no-compile, then compileall on every core: pip writes the bytecode of torch's thousands of files in one process
# (about a minute of the setup; 25 s on 2 cores). The bytecode must be written here: CI's machines set
# PYTHONDONTWRITEBYTECODE, so a module without it is compiled again in every process that imports it (torch,
# diffusers and dit_passes took 16 s to import instead of 8). compileall exits 1 on the files that are not Python 3.11
# (e.g. torch's py312_intrinsics.py), which pip's compile skips as well.
.venv/bin/python -m pip install -q --no-compile --disable-pip-version-check -c "$CONSTRAINTS" "torch==2.13.0" "triton==3.6.0" \
  -e "$TARGET"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages dit_passes kernels patterns >/dev/null 2>&1 || true
echo "$WANT" >"$STAMP"
