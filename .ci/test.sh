#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# Two xdist workers on the 2 cores; the tests that start processes (Ray, gloo ranks) form one group that runs
# on one worker, one at a time (tests/conftest.py).
exec .venv/bin/python -P -m pytest -q -p no:cacheprovider -n ${PYTEST_WORKERS:-2} --dist loadgroup "$@"
