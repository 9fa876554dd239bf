#!/bin/bash
# The quantization step benchmark on one H200 in one device call: bench/quant_step.py, ~4 minutes.
#   device tool: run(command="bash bench/quant_step.sh")   (no wheels needed: the model is diffusers-free)
#   results: $OUT/quant_step.json and .md; extra arguments go to the script (e.g. --rows bf16,fp8)
set -u
source bench/device_env.sh
timeout ${QUANT_STEP_TIMEOUT:-540} python3 "$repo/bench/quant_step.py" --out "$out" "$@"
echo "quant_step rc=$?"
