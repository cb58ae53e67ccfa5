#!/usr/bin/env bash
# bind-probe: does where the two ranks' host threads run change the decode numbers? Prints the GPUs' PCI and NUMA
# placement, then starts epcomm-bench's two ranks by hand (EPBENCH_CHILD, as its launcher does), each either
# unbound, bound to its own GPU's NUMA-local CPUs, bound to the other GPU's, or pinned to one core, alternating, and
# prints rank 0's table rows. A diagnostic for the rank skew (the rank whose kernel starts first waits for the
# other's payload, and the benchmark reports the max over ranks); never asserts a time.
#
#   BUILD=build-perf bench/epcomm_bench/bind-probe.sh "--config decode --tokens 32,128"
set -uo pipefail
export CUDA_DEVICE_ORDER=PCI_BUS_ID NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
BUILD=${BUILD:-build-perf}
bin=$BUILD/bench/epcomm_bench/epcomm-bench
args=${1:---config decode --tokens 32,128}
rounds=${ROUNDS:-2}
nvidia-smi topo -m
lscpu | grep -iE "^(cpu\(s\)|socket|numa|model name|thread)"
cpus=()
for i in 0 1; do
  bus=$(nvidia-smi -i "$i" --query-gpu=pci.bus_id --format=csv,noheader | tr '[:upper:]' '[:lower:]')
  bus=${bus: -12}
  list=$(cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null || echo "")
  echo "GPU $i: $bus numa_node $(cat "/sys/bus/pci/devices/$bus/numa_node" 2>/dev/null || echo '?') local_cpulist ${list:-?}"
  cpus+=("$list")
done
first() { echo "${1%%[,-]*}"; }
run() {  # label cpus-of-rank-0 cpus-of-rank-1 ("" = unbound)
  local port=$((20000 + RANDOM % 20000)) r b
  echo "== $1 (rank 0: ${2:-any}, rank 1: ${3:-any})"
  for r in 0 1; do
    b=$2
    [ "$r" = 1 ] && b=$3
    (
      export EPCOMM_RANK=$r EPCOMM_LOCAL_RANK=$r EPCOMM_WORLD_SIZE=2 EPCOMM_BOOTSTRAP=127.0.0.1:$port EPBENCH_CHILD=1
      # shellcheck disable=SC2086
      if [ -n "$b" ]; then exec taskset -c "$b" "$bin" --backend nvlink --world 2 $args; fi
      # shellcheck disable=SC2086
      exec "$bin" --backend nvlink --world 2 $args
    ) >"/tmp/bind-probe-r$r.log" 2>&1 &
  done
  wait
  grep -E "^[a-z0-9]+ +[0-9]+ +(no|yes)|barrier shm|rror" /tmp/bind-probe-r0.log /tmp/bind-probe-r1.log | sed 's|/tmp/bind-probe-||'
}
c0=$(first "${cpus[0]}")
c1=$(first "${cpus[1]}")
for ((i = 0; i < rounds; ++i)); do
  run unbound "" ""
  run own-numa "${cpus[0]}" "${cpus[1]}"
  run other-numa "${cpus[1]}" "${cpus[0]}"
  run one-core "$((c0 + 2))" "$((c1 + 3))"
done
