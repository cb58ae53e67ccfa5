// Diagnostics of the nvlink backend (EPCOMM_NVLINK_TRACE=1): every kernel launch gets a slot of per-block phase
// stamps (%globaltimer, written by thread 0 of each block, see TracePhase in nvlink_kernels.hpp); at destruction the
// object prints, per kernel kind and phase, the median over launches of the first and the last block's time since
// the launch's first block started. Off (the default): no memory, kernels see a null pointer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/nvlink/nvlink_cuda.hpp"

namespace epcomm {
namespace nvlink {

class PhaseTrace {
 public:
  enum Kind : int { kDispatch, kDispatchSend, kDispatchRecv, kCombine, kCombineSend, kCombineRecv, kKinds };

  PhaseTrace() = default;
  PhaseTrace(const PhaseTrace&) = delete;
  PhaseTrace& operator=(const PhaseTrace&) = delete;

  /// Allocates the slots (device memory) for kernels of `blocks` blocks and zeroes them on `stream`, which the caller
  /// synchronises before the first launch; throws Error(kCuda) on failure. `perBlock`: the summary also lists every
  /// block's median stamps of the fused dispatch (EPCOMM_NVLINK_TRACE=2).
  void enable(uint32_t blocks, bool perBlock, cudaStream_t stream);
  bool enabled() const { return static_cast<bool>(dev_); }
  /// The stamps pointer for the next launch of `kind` (null when disabled).
  uint64_t* next(Kind kind, bool send, bool recv);
  /// Reads every slot and formats the table (empty when disabled or nothing launched). The caller first waits for the
  /// kernels that wrote them.
  std::string summary(int rank);

 private:
  static constexpr uint32_t kSlots = 1024;
  uint32_t blocks_ = 0;
  bool perBlock_ = false;
  DeviceMemory dev_;  // u64 [kSlots][blocks][kTracePhases]
  std::vector<int> slotKind_;
  uint64_t launches_ = 0;
};

}  // namespace nvlink
}  // namespace epcomm
