#include "backends/nvlink/nvlink_trace.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "backends/nvlink/nvlink_kernels.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace nvlink {

namespace {

const char* const kKindNames[PhaseTrace::kKinds] = {"dispatch", "dispatch.send", "dispatch.recv",
                                                    "combine",  "combine.send",  "combine.recv"};
const char* const kPhaseNames[kTracePhases] = {"entry",    "routed",    "route-sig", "stored", "signalled", "routes-in",
                                               "own-done", "peers-in",  "rows",      "exit",   "counts",    "r-setup",
                                               "r-marked", "r-scanned", "r-emitted", "p15"};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

void PhaseTrace::enable(uint32_t blocks, bool perBlock, cudaStream_t stream) {
  blocks_ = blocks;
  perBlock_ = perBlock;
  const size_t bytes = static_cast<size_t>(kSlots) * blocks * kTracePhases * sizeof(uint64_t);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  dev_ = DeviceMemory(p);
  if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, bytes, stream);
  EPCOMM_CHECK(e == cudaSuccess, kCuda,
               "EPCOMM_NVLINK_TRACE: cannot allocate " << bytes << " B of trace slots: " << cudaGetErrorString(e));
  slotKind_.assign(kSlots, -1);
}

uint64_t* PhaseTrace::next(Kind kind, bool send, bool recv) {
  if (!dev_) return nullptr;
  const int k = kind + (send && recv ? 0 : send ? 1 : 2);
  const uint32_t slot = static_cast<uint32_t>(launches_++ % kSlots);
  slotKind_[slot] = k;
  return static_cast<uint64_t*>(dev_.get()) + static_cast<size_t>(slot) * blocks_ * kTracePhases;
}

std::string PhaseTrace::summary(int rank) {
  if (!dev_ || launches_ == 0) return {};
  std::vector<uint64_t> host(static_cast<size_t>(kSlots) * blocks_ * kTracePhases);
  if (cudaMemcpy(host.data(), dev_.get(), host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    return "nvlink trace: cannot read the trace slots\n";
  }
  // Slot s's stamps, and start[s], its launch's first entry stamp (UINT64_MAX: the slot holds no launch).
  auto slotAt = [&](uint32_t s) { return host.data() + static_cast<size_t>(s) * blocks_ * kTracePhases; };
  std::vector<uint64_t> start(kSlots, UINT64_MAX);
  for (uint32_t s = 0; s < kSlots; ++s) {
    for (uint32_t b = 0; b < blocks_; ++b) {
      const uint64_t t = slotAt(s)[b * kTracePhases];
      if (t != 0) start[s] = std::min(start[s], t);
    }
  }
  std::ostringstream out;
  for (int kind = 0; kind < kKinds; ++kind) {
    // first[p], last[p]: per launch, the earliest / latest block's stamp of phase p minus the launch's first entry.
    std::vector<std::vector<double>> first(kTracePhases), last(kTracePhases);
    int n = 0;
    for (uint32_t s = 0; s < kSlots; ++s) {
      if (slotKind_[s] != kind) continue;
      const uint64_t* slot = slotAt(s);
      const uint64_t t0 = start[s];
      if (t0 == UINT64_MAX) continue;
      ++n;
      for (int p = 0; p < kTracePhases; ++p) {
        uint64_t lo = UINT64_MAX, hi = 0;
        for (uint32_t b = 0; b < blocks_; ++b) {
          const uint64_t t = slot[b * kTracePhases + p];
          if (t < t0) continue;  // not reached in this launch (zero, or a stamp of the slot's previous launch)
          lo = std::min(lo, t);
          hi = std::max(hi, t);
        }
        if (hi == 0) continue;
        first[p].push_back((lo - t0) / 1e3);
        last[p].push_back((hi - t0) / 1e3);
      }
    }
    if (n == 0) continue;
    out << "nvlink trace rank " << rank << " " << kKindNames[kind] << " (" << n << " launches, " << blocks_
        << " blocks; us since the first block started, median first/last block):";
    for (int p = 0; p < kTracePhases; ++p) {
      if (first[p].empty()) continue;
      char buf[96];
      std::snprintf(buf, sizeof(buf), " %s %.2f/%.2f", kPhaseNames[p], median(first[p]), median(last[p]));
      out << buf;
    }
    out << "\n";
    if (!perBlock_ || kind != 0) continue;
    // Every block's median stamps (us since its launch's first entry) of the fused dispatch.
    for (uint32_t b = 0; b < blocks_; ++b) {
      out << "  block " << b << ":";
      for (int p = 0; p < kTracePhases; ++p) {
        std::vector<double> at;
        for (uint32_t s = 0; s < kSlots; ++s) {
          if (slotKind_[s] != kind) continue;
          const uint64_t t = slotAt(s)[b * kTracePhases + p];
          if (start[s] != UINT64_MAX && t >= start[s]) at.push_back((t - start[s]) / 1e3);
        }
        if (at.empty()) continue;
        char buf[64];
        std::snprintf(buf, sizeof(buf), " %s %.2f", kPhaseNames[p], median(at));
        out << buf;
      }
      out << "\n";
    }
  }
  return out.str();
}

}  // namespace nvlink
}  // namespace epcomm
