#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# tests/conftest.py marks the tests that run gloo ranks (`ranks`) and those that start Ray (`ray`).
# Order (measured on a 2-core machine): all three groups start at once, ranked by CPU priority, so the cores are
# never idle: the Ray tests at the normal priority (their workers too: RAY_worker_niceness=0, not Ray's default 15;
# a raylet must register within Ray's fixed 30 s), the rank tests niced by 5 in one pytest process (two rank tests at
# once would put 4-8 busy processes on 2 cores), the single-process tests niced by 15 on two xdist workers: they take
# what the other two leave (a rank test waits in gloo, a Ray test on its workers' start-up) and the whole machine
# once those end. Run one after another, the rank group left a core idle for most of its minutes.
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
nice -n 5 "${PYTEST[@]}" -m "ranks and not ray" "$@" >"$logs/ranks" 2>&1 &
ranks_pid=$!
nice -n 15 "${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" -m "not ranks and not ray" "$@" || rc=$?
wait "$ray_pid" || rc=$((rc ? rc : $?))
wait "$ranks_pid" || rc=$((rc ? rc : $?))
echo "--- the tests that run gloo ranks:"
cat "$logs/ranks"
echo "--- the tests that start Ray:"
cat "$logs/ray"
exit $rc
