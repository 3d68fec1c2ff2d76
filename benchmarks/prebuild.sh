#!/usr/bin/env bash
# Build every kernel library on this (CPU) machine for the device's Python and torch, into .tkcache/, so that device
# calls load them instead of spending ~90 s of device time building:
#   bash benchmarks/prebuild.sh          # ~3 min on 2 cores; torch 2.11.0 for Python 3.12, as on the device
# then name .tkcache in the device call's `carry` (benchmarks/device.sh uses it when present). The cache key covers
# the sources, flags, torch, CUDA and Python versions, so a stale or mismatched build only means the device builds as
# usual, and a library that does not load there (another glibc) is rebuilt there. Only the .so files are kept (~45 MB).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PY:-}" ]; then  # the first Python 3.12 that runs (a pyenv shim may exist without one behind it)
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY=$(command -v "$c"); break; fi
  done
fi
TORCH=${TORCH:-2.11.0}
ENV_DIR=${ENV_DIR:-/tmp/tk_prebuild_${TORCH}}
[ -n "${PY:-}" ] || { echo "prebuild: no Python 3.12 found (set PY)"; exit 2; }
if [ ! -d "$ENV_DIR/torch/torch" ]; then
  echo "prebuild: fetching torch $TORCH for $("$PY" -V) into $ENV_DIR"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "torch==$TORCH" -d "$ENV_DIR/wheels"
  "$PY" -m pip install -q --no-deps --no-compile --target "$ENV_DIR/torch" "$ENV_DIR"/wheels/torch-*.whl
  "$PY" -m pip install -q --no-compile --target "$ENV_DIR/deps" typing_extensions sympy networkx jinja2 filelock \
    fsspec setuptools ninja
fi
# torch's CUDA build loads the CUDA runtime libraries at import: borrow them from this machine's torch install
# (checked on every run: a first run on a machine without torch left the link dangling or missing).
if [ ! -e "$ENV_DIR/deps/nvidia" ]; then
  NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null) ||
    { echo "prebuild: this machine's python3 has no CUDA libraries (the nvidia packages): install the project first," \
           "python3 -m pip install -e '.[test]' (it brings torch's CUDA build)"; exit 2; }
  ln -sfn "$NV/nvidia" "$ENV_DIR/deps/nvidia"
fi
export PATH="$ENV_DIR/deps/bin:$PATH" PYTHONPATH="$ENV_DIR/torch:$ENV_DIR/deps:$REPO" TK_INDUCTOR_CACHE_DIR="$REPO/.tkcache"
"$PY" -c "import torch, sys; print('prebuild: torch', torch.__version__, 'CUDA', torch.version.cuda, 'Python', sys.version.split()[0])"
"$PY" -m tk_inductor build
find "$REPO/.tkcache" -name '.build-*' -prune -exec rm -rf {} +  # private folders of builds that were killed
find "$REPO/.tkcache" -type f ! -name '*.so' -delete
# only the builds of these sources: older ones would push the folder past the device's 64 MiB carry limit
"$PY" - <<'PY'
import shutil
from tk_inductor import build
keep = {build.build_dir(f).name for f in build.families()}
for d in build.cache_dir().iterdir():
    if d.is_dir() and d.name not in keep:
        shutil.rmtree(d)
PY
find "$REPO/.tkcache" -mindepth 1 -type d -empty -delete
du -sh "$REPO/.tkcache"
