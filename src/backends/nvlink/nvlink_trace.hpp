// Diagnostics of the nvlink backend (EPCOMM_NVLINK_TRACE=1): every kernel launch gets a slot of per-block phase
// stamps (%globaltimer, written by thread 0 of each block, see TracePhase in nvlink_kernels.hpp); at destruction the
// object prints, per kernel kind and phase, the median over launches of the first and the last block's time since
// the launch's first block started. Off (the default): no memory, kernels see a null pointer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epcomm {
namespace nvlink {

class PhaseTrace {
 public:
  enum Kind : int { kDispatch, kDispatchSend, kDispatchRecv, kCombine, kCombineSend, kCombineRecv, kKinds };

  PhaseTrace() = default;
  PhaseTrace(const PhaseTrace&) = delete;
  PhaseTrace& operator=(const PhaseTrace&) = delete;
  ~PhaseTrace();

  /// Allocates the slots (device memory) for kernels of `blocks` blocks; throws Error(kCuda) on failure.
  /// `perBlock`: the summary also lists every block's median stamps of the fused dispatch (EPCOMM_NVLINK_TRACE=2).
  void enable(uint32_t blocks, bool perBlock = false);
  bool enabled() const { return dev_ != nullptr; }
  /// The stamps pointer for the next launch of `kind` (null when disabled).
  uint64_t* next(Kind kind, bool send, bool recv);
  /// Synchronizes the device, reads every slot and formats the table (empty when disabled or nothing launched).
  std::string summary(int rank);

 private:
  static constexpr uint32_t kSlots = 1024;
  uint32_t blocks_ = 0;
  bool perBlock_ = false;
  uint64_t* dev_ = nullptr;
  std::vector<int> slotKind_;
  uint64_t launches_ = 0;
};

}  // namespace nvlink
}  // namespace epcomm
