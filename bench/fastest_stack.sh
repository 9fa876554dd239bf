#!/bin/bash
# The fastest stack on one GPU, one device call: the CUDA-graph step's tests, cache-dit + compile_repeated_blocks (its own
# process), then our rows and the step profile (bench/fastest_stack.py), merged into $OUT/fastest_stack.{json,md}.
#   device tool: run(command="bash bench/fastest_stack.sh", carry=[".whl"])   (.whl: ../shared/tools/device-wheels
#   cache-dit==1.5.3 diffusers)
set -u
source bench/device_env.sh
(cd "$repo" && timeout ${TESTS_TIMEOUT:-200} python3 -P -m pytest -q -p no:cacheprovider -rA \
  tests/test_cuda_graph_step.py 2>&1 | tee "$out/gpu_tests_cuda_graph_step.log" | tail -25)
echo "tests rc=$?"
timeout ${PEERS_TIMEOUT:-150} python3 "$repo/bench/flux_peers.py" --repeats 2 --out "$out" --rows cacheditregional_always
echo "peers rc=$?"
timeout ${FASTEST_TIMEOUT:-330} python3 "$repo/bench/fastest_stack.py" --out "$out" --peers "$out/flux_peers.json" "$@"
echo "fastest rc=$?"
