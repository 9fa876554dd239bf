#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# tests/conftest.py marks the tests that run gloo ranks (`ranks`) and those that start Ray (`ray`).
# Two sides on the 2 cores:
#  - the single-process tests on two xdist workers, from start to end;
#  - the rank tests one at a time in one pytest process (each keeps 2-4 rank processes busy; one process, so the
#    pooled ranks and the rank fixtures serve them all), then the Ray tests. Run beside the rank tests, a raylet
#    missed Ray's fixed 30 s to register (on 2 busy cores at equal priority) and the Ray tests took 1054 s; run alone
#    after everything they left the cores partly idle for ~190 s (clusters and actors starting, handshakes). So they
#    start when the rank tests end, and the single-process tests still running are then niced by 10: the Ray
#    processes get the CPU they ask for, the xdist workers take what they leave. Ray runs its workers (the actors
#    that import torch, build and run the models) at nice 15 by default (its worker_niceness, to favour the raylet):
#    below the niced xdist workers, which then took the cores from them. RAY_worker_niceness=0 keeps them at the
#    Ray side's own priority.
# Captured graphs are shared by all the processes of this run (xdist workers, rank processes, Ray) through a
# directory (dit_passes/infra/trace_store.py): one process captures a model, the others load it. A fixed hash seed
# keeps the keys alike across processes (diffusers' configs hold lists built from sets).
trace_dir=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$trace_dir" "$logs"' EXIT
export DIT_PASSES_TRACE_DIR=$trace_dir PYTHONHASHSEED=${PYTHONHASHSEED:-0}
PYTEST=(.venv/bin/python -P -m pytest -q -p no:cacheprovider)

descendants() {  # the process ids under $1 (xdist's workers), deepest last
  local child
  for child in $(ps -o pid= --ppid "$1"); do
    echo "$child"
    descendants "$child"
  done
}

"${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" -m "not ranks and not ray" "$@" &
single_pid=$!
rc=0
"${PYTEST[@]}" -m "ranks and not ray" "$@" >"$logs/ranks" 2>&1 || rc=$?
if kill -0 "$single_pid" 2>/dev/null; then
  # shellcheck disable=SC2046
  renice -n 10 -p "$single_pid" $(descendants "$single_pid") >/dev/null 2>&1 || true
fi
RAY_worker_niceness=0 "${PYTEST[@]}" -m ray "$@" >"$logs/ray" 2>&1 || rc=$((rc ? rc : $?))
wait "$single_pid" || rc=$((rc ? rc : $?))
echo "--- the tests that run gloo ranks:"
cat "$logs/ranks"
echo "--- the tests that start Ray:"
cat "$logs/ray"
exit $rc
