#!/usr/bin/env bash
# One device call: install, cold-build every kernel, run the GPU tests, then the benchmarks named in $BENCH
# (default: the quick op set). Logs land in $OUT (the device tool's folder) or ./device-logs.
#   bash benchmarks/device.sh                       # build + GPU tests + quick op benchmarks
#   BENCH="--ops attention --e2e --models llama-eager --quick" bash benchmarks/device.sh
#   TEST_K="attention" bash benchmarks/device.sh                               # a pytest -k filter for the GPU tests
#   TEST_K=test_distributed DIST="ddp fsdp2" BENCH=none bash benchmarks/device.sh   # 2 GPUs: the engines (issue 7)
# The device's copy of .git is stale: pass TK_BENCH_COMMIT=<the commit you shipped> so results.json names it (it also
# records the kernel sources' hash), and join runs done in parts with `python -m benchmarks --merge`.
# Baselines that travel as wheels (e.g. fla-core for the layernorm table): put them in .whl/ and carry it; they are
# installed into /tmp/site first. Each step has its own time limit (seconds: TEST_TIMEOUT, DIST_TIMEOUT,
# BENCH_TIMEOUT), so one slow step cannot take the whole call.
set -uo pipefail
# Libraries built ahead by benchmarks/prebuild.sh and carried in .tkcache/ are loaded instead of built.
[ -d .tkcache ] && : "${TK_INDUCTOR_CACHE_DIR:=$PWD/.tkcache}"
export PYTHONUNBUFFERED=1 TK_INDUCTOR_CACHE_DIR=${TK_INDUCTOR_CACHE_DIR:-/tmp/tkcache}
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
( time python3 -m tk_inductor build ) 2>&1 | tee "$OUT/build.log" | tail -8
if [ "${TESTS:-1}" != 0 ]; then
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider tests benchmarks/tests ${TEST_K:+-k "$TEST_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -v DEBUG | tail -15
fi
for engine in ${DIST:-}; do  # ddp, fsdp2: benchmarks.distributed under torchrun, ours and torch.compile default
  timeout ${DIST_TIMEOUT:-300} python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" -m benchmarks.distributed \
    --engine "$engine" --baseline ${DIST_ARGS:-} 2>&1 | tee "$OUT/dist_$engine.log" | grep -v DEBUG | tail -3
done
[ "${BENCH:-}" = none ] && exit 0
timeout ${BENCH_TIMEOUT:-300} python3 -m benchmarks ${BENCH:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
