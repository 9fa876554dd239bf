#!/bin/bash
# The first generation's build time (target <= 30 s: capture + passes + compile, cold Inductor cache) on one GPU, one device call:
#  1. the build's cProfile on CUDA (bench/profile_build.py: compile_dit of the full FLUX.1-dev with random bf16 weights,
#     DBCache F8B0 + SplitConcatLinear + FuseLinearGelu, regional + reduce-overhead; no generation) -> profile_build/,
#     and again without export's stack traces -> profile_build_no_stack_traces/;
#  2. the graphed_regional_epilogue_always row (build_s, first_generation_s, 1 more generation), each in a fresh process
#     with empty Inductor and Triton caches, without / with Inductor's compile-worker pool started early (torch's
#     TORCH_WARM_POOL=0 / 1: compile_dit starts it at the first CUDA lowering through torch's maybe_warm_pool, which
#     honours that switch; 0 also keeps Inductor from starting it itself, so warm=0 now measures no pool warm-up at
#     all), in the order 0 1 0 1 -> buildtime_warm<0|1>_<run>/bench_flux_full.json.
# The summary line per run: warm, build_s, first_generation_s, their sum (the figure the target bounds), generation_s.
#   device tool: run(command="bash bench/flux_build_time.sh")   (~7 min on an H100)
set -u
source bench/device_env.sh
timeout ${PROFILE_TIMEOUT:-150} python3 "$repo/bench/profile_build.py" --device cuda --out "$out/profile_build"
echo "profile rc=$?"
# the same without export's per-node stack traces (an experiment: what they cost on this host)
timeout ${PROFILE_TIMEOUT:-150} python3 "$repo/bench/profile_build.py" --device cuda --no-stack-traces \
  --out "$out/profile_build_no_stack_traces"
echo "profile (no stack traces) rc=$?"
for run in 1 2; do
  for warm in 0 1; do
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) TORCH_WARM_POOL=$warm \
      timeout ${ROW_TIMEOUT:-150} python3 -m dit_passes.bench --size full --rows graphed_regional_epilogue_always \
      --repeats 1 --out "$out/buildtime_warm${warm}_$run" > "$out/buildtime_warm${warm}_$run.log" 2>&1
    echo "warm=$warm run=$run rc=$?"
  done
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
for run in (1, 2):
    for warm in (0, 1):
        path = os.path.join(out, f"buildtime_warm{warm}_{run}", "bench_flux_full.json")
        if not os.path.exists(path):
            print(f"warm={warm} run={run}: no result (see buildtime_warm{warm}_{run}.log)")
            continue
        row = json.load(open(path))["rows"]["graphed_regional_epilogue_always"]
        if "error" in row:
            print(f"warm={warm} run={run}: {row['error']}")
            continue
        build, first = row["build_s"], row["first_generation_s"]
        print(f"warm={warm} run={run}: build {build:.2f} s, first generation {first:.2f} s, sum {build + first:.2f} s, "
              f"generation {row['generation_s']:.3f} s")
PY
