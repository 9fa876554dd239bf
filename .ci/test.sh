#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export TRITON_INTERPRET=1 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# -P: the repository root stays off sys.path (its kernels/ folder would shadow the PyPI package `kernels`).
# tests/conftest.py marks the tests that run gloo ranks (`ranks`) and those that start Ray (`ray`).
# The single-process tests on two xdist workers, niced by 10, beside the Ray tests at the normal priority; then the
# rank tests alone (niced), one at a time in one pytest process (each keeps 2-4 rank processes busy; one process, so
# the pooled ranks and the rank fixtures serve them all). Measured on this 2-core machine (fresh clones): alone the
# single-process tests took 360 s (693 CPU-s), the rank tests 260 s (378 CPU-s, the cores partly idle while the
# driver computes references), the Ray tests ~200 s (waiting on clusters and actors in part); this order 780 s; all
# three side by side from the start 840 s (5 or more busy processes thrash each other); the single-process tests
# alone, then ranks + Ray 940 s (the Ray tests' workers took the cores from the niced ranks); the rank tests started
# when the Ray tests ended, beside the rest of the single-process ones, slower still.
# Ray runs its workers (the actors that import torch, build and run the models) at nice 15 by default (its
# worker_niceness, to favour its raylet): below the niced tests, which then took the cores from them (beside
# everything the Ray tests once took 1054 s and a worker missed the launcher's 60 s start-up; beside 2 busy loops at
# nice 10, 460 s). RAY_worker_niceness=0 keeps them at the Ray side's priority: beside the niced rank tests the
# Ray tests took 174 s (161 s alone), and both sides ended at 334 s instead of 401 s one after the other; the 26
# rank / Ray test files and 6 heavy single-process ones took 522 s this way, 574 s with the Ray tests after the rank
# tests. A raylet must register within Ray's fixed 30 s, which it missed beside the rank tests at equal priority:
# hence the nice.
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
