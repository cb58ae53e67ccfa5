// Checks of dispatch/combine arguments against a Config, shared by every backend (done before any launch).
#pragma once

#include <cstdint>

#include "epcomm/all_to_all.hpp"

namespace epcomm {

/// What the checks learned about the call, in the form kernels and CPU loops use.
struct CheckedDispatch {
  uint32_t m = 0;     ///< Tokens given (x.shape[0]).
  int indexKind = 0;  ///< 0 int32, 1 uint32, 2 int64 (see decodeIndex).
  int64_t indexStrides[2] = {0, 0};
  int64_t xRowStrideBytes = 0;             ///< x row stride (bf16 rows with Config::dispatchCast).
  int64_t scaleStrides[2] = {0, 0};        ///< xScale strides in 4-byte elements (0 with Config::dispatchCast).
  int64_t outRowStrideBytes = 0;           ///< outExpertX row stride.
  int64_t outExpertStrideBytes = 0;        ///< outExpertX expert stride (batched), 0 packed.
  int64_t outScaleStrides[3] = {0, 0, 0};  ///< outExpertXScale strides (batched: expert, row, col; packed: row, col).
};

struct CheckedCombine {
  uint32_t m = 0;  ///< Tokens given (indices.shape[0]); outTokens may have more rows, which are never written.
  int indexKind = 0;
  int64_t indexStrides[2] = {0, 0};
  int64_t weightStrides[2] = {0, 0};
  int64_t outRowStride = 0;   ///< outTokens row stride in elements.
  int64_t yRowStride = 0;     ///< expertY row stride in elements.
  int64_t yExpertStride = 0;  ///< expertY expert stride (batched), 0 packed.
};

/// Throws Error(kInvalidArgument) naming the argument and what is wrong. `memory`: where the backend needs
/// tensors to live (host or CUDA device `device`). `appliesCast`: the backend's dispatch applies
/// Config::dispatchCast (nvlink, host: dispatchCastBackends()); then x must be bf16 [m, hiddenDim], xScale absent,
/// outExpertX fp8_e4m3 and outExpertXScale fp32. A backend that does not (the default) refuses a config with a cast
/// with Error(kUnavailable).
CheckedDispatch checkDispatchArgs(const Config& config, const DispatchArgs& args, MemoryKind memory, int device,
                                  bool appliesCast = false);
CheckedCombine checkCombineArgs(const Config& config, const CombineArgs& args, MemoryKind memory, int device);

/// The router weights of a combine's send half, for the backends whose send half applies them (nvlink, nvshmem: each
/// expert rank sums its experts' outputs per token before sending); checkCombineArgs checks weights only for the
/// receive half. Throws Error(kInvalidArgument) naming `backend` unless `w` is fp32 [m <= maxNumTokens, K] with
/// non-negative strides on CUDA device `device`.
void checkSendHalfWeights(const Config& config, const TensorView& w, int device, const char* backend);

/// Whether two calls have the same arguments, field by field (views, pointers, flags, stream): a backend may then
/// reuse what it checked and packed for the earlier one (an engine calls with the same buffers every step).
bool sameArgs(const DispatchArgs& a, const DispatchArgs& b);
bool sameArgs(const CombineArgs& a, const CombineArgs& b);

/// Slot of a call's kind in a backend's cache of its last calls (packedFor): send half 0, receive half 1, both 2; -1
/// for neither (the argument checks then throw).
inline int callSlot(bool doSend, bool doRecv) { return (doSend ? 1 : 0) + (doRecv ? 2 : 0) - 1; }

/// What call `a` is packed into, from `cache` (per callSlot, the last call of that kind: members `valid` and `args`):
/// a repeat of the last call of its kind (an engine calls with the same buffers every step) reuses that call's checks
/// and packing and only runs `checkOrder`; any other call runs `pack`, which checks the arguments, then the call order,
/// and packs into cache[callSlot] (it throws for a call of neither half).
template <typename Packed, typename Args, typename Pack, typename CheckOrder>
const Packed& packedFor(Packed (&cache)[3], const Args& a, Pack pack, CheckOrder checkOrder) {
  const int slot = callSlot(a.doSend, a.doRecv);
  if (slot < 0 || !cache[slot].valid || !sameArgs(cache[slot].args, a)) {
    pack();
  } else {
    checkOrder();
  }
  return cache[slot];
}

/// Index kind (0 int32, 1 uint32, 2 int64) of an indices dtype; throws for others.
int indexKindOf(DType dtype);

}  // namespace epcomm
