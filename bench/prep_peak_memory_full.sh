#!/bin/bash
# Peak GPU memory while preparing FLUX.1-dev from a checkpoint, on one H200 in one device call:
# bench/prep_peak_memory.py, about 4 minutes (writing the 24 GB random bf16 checkpoint included).
#   device tool: run(command="bash bench/prep_peak_memory_full.sh")   (no wheels needed: the model is diffusers-free)
#   results: $OUT/prep_peak_memory.json and .md; extra arguments go to the script (e.g. --rows svdq_w4_r32,tp2)
# The checkpoint goes to /dev/shm when it has room (RAM: writes at memory speed), else to /tmp (disk); never under
# $OUT (it would come back).
set -u
source bench/device_env.sh
ckpt=/tmp/dit_passes_prep_peak_full
if [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -gt $((30 * 1024 * 1024)) ] 2>/dev/null; then
  ckpt=/dev/shm/dit_passes_prep_peak_full
fi
df -h "$(dirname "$ckpt")" | tail -1
timeout ${PREP_PEAK_TIMEOUT:-540} python3 "$repo/bench/prep_peak_memory.py" --size full --checkpoint "$ckpt" \
  --out "$out/prep_peak_memory" "$@"
echo "prep_peak_memory rc=$?"
