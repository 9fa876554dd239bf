#!/bin/bash
# Attention kernel choice on one H200 in one device call: the SDPA backends at FLUX.1-dev's
# attention shape, then the FLUX.1-dev-size step with passes.AttentionBackend("cudnn") under regional compile
# (never / always cache after 8 warm-up steps), the same rows without it, and the cached row with max-autotune.
#   device tool: run(command="bash bench/flux_attention.sh", carry=[".whl"])   (.whl: ../shared/tools/device-wheels
#   diffusers); results under $OUT/attention_backends.json and $OUT/{cudnn,flash,cudnn_autotune}/bench_flux_full.json
set -u
source bench/device_env.sh
timeout 60 python3 "$repo/bench/attention_backends.py" --out "$out/attention_backends.json"; echo "backends rc=$?"
rows=compiled_regional_never,compiled_regional_always
timeout 150 python3 -m dit_passes.bench --size full --rows $rows --attention cudnn --repeats 2 --out "$out/cudnn"
echo "cudnn rc=$?"
timeout 110 python3 -m dit_passes.bench --size full --rows compiled_regional_never --repeats 2 --out "$out/flash"
echo "flash rc=$?"
timeout 200 python3 -m dit_passes.bench --size full --rows compiled_regional_always --attention cudnn --repeats 2 \
  --compile-mode max-autotune-no-cudagraphs --out "$out/cudnn_autotune"
echo "autotune rc=$?"
