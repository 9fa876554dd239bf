#!/bin/bash
# Stage dit_passes for a machine without internet (the H200): the package with kernels/ and patterns/ placed
# as dit_passes.kernels / dit_passes.patterns (the mapping pyproject.toml installs), plus the wheels carried
# in .whl/ (../shared/tools/device-wheels), in one folder to put on PYTHONPATH. Prints that folder.
#   usage (from the repository root):  export PYTHONPATH=$(bash bench/device_stage.sh /tmp/dit_site)
set -euo pipefail
dest=${1:-/tmp/dit_site}
rm -rf "$dest" && mkdir -p "$dest"
cp -r dit_passes "$dest/"
cp -r kernels "$dest/dit_passes/kernels"
cp -r patterns "$dest/dit_passes/patterns"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$dest" .whl/*.whl >&2
fi
echo "$dest"
