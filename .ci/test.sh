#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# 1) two xdist workers on the 2 cores; the tests that spawn gloo ranks form one group that runs on one worker,
#    one at a time; 2) the tests that start Ray, alone (tests/conftest.py says why).
PYTEST=(.venv/bin/python -P -m pytest -q -p no:cacheprovider)
rc=0
"${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" --dist loadgroup -m "not ray" "$@" || rc=$?
"${PYTEST[@]}" -m ray "$@" || rc=$((rc ? rc : $?))
exit $rc
