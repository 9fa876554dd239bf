#!/usr/bin/env bash
# The README's demo command: set up (idempotent) and run the main job on the embedded trained DiT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh main  # the library alone: the demo needs none of the test-only packages
exec .venv/bin/dit-passes demo "$@"
