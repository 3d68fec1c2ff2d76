#!/usr/bin/env bash
# A full benchmark run in parts on a 2-GPU machine (device kind nvidia-h200-x2), one list of jobs per GPU:
#   TK_BENCH_COMMIT=<sha> bash benchmarks/device_full.sh "tests ops gpt2-medium" "llama-sdpa llama-eager"
#   TK_BENCH_COMMIT=<sha> E2E_TIMEOUT=230 bash benchmarks/device_full.sh "mamba2" "based build"
# jobs: tests (GPU tests; TEST_K: a pytest -k filter), ops (every op benchmark), ops:<list> (those ops, e.g.
# ops:ssd,attention; ops:<list>@NAME=value runs them with that variable set),
# timeline:<list>[@NAME=value] (benchmarks.tuning.profile_backward --timeline: kernel times and the gaps between them, do_bench
# style), profile:<list> (benchmarks.tuning.profile_backward's tables), ncu:<list> (the same steps under Nsight Compute: speed of
# light, memory, occupancy, warp stalls; NCU_METRICS: more metrics, comma-separated), build (--build), or an e2e model name
# (E2E_MODES=thunderkittens: only those modes, e.g. a slow model's modes split over two calls; E2E_ENV="NAME=value
# ...": the environment of the e2e jobs only). Each job gets at most what is left of BUDGET seconds (default 545,
# under the device's 600 s per call), and each part writes its own results.json (saved after every part, so a
# cut-off job keeps what finished). The device returns at most 8 files, so the parts' folders come back as one
# parts.tgz; join them here with `python -m benchmarks --merge`.
# Carry .tkcache (benchmarks/prebuild.sh) and .whl (baselines' wheels, e.g. fla-core).
set -u
: "${TK_BENCH_COMMIT:?name the commit you shipped (the device copy of .git is stale)}"
export TK_BENCH_COMMIT TK_INDUCTOR_CACHE_DIR=$PWD/.tkcache PYTHONUNBUFFERED=1 OUT=${OUT:-device-logs}
mkdir -p "$OUT"
END=$(( $(date +%s) + ${BUDGET:-545} ))
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t_build=$(date +%s)
python3 -m tk_inductor build 2>&1 | tail -1
# A carried .tkcache that matches the sources loads in seconds; a stale one (a csrc edit after prebuild.sh) costs a
# minute or more of device time per family: say so, for the next call.
if [ $(( $(date +%s) - t_build )) -gt 20 ]; then
  echo "WARNING: the kernel build took $(( $(date +%s) - t_build )) s here: .tkcache did not match the sources" \
       "(run benchmarks/prebuild.sh after every csrc edit)"
fi
job() {  # gpu name
  local left=$(( END - $(date +%s) )); [ $left -lt 30 ] && { echo "skip $2 (no time)"; return; }
  local t0=$(date +%s); export CUDA_VISIBLE_DEVICES=$1
  case $2 in
    tests) timeout $(( left < 240 ? left : 240 )) python3 -m pytest -q -m gpu -p no:cacheprovider tests \
             ${TEST_K:+-k "$TEST_K"} >"$OUT/gpu_tests.log" 2>&1 ;;
    ops) timeout $(( left < 330 ? left : 330 )) python3 -m benchmarks --out "$OUT/ops" >"$OUT/ops.log" 2>&1 ;;
    ops:*) local spec=${2#ops:}; local ops=${spec%%@*}; local env=; [ "$spec" != "$ops" ] && env=${spec#*@}
      local tag=${2//[:,@=]/_}; env $env timeout $left python3 -m benchmarks --ops $ops --out "$OUT/$tag" >"$OUT/$tag.log" 2>&1 ;;
    timeline:*) local spec=${2#timeline:}; local ops=${spec%%@*}; local env=; [ "$spec" != "$ops" ] && env=${spec#*@}
      env $env timeout $left python3 -m benchmarks.tuning.profile_backward --timeline --steps 30 --ops $ops \
        >"$OUT/${2//[:,@=]/_}.log" 2>&1 ;;
    profile:*) timeout $left python3 -m benchmarks.tuning.profile_backward --ops ${2#profile:} >"$OUT/${2//[:,]/_}.log" 2>&1 ;;
    ncu:*) timeout $left ncu --clock-control none --profile-from-start off --section SpeedOfLight \
             --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
             --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed.sum${NCU_METRICS:+,$NCU_METRICS}" \
             python3 -m benchmarks.tuning.profile_backward --ops ${2#ncu:} --steps 1 --ncu >"$OUT/${2//[:,]/_}.log" 2>&1 ;;
    build) timeout $left python3 -m benchmarks --ops none --build --out "$OUT/build" >"$OUT/build.log" 2>&1 ;;
    *) env ${E2E_ENV:-} timeout $left python3 -m benchmarks --ops none --e2e --models $2 --e2e-timeout ${E2E_TIMEOUT:-170} \
         ${E2E_MODES:+--modes $E2E_MODES} --out "$OUT/$2" >"$OUT/$2.log" 2>&1 ;;
  esac
  echo "== GPU$1 $2: rc $? in $(( $(date +%s) - t0 )) s"
}
( for j in $2; do job 1 $j; done ) &
for j in $1; do job 0 $j; done
wait
grep -h "passed\|failed" "$OUT/gpu_tests.log" 2>/dev/null | tail -2
# the device returns at most 8 files: the parts' folders travel as one archive
(cd "$OUT" && dirs=$(ls -d */ 2>/dev/null) && [ -n "$dirs" ] && tar czf parts.tgz $dirs && rm -rf $dirs)
for f in "$OUT"/*.log; do case $f in *pip.log|*gpu_tests.log) ;; *) echo "### $f"; grep -v "DEBUG\|^\[" "$f" | tail -${TAIL:-30};; esac; done
