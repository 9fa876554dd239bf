#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`)
exec .venv/bin/python -P -m pytest -q -p no:cacheprovider "$@"
