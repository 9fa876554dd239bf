#!/bin/bash
# SVDQuant's lookup-table design (quant/w4_lut.py, kernels/w4a8_lut_cutlass.cu, kernels/lut_act_triton.py)
# in one device call: its GPU tests, then one run of bench/quant_step.py holding the step rows (bf16, fp8 and the
# LUT designs, regional compile, graphed) and the per-linear table: quant_step.{json,md}.
#   device tool: run(command="bash bench/svdquant_lut.sh", carry=[".whl", ".cutlass_cache"])
#   .whl: ../shared/tools/device-wheels nvidia-cutlass==4.2.0.0 (the headers); .cutlass_cache: the library built on
#   the CPU machine (same nvcc), so the device compiles nothing: DIT_PASSES_CUTLASS_CACHE=.cutlass_cache python -c
#   "from dit_passes.kernels import w4a8_lut_cutlass as L, cutlass_build as B; B.build(L.LIBRARY)"
# Results under $OUT: gpu_tests_lut.log, step/quant_step.{json,md}, step/quant_linear_ceiling.{json,md} (the
# per-linear target's bound from this run's GEMM and bandwidth rows).
set -u
export DIT_PASSES_CUTLASS_CACHE=${DIT_PASSES_CUTLASS_CACHE:-$(pwd)/.cutlass_cache}
out=${OUT:-$(pwd)/out/lut}
GPU_TEST_FILES=${LUT_TEST_FILES:-"tests/test_w4_lut.py tests/test_quant_forms.py"} GPU_TESTS_LOG=gpu_tests_lut.log \
  GPU_TESTS_TIMEOUT=${LUT_TESTS_TIMEOUT:-120} bash bench/gpu_tests.sh -k "${LUT_TESTS_K:-cuda or lowrank}"
rows=bf16_graphed,svdq_w4_lut_pointwise_graphed,svdq_w4_lut2_pointwise_graphed,fp8_pointwise_graphed
rows=$rows,svdq_w4_lut_lowrank_pointwise_graphed
linears=bf16_mm,fp8_gemm,svdq_lut,svdq_lut_lowrank,w4a8_gemm_lut_coop_128x256_c2x1,fp8_act_rowquant
OUT=$out/step QUANT_STEP_TIMEOUT=${LUT_STEP_TIMEOUT:-420} bash bench/quant_step.sh \
  --budget-s ${LUT_BUDGET_S:-300} --repeats ${LUT_REPEATS:-5} --profile-steps ${LUT_PROFILE_STEPS:-1} \
  --linears ${LUT_LINEARS:-$linears} \
  --rows ${LUT_ROWS:-$rows}
python3 bench/quant_linear_ceiling.py "$out/step/quant_step.json" --out "$out/step"
