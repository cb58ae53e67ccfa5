#!/usr/bin/env bash
# One device call for the nvlink performance pass: runs binaries built elsewhere (carried build dirs), the `gpu`
# ctest label, then epcomm-bench points given as "label|env|args" lines on stdin. Logs and JSON lines go to $OUT.
#
#   BUILD=build-perf  [OLD=build-old]  bench/epcomm_bench/device-run.sh < points.txt
#   (points labelled old* run OLD's epcomm-bench, label@dir that dir's: A/B of builds in one call;
#   EXTRA_BUILDS="dir ..." also runs those builds' nvlink_test, filtered by EXTRA_FILTER, default NvlinkGpu.W2*)
#
# A build dir made on another machine holds absolute paths (ctest files, RUNPATH) under the directory it was
# configured in; EPCOMM_SRC_ROOT names that directory (default /work/main) and is linked to this checkout if absent.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
root=${EPCOMM_SRC_ROOT:-/work/main}
if [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$here" "$root"; fi
cd "$root" || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-perf}
bin=$BUILD/bench/epcomm_bench/epcomm-bench
for lib in $(ldd "$bin" "$BUILD/tests/gpu/nvlink_test" 2>/dev/null | awk '/not found/ {print $1}' | sort -u); do
  f=$(find /usr /opt -name "$lib*" 2>/dev/null | head -1)
  [ -n "$f" ] && export LD_LIBRARY_PATH=$(dirname "$f")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} rev=${EPBENCH_REV:-$(git rev-parse --short HEAD 2>/dev/null)} $(nvidia-smi -L | wc -l) GPUs"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  start=$(date +%s)
  ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300 >"$OUT/ctest.log" 2>&1
  echo "ctest rc=$? ($(($(date +%s) - start)) s): $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  grep -E "\*\*\*Failed|Failure|Expected|Which is" "$OUT/ctest.log" | head -20
fi
# EXTRA_BUILDS="build-alt build-alt2": their nvlink_test on a subset (EXTRA_FILTER) before the points, so an
# experiment's numbers are only read next to its correctness.
for dir in ${EXTRA_BUILDS:-}; do
  start=$(date +%s)
  "$dir/tests/gpu/nvlink_test" --gtest_filter="${EXTRA_FILTER:-NvlinkGpu.W2*}" >"$OUT/tests-${dir//\//_}.log" 2>&1
  echo "$dir nvlink_test rc=$? ($(($(date +%s) - start)) s): $(grep -E '^\[  (PASSED|FAILED)' "$OUT/tests-${dir//\//_}.log" | tr '\n' ' ')"
done
while IFS='|' read -r label envs args; do
  [ -z "$label" ] && continue
  start=$(date +%s)
  b=$bin
  [[ "$label" == old* ]] && b=${OLD:-build-old}/bench/epcomm_bench/epcomm-bench
  [[ "$label" == *@* ]] && b=${label#*@}/bench/epcomm_bench/epcomm-bench          # label@build-dir: that build
  echo "== $label" >>"$OUT/bench.log"
  # shellcheck disable=SC2086
  env $envs "$b" --backend nvlink --world 2 $args --json "$OUT/nvlink-bench.jsonl" >>"$OUT/bench.log" 2>&1 ||
    echo "$label FAILED" >>"$OUT/bench.log"
  echo "$label: $(($(date +%s) - start)) s" >>"$OUT/times.log"
done
cat "$OUT/times.log"
grep -vE "^# (times|epcomm-bench)" "$OUT/bench.log" | awk '!/^config/ || !seen++'
