#!/usr/bin/env bash
# One device call: install, cold-build every kernel, run the GPU tests, then the benchmarks named in $BENCH
# (default: the quick op set). Logs land in $OUT (the device tool's folder) or ./device-logs.
#   bash benchmarks/device.sh                       # build + GPU tests + quick op benchmarks
#   BENCH="--ops attention --e2e --models llama-eager --quick" bash benchmarks/device.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TK_INDUCTOR_CACHE_DIR=${TK_INDUCTOR_CACHE_DIR:-/tmp/tkcache}
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
( time python3 -m tk_inductor build ) 2>&1 | tee "$OUT/build.log" | tail -8
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -v DEBUG | tail -15
timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks ${BENCH:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
