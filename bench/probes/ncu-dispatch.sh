#!/usr/bin/env bash
# Nsight Compute on the fused decode dispatch of the nvlink backend, to place the routing pass's time: whether it
# waits on the instruction stream (cold instruction fetch: "No Instruction" stalls) or on memory ("Long Scoreboard").
# The kernel name regex below follows the nvlink kernels' names; adjust it when they change.
#
#   BUILD=build-prof bash bench/probes/ncu-dispatch.sh     (writes $OUT/dispatch-w1.ncu-rep and text pages)
#   KERNEL=combine ...      the fused combine kernel instead (writes $OUT/combine-w1.ncu-rep)
#   NCU_CACHE=none ...      keep caches between ncu's replays (default all: flushed, so cold-start stalls, the
#                           instruction fetch included, are an upper bound; none gives the lower one)
#
# W = 1 (one GPU): ncu replays a kernel to collect its sections, restoring device memory in between, and a W = 2
# kernel would wait in each replay for a peer that is not replaying. At W = 1 the routing block runs the same pass
# (256 local experts, entries stored into the own GPU). Build with -DCMAKE_CUDA_FLAGS=-lineinfo for CUDA source
# lines beside the SASS. Clocks are left alone (--clock-control none), as the device notes ask.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-perf}
TOKENS=${TOKENS:-128}
KERNEL=${KERNEL:-dispatch}
case "$KERNEL" in
  dispatch | combine) ;;
  *)
    echo "KERNEL must be dispatch or combine, got '$KERNEL'" >&2
    exit 2
    ;;
esac
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /usr/local/cuda*/nsight-compute*/ncu /opt/nvidia/nsight-compute/*/ncu \
  2>/dev/null | head -1)
if [ -z "$ncu" ]; then
  echo "ncu not found" >&2
  exit 2
fi
# The fused kernels are dispatchKernel<true, true> and combineKernel<true, true, ...> (mangled
# ...KernelILb1ELb1E...); skip the warm-up launches.
"$ncu" --target-processes all --clock-control none --cache-control "${NCU_CACHE:-all}" --kernel-name-base mangled \
  --kernel-name "regex:${KERNEL}KernelILb1ELb1E" --launch-skip 20 --launch-count 1 --set full \
  --warp-sampling-interval "${NCU_SAMPLING:-0}" --import-source yes \
  -f -o "$OUT/$KERNEL-w1" \
  "$BUILD/bench/epcomm_bench/epcomm-bench" --backend nvlink --world 1 --config decode --tokens "$TOKENS" \
  --iters 30 --warmup 5 >"$OUT/ncu-run.log" 2>&1
echo "ncu rc=$? ($(grep -c '==PROF==' "$OUT/ncu-run.log") profiler lines)"
tail -3 "$OUT/ncu-run.log"
rep="$OUT/$KERNEL-w1.ncu-rep"
[ -f "$rep" ] || exit 1
# Whole-kernel stall reasons, then per-instruction samples (the routing pass is the code only block 0 runs).
"$ncu" --import "$rep" --page details --section WarpStateStats --section SchedulerStats --section LaunchStats \
  --section InstructionStats >"$OUT/ncu-details.txt" 2>&1
"$ncu" --import "$rep" --page source --csv --print-source sass >"$OUT/ncu-source-sass.csv" 2>&1
grep -iE "stall|no instruction|long scoreboard|issued" "$OUT/ncu-details.txt" | head -30
python3 "$(dirname "${BASH_SOURCE[0]}")/ncu-stalls.py" "$OUT/ncu-source-sass.csv"
