# Sourced by the bench/h200_*.sh device scripts (from the repository root): stages the package, sets $repo and
# $out ($OUT on the device), a cold Inductor cache (the first generation then counts the compile), and moves to
# /tmp: the repository root's dit_passes/ lacks dit_passes.kernels (the staged copy has it).
repo=$(pwd)
out=${OUT:-$repo/out/bench}
export PYTHONPATH=$(bash bench/device_stage.sh /tmp/dit_site) || exit 1
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
cd /tmp || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
