#!/bin/bash
# Our ctypes CUDA-graph IF nodes (dit_passes/infra/cuda_if_node.py) on the GPU, one device call:
# (1) bench/if_node_selftest.py (every CUDA / NVRTC call traced with its return code: $OUT/if_node_selftest.log),
# (2) tests/test_cuda_graph_step.py (the graphed DiT step on torch 2.11 through our IF nodes: $OUT/if_node_pytest.log).
#   device tool: run(command="bash bench/cuda_if_node.sh", carry=[".whl"])   (.whl: diffusers for the zoo models)
# Run from the repository root (python -P: the checkout's dit_passes/ must not shadow the installed package).
set -u
repo=$(pwd)
out=${OUT:-$repo/out/if_node}
mkdir -p "$out"
site=/tmp/dit_site_if_node
rm -rf "$site" && mkdir -p "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl >&2 || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . >&2 || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1 OUT="$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
set -o pipefail
echo "=== (1) self-test (full log: $out/if_node_selftest.log)"
DIT_PASSES_CUDA_TRACE=1 timeout ${SELFTEST_TIMEOUT:-150} python3 -P bench/if_node_selftest.py \
  > "$out/if_node_selftest.log" 2>&1
echo "selftest rc=$?"
# the stage results, every failing CUDA call and the tracebacks; the full trace stays in the log
grep -E "^(=====|PASS|FAIL|selftest:)|-> [1-9][0-9]* \(|Error|error|Traceback|^  File|^\s+raise" \
  "$out/if_node_selftest.log" | head -150
echo "=== (2) tests/test_cuda_graph_step.py (full log: $out/if_node_pytest.log)"
# traced too: a failing test's captured stderr then lists its CUDA calls and their return codes
DIT_PASSES_CUDA_TRACE=1 timeout ${PYTEST_TIMEOUT:-360} python3 -P -m pytest -q -p no:cacheprovider -ra \
  tests/test_cuda_graph_step.py > "$out/if_node_pytest.log" 2>&1
echo "pytest rc=$?"
grep -vE "^\[cuda_if_node\] .* -> 0 \(ok\)$" "$out/if_node_pytest.log" | tail -150
