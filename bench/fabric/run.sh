#!/usr/bin/env bash
# Runs epcomm-fabric-bench (with fi_pingpong as the baseline, same run) for tcp and shm between two processes on
# this host and appends JSON lines to bench/results/fabric-<date>.jsonl.
#   bench/fabric/run.sh [build-dir] [extra epcomm-fabric-bench args...]
# BENCH=<path> runs a prebuilt binary (e.g. on a machine without a build tree); OUT=<file> overrides the output.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build-fabric}"
[[ $# -gt 0 ]] && shift
if [[ -z "${BENCH:-}" ]]; then
  cmake --build "$BUILD" --target epcomm-fabric-bench -j2
  BENCH="$BUILD/bench/fabric/epcomm-fabric-bench"
fi
command -v fi_pingpong >/dev/null || { echo "fi_pingpong not found (apt-get install libfabric-bin)" >&2; exit 1; }
REV="${REV:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
mkdir -p "$ROOT/bench/results"
OUT="${OUT:-$ROOT/bench/results/fabric-$(date +%Y-%m-%d).jsonl}"
"$BENCH" --provider tcp,shm --rev "$REV" --json "$OUT" "$@"
echo "results appended to $OUT"
