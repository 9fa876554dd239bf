#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# tests/conftest.py marks the tests that run gloo ranks (`ranks`) and those that start Ray (`ray`).
# 1) side by side on the 2 cores: the rank tests one at a time in one pytest process (each keeps 2-4 rank
#    processes busy; one process, so the pooled ranks and the rank fixtures serve them all), and the
#    single-process tests on two xdist workers (they take twice the rank tests' time: both cores work on them
#    once the rank tests are done); 2) the Ray tests alone (a raylet must register within Ray's fixed 30 s: on 2
#    busy cores it missed it).
# Captured graphs are shared by all the processes of this run (xdist workers, rank processes, Ray) through a
# directory (dit_passes/infra/trace_store.py): one process captures a model, the others load it. A fixed hash seed
# keeps the keys alike across processes (diffusers' configs hold lists built from sets).
trace_dir=$(mktemp -d)
trap 'rm -rf "$trace_dir"' EXIT
export DIT_PASSES_TRACE_DIR=$trace_dir PYTHONHASHSEED=${PYTHONHASHSEED:-0}
PYTEST=(.venv/bin/python -P -m pytest -q -p no:cacheprovider)
rc=0
ranks_log=$(mktemp)
"${PYTEST[@]}" -m "ranks and not ray" "$@" >"$ranks_log" 2>&1 &
ranks_pid=$!
"${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" -m "not ranks and not ray" "$@" || rc=$?
wait "$ranks_pid" || rc=$((rc ? rc : $?))
echo "--- the tests that run gloo ranks:"
cat "$ranks_log"
rm -f "$ranks_log"
"${PYTEST[@]}" -m ray "$@" || rc=$((rc ? rc : $?))
exit $rc
