// Helpers of the GPU tests: GPU detection without initialising CUDA in the parent (children are forked), the GPU of a
// rank, device buffers, a call's send and receive halves, and one "round" of dispatch + combine on every rank checked
// against the CPU reference.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "reference/reference.hpp"

namespace epcomm {
namespace gputest {

/// CUDA devices visible, counted in a forked child so the calling process never initialises CUDA (a process that
/// forks after cuInit cannot use CUDA in the child). Cached.
int gpuCount();

/// Makes GPU `rank % devices` current and returns it. Throws Error(kCuda).
int useRankDevice(int rank);

/// Owned device memory (cudaMalloc / cudaFree) on the current device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* src, size_t n);
  void download(void* dst, size_t n) const;

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

/// Everything that varies between test cases.
struct Scenario {
  uint32_t world = 1, dp = 1, experts = 16, topK = 4, hidden = 256, maxTokens = 24;
  DType xType = DType::kBf16;  ///< dispatch payload dtype (its bytes are opaque to the backend)
  bool scales = false;         ///< fp32 scales, hidden / 64 per token, stored transposed (strided)
  DType yType = DType::kBf16, outType = DType::kBf16;
  DType indexType = DType::kI32;
  Layout layout = Layout::kBatched;
  uint32_t padding = 1;
  bool masked = false;       ///< some indices -1, some repeated within a token
  bool ownExperts = false;   ///< every index names an expert of the token's own rank: nothing crosses between ranks
  bool ragged = true;        ///< m per DP group random in [0, T]
  bool deviceBound = false;  ///< *boundM random in [0, m] on the device
  bool accumulate = false;
  bool split = false;          ///< doSend and doRecv as separate calls, with a kernel of ours in between
  bool splitOddRanks = false;  ///< only the odd ranks split their calls (the others fuse): mixed modes in one round
  int rounds = 3;              ///< rounds 0 and 1 use identical inputs: their outputs must be bitwise equal
  uint64_t seed = 1;
  /// Combine checked against the exact (fp64) sum: within one final rounding of an fp32 sum, the accuracy of
  /// pplx-kernels and DeepEP (a backend that rounds partial sums on the way fails). Off: within the dtypes' tolerance
  /// of the fp32 reference.
  bool oneRounding = false;
  /// Elastic ranks: the active-ranks mask (worldSize entries) the expected outputs follow (reference::dispatch with
  /// activeRanks: positions of masked ranks dropped); the device still gets the indices as generated. Empty: all.
  std::vector<int32_t> active;
};

/// `args` (DispatchArgs or CombineArgs) as its send half (doRecv off) and its receive half (doSend off).
template <typename Args>
std::pair<Args, Args> halves(const Args& args) {
  Args send = args, recv = args;
  send.doRecv = false;
  recv.doSend = false;
  return {send, recv};
}

/// The Config of a scenario for `rank`.
Config scenarioConfig(const Scenario& s, uint32_t rank);

/// One rank's inputs and expected outputs of one round (host memory), generated identically on every rank.
struct RoundData;

/// Device-side tensors of one rank for a scenario, reused across rounds (fixed pointers, so a CUDA graph can be
/// replayed with new contents).
struct DeviceTensors {
  DeviceBuffer x, xScale, indices, weights, boundM, outCounts, outX, outXScale, expertY, outTokens;
  DispatchArgs dispatch;
  CombineArgs combine;
};

/// Host-side generated inputs and reference results for every rank of one round.
class Round {
 public:
  Round(const Scenario& s, uint64_t seed);
  ~Round();
  Round(const Round&) = delete;
  Round& operator=(const Round&) = delete;
  /// Copies rank `rank`'s inputs (and the poisoned / initial outputs) into `dev`.
  void upload(uint32_t rank, DeviceTensors& dev) const;
  /// Compares what the device produced with the reference; returns "" when equal (combine within tolerance),
  /// else a description of the first mismatches.
  std::string check(uint32_t rank, const DeviceTensors& dev) const;
  /// Raw device outputs of `rank` (for bitwise comparisons across rounds).
  static std::vector<uint8_t> snapshot(const DeviceTensors& dev);
  /// Scenario::active: the combine positions (t < bound) of `rank` that the mask drops (what droppedTokens adds).
  uint64_t dropped(uint32_t rank) const;

 private:
  RoundData* d_;
};

/// Allocates device tensors shaped for the scenario and fills the DispatchArgs / CombineArgs views.
void allocateDevice(const Scenario& s, uint32_t rank, DeviceTensors& dev);

/// Runs `s.rounds` rounds on this rank (collective over `bootstrap`); returns "" on success, else what failed.
std::string runScenario(const Scenario& s, uint32_t rank, Bootstrap& bootstrap);
/// The same on the named backend ("nvlink", "proxy", ...), created through the factory.
std::string runScenario(const Scenario& s, uint32_t rank, Bootstrap& bootstrap, const std::string& backend);

}  // namespace gputest
}  // namespace epcomm
