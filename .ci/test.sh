#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# tests/conftest.py marks the tests that run gloo ranks (`ranks`) and those that start Ray (`ray`).
# Order (measured on a 2-core machine): the single-process tests on two xdist workers, niced by 10, beside the Ray
# tests; then the rank tests alone, niced, in one pytest process (the pooled ranks and rank fixtures serve them all).
# Ray's workers run at the Ray side's priority (RAY_worker_niceness=0, not Ray's default 15): below the niced tests
# they lost the cores and a raylet missed Ray's fixed 30 s registration; all three groups at once thrash.
# Captured graphs are shared by all the processes of this run (xdist workers, rank processes, Ray) through a
# directory (dit_passes/infra/trace_store.py): one process captures a model, the others load it. A fixed hash seed
# keeps the keys alike across processes (diffusers' configs hold lists built from sets).
trace_dir=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$trace_dir" "$logs"' EXIT
export DIT_PASSES_TRACE_DIR=$trace_dir PYTHONHASHSEED=${PYTHONHASHSEED:-0}
PYTEST=(.venv/bin/python -P -m pytest -q -p no:cacheprovider)

rc=0
RAY_worker_niceness=0 "${PYTEST[@]}" -m ray "$@" >"$logs/ray" 2>&1 &
ray_pid=$!
nice -n 10 "${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" -m "not ranks and not ray" "$@" || rc=$?
wait "$ray_pid" || rc=$((rc ? rc : $?))
nice -n 10 "${PYTEST[@]}" -m "ranks and not ray" "$@" >"$logs/ranks" 2>&1 || rc=$((rc ? rc : $?))
echo "--- the tests that run gloo ranks:"
cat "$logs/ranks"
echo "--- the tests that start Ray:"
cat "$logs/ray"
exit $rc
