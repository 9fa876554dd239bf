#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# tests/conftest.py marks the tests that run gloo ranks (`ranks`) and those that start Ray (`ray`).
# Three pytest processes side by side on the 2 cores:
#  - the Ray tests, at the normal priority: run alone after the others they took ~190 s of wall time with the cores
#    partly idle (clusters and actors starting, handshakes, shutdowns); a raylet must register within Ray's fixed
#    30 s (on 2 busy cores at equal priority it missed it), so the kernel serves them first and the two others
#    take the cores they leave;
#  - niced by 10: the rank tests one at a time in one pytest process (each keeps 2-4 rank processes busy; one
#    process, so the pooled ranks and the rank fixtures serve them all: two rank tests at once would run into
#    their rank timeouts), and the single-process tests on two xdist workers (they take the rest of the time:
#    both cores work on them once the other two are done).
PYTEST=(.venv/bin/python -P -m pytest -q -p no:cacheprovider)
rc=0
ray_log=$(mktemp)
ranks_log=$(mktemp)
"${PYTEST[@]}" -m ray "$@" >"$ray_log" 2>&1 &
ray_pid=$!
nice -n 10 "${PYTEST[@]}" -m "ranks and not ray" "$@" >"$ranks_log" 2>&1 &
ranks_pid=$!
nice -n 10 "${PYTEST[@]}" -n "${PYTEST_WORKERS:-2}" -m "not ranks and not ray" "$@" || rc=$?
wait "$ranks_pid" || rc=$((rc ? rc : $?))
wait "$ray_pid" || rc=$((rc ? rc : $?))
echo "--- the tests that run gloo ranks:"
cat "$ranks_log"
echo "--- the tests that start Ray:"
cat "$ray_log"
rm -f "$ranks_log" "$ray_log"
exit $rc
