#!/bin/bash
# The FLUX.1-dev-size benchmark on one H200 in one device call: regional compilation with DBCache,
# then the peers (diffusers FirstBlockCache, cache-dit, offload, plain torch.compile) from the same run.
#   device tool: run(command="bash bench/flux_cache_peers.sh", carry=[".whl"])   (.whl from ../shared/tools/device-wheels
#   cache-dit==1.5.3 diffusers); results under $OUT/regional/bench_flux_full.json and $OUT/flux_peers.json
set -u
source bench/device_env.sh
timeout 290 python3 -m dit_passes.bench --size full --rows compiled_regional_always --repeats 2 --out "$out/regional"
echo "regional rc=$?"
timeout 330 python3 "$repo/bench/flux_peers.py" --repeats 2 --out "$out" \
  --rows fbcache_never,fbcache_always,dbcache_always,offload_always,cachedit_never,cachedit_always,torchcompile_never
echo "peers rc=$?"
