#!/bin/bash
# The tests that skip without a GPU (all nineteen files, or GPU_TEST_FILES, or the node ids listed in the file
# GPU_TEST_IDS), on the device, in one call; log to $OUT/gpu_tests.log.
#   PYTHON=.venv/bin/python bash bench/gpu_tests.sh --list   (on a CPU machine: runs the files here and writes
#   the node ids of the tests that skipped to bench/gpu_test_ids.txt; then GPU_TEST_IDS=bench/gpu_test_ids.txt runs
#   exactly those on the device)
#   device tool: run(command="bash bench/gpu_tests.sh", carry=[".whl"])   (.whl: ../shared/tools/device-wheels
#   nvidia-cutlass==4.2.0.0 diffusers ...: the CUTLASS headers, and diffusers for the zoo models)
# Run from the repository root (pytest -P: the checkout's kernels/ folder must not shadow the installed package).
set -u
repo=$(pwd)
files=${GPU_TEST_FILES:-"tests/test_cuda_graph_step.py tests/test_quant_nvfp4.py tests/test_kernels_cutlass.py
  tests/test_kernels_w4a4.py tests/test_kernels_w4a8.py tests/test_quant_core.py tests/test_quant_forms.py
  tests/test_fp8_rowquant.py tests/test_w4_expand.py tests/test_lrcat.py tests/test_lrcat_act.py
  tests/test_w4a16_rows.py tests/test_weight_only_rows.py tests/test_triton_kernel_globals.py
  tests/test_lrcat_smoothed.py tests/test_epilogue_passes.py tests/test_norm_rope.py tests/test_norm_modulate.py
  tests/test_w4_lut.py"}
if [ "${1:-}" = "--list" ]; then  # pytest -v names each skipped test; the interpreter stands in for the kernels
  list=bench/gpu_test_ids.txt
  { sed -n '1,2p' "$list"
    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 ${PYTHON:-python3} -P -m pytest -p no:cacheprovider -v $files \
      | sed -n 's/^\(tests\/[^ ]*\) SKIPPED.*/\1/p' | sort -u; } > "$list.new" && mv "$list.new" "$list"
  echo "$(grep -vc '^#' "$list") node ids in $list"
  exit 0
fi
out=${OUT:-$repo/out/gpu_tests}
mkdir -p "$out"
site=/tmp/dit_site_tests
rm -rf "$site" && mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl >&2 || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . >&2 || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1 DIT_PASSES_TEST_CUTLASS_BUILD=1
set -o pipefail
# GPU_TEST_FILES: a part of the list when one device call cannot hold all (file paths or pytest node ids)
[ -n "${GPU_TEST_IDS:-}" ] && files=$(grep -v '^#' "$GPU_TEST_IDS")
timeout ${GPU_TESTS_TIMEOUT:-500} python3 -P -m pytest -q -p no:cacheprovider -rA "$@" $files \
  2>&1 | tee "$out/${GPU_TESTS_LOG:-gpu_tests.log}" | grep -v "^PASSED"
echo "gpu tests rc=$?"
