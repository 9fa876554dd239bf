#!/bin/bash
# The compiled FLUX.1-dev-size step's GPU time by kernel kind, and the SM clock / power while it runs.
#   device tool: run(command="bash bench/profile_flux_step.sh", carry=[".whl"])   (.whl: ../shared/tools/device-wheels
#   diffusers); results under $OUT/flux_step_profile.json and $OUT/flux_step_smi.csv
set -u
source bench/device_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 > "$out/flux_step_smi.csv" &
smi=$!
timeout 400 python3 "$repo/bench/profile_flux_step.py" --steps 10 --out "$out/flux_step_profile.json"
echo "profile rc=$?"
kill $smi
