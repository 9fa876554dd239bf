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
.venv/bin/python -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "torch==2.13.0" "triton==3.6.0"
if [ "${1:-dev}" = main ]; then TARGET="."; else TARGET=".[dev]"; fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" -e "$TARGET"
