# Sourced by the bench/*.sh device scripts (from the repository root). The one way bench scripts run on the
# device (no internet): pip installs this checkout (`pip install --no-deps .`, offline, no build isolation) and the
# wheels carried in .whl/ (../shared/tools/device-wheels) into one folder put on PYTHONPATH. Sets $repo and $out
# ($OUT on the device), a cold Inductor cache (the first generation then counts the compile), and moves to /tmp:
# from the repository root, `python -m` would import the uninstalled source folder dit_passes/ instead.
repo=$(pwd)
out=${OUT:-$repo/out/bench}
site=${DIT_SITE:-/tmp/dit_site}  # two scripts side by side: give one another DIT_SITE
rm -rf "$site" && mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . >&2 || exit 1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl >&2 || exit 1
fi
export PYTHONPATH=$site
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
cd /tmp || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
