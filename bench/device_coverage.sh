#!/bin/bash
# The whole coverage matrix in one device call, on the machine's CPU cores (no GPU use): shards of
# families side by side (bench/coverage_shards.py), merged into $OUT/coverage/coverage.{json,md}.
#   device tool: run(command="bash bench/device_coverage.sh", carry=[".whl"])   (.whl: diffusers and its wheels)
set -u
# a copy of the checkout: pip builds in the source tree, and a GPU script may be installing from it beside this one
rm -rf /tmp/dit_repo_cov && cp -a "$(pwd)" /tmp/dit_repo_cov && cd /tmp/dit_repo_cov || exit 1
source bench/device_env.sh
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
timeout ${COVERAGE_TIMEOUT:-580} python3 "$repo/bench/coverage_shards.py" --shards ${SHARDS:-10} --timeout 300 \
  --deadline ${COVERAGE_DEADLINE:-540} \
  --earlier "$repo/bench/results/coverage.json" --out "$out/coverage"
echo "coverage rc=$?"
