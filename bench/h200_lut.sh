#!/bin/bash
# SVDQuant's lookup-table design (issue 22; quant/w4_lut.py, kernels/w4a8_lut_cutlass.cu) in one device call: its GPU
# tests, the per-linear table beside the designs it competes with, then the FLUX step rows graphed.
#   device tool: run(command="bash bench/h200_lut.sh", carry=[".whl", ".cutlass_cache"])
#   .whl: ../shared/tools/device-wheels nvidia-cutlass==4.2.0.0 (the headers); .cutlass_cache: the library built on
#   the CPU machine (same nvcc), so the device compiles nothing: DIT_PASSES_CUTLASS_CACHE=.cutlass_cache python -c
#   "from dit_passes.kernels import w4a8_lut_cutlass as L, cutlass_build as B; B.build(L.LIBRARY)"
# Results under $OUT: gpu_tests_lut.log, linears/h200_quant_step.{json,md}, step/h200_quant_step.{json,md}.
set -u
export DIT_PASSES_CUTLASS_CACHE=${DIT_PASSES_CUTLASS_CACHE:-$(pwd)/.cutlass_cache}
out=${OUT:-$(pwd)/out/lut}
GPU_TEST_FILES="tests/test_w4_lut.py" GPU_TESTS_LOG=gpu_tests_lut.log GPU_TESTS_TIMEOUT=${LUT_TESTS_TIMEOUT:-90} \
  bash bench/h200_gpu_tests.sh -k "cuda or act_kernel"
configs=$(python3 -c "import re; print(','.join('w4a8_gemm_lut_' + c for c in re.findall(r'\"(\w+)\"',
  open('kernels/w4a8_lut_cutlass.py').read().split('CONFIGS = [')[1].split(']')[0])))")
OUT=$out/linears QUANT_STEP_TIMEOUT=${LUT_LINEARS_TIMEOUT:-200} bash bench/h200_quant_step.sh --linears-only \
  --linears ${LUT_LINEARS:-bf16_mm,fp8_gemm,svdq_lrcat_split_mm,svdq_lut,$configs}
OUT=$out/step QUANT_STEP_TIMEOUT=${LUT_STEP_TIMEOUT:-300} bash bench/h200_quant_step.sh \
  --budget-s ${LUT_BUDGET_S:-150} \
  --repeats 5 --profile-steps 1 --linears "" \
  --rows ${LUT_ROWS:-bf16_graphed,svdq_w4_lut_pointwise_graphed,svdq_w4_expand_pointwise_graphed}
