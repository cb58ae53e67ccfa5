// Kernel argument structs and launchers of the nvlink backend. Host code fills one struct per launch; the
// kernels receive it by value. No CUDA headers here, so the host class compiles with the C++ compiler.
#pragma once

#include <cstdint>

#include "backends/nvlink/nvlink_layout.hpp"
#include "core/combine_type.hpp"

namespace epcomm {
namespace nvlink {

/// Per-object device state that is not peer-mapped.
struct DeviceState {
  /// [4][B] per-block round counters: dispatch send, dispatch recv, combine send, combine recv. Each block reads
  /// its own counter at start and advances it at exit, so the round number lives on the device (CUDA graphs
  /// replay correctly) and no two blocks race on one word.
  uint32_t* seq;
  int32_t* claimed;        ///< device word: first kernel to record an error claims it; kernels then bail out
  ErrorRecord* hostError;  ///< device pointer of the host-mapped error record
  uint64_t timeoutNs;      ///< bound of every device wait
  /// Routing blocks of one send: per-chunk expert histograms [R][E] and a monotone arrival counter (R per round,
  /// polled like a flag).
  int32_t* routeScratch;
  uint64_t* routeArrived;
  /// Work-unit counters of the dynamic schedules u32 [kQueues][2], by round parity (see expandTokens).
  uint32_t* queues;
  /// Rows of the last dispatch's tokens here, u64 [W][Ts][K]: entry k of sender s's token j is (local expert << 32 |
  /// row) or ~0 (not here). The dispatch's expansion writes them (the unit of the token's piece 0), the combine-send
  /// reads them: no row tables to rebuild before its first load.
  uint64_t* rowSlots;
  /// Diagnostics (EPCOMM_NVLINK_TRACE): [blocks][kTracePhases] %globaltimer stamps of this launch, or null. Thread 0
  /// of each block stamps the phases it passes (see TracePhase); nvlink_trace.cc summarises them.
  uint64_t* trace;
};
constexpr int kTracePhases = 16;
/// Phase stamps. Dispatch: kTrEntry every block; kTrRouteCounts (R > 1: chunk histograms shared), kTrRouted,
/// kTrRouteSignalled the routing blocks; kTrStored / kTrSignalled the payload blocks; kTrRoutesIn / kTrOwnDone the
/// own-token blocks of the fused kernel; kTrPeersIn / kTrRows / kTrExit every receiving block. Combine: kTrRouted =
/// weights pushed (routing blocks), kTrRoutesIn = every rank entered, kTrRows = row tables, kTrStored = partials
/// stored, kTrSignalled = done signalled, kTrPeersIn = every partial arrived, kTrExit. Inside the routing pass (last
/// pass of the block): kTrRouteSetup = shared tables cleared, kTrRouteMarked = indices loaded and marked,
/// kTrRouteScanned = per-warp bases summed, kTrRouteEmitted = entries stored into every receiver.
enum TracePhase : int {
  kTrEntry = 0,
  kTrRouted = 1,
  kTrRouteSignalled = 2,
  kTrStored = 3,
  kTrSignalled = 4,
  kTrRoutesIn = 5,
  kTrOwnDone = 6,
  kTrPeersIn = 7,
  kTrRows = 8,
  kTrExit = 9,
  kTrRouteCounts = 10,
  kTrRouteSetup = 11,
  kTrRouteMarked = 12,
  kTrRouteScanned = 13,
  kTrRouteEmitted = 14,
};
constexpr int kSeqDispatchSend = 0;
constexpr int kSeqDispatchRecv = 1;
constexpr int kSeqCombineSend = 2;
constexpr int kSeqCombineRecv = 3;

/// Arguments of the dispatch kernel (send half, recv half, or both).
struct DispatchKernelArgs {
  Geometry g;
  char* peers[kMaxRanks];  ///< base of every rank's peer-mapped region (peers[rank] = our own)
  DeviceState st;
  // Send half.
  const uint8_t* x;
  int64_t xRowStrideBytes;
  const uint8_t* xScale;
  int64_t xScaleStrideBytes[2];
  const void* indices;
  int32_t indexKind;
  int64_t indexStrides[2];
  uint32_t m;
  const int32_t* boundM;  ///< nullable device scalar
  // Recv half.
  int32_t* outNumTokens;
  uint8_t* outX;
  int64_t outExpertStrideBytes;  ///< 0 for packed
  int64_t outRowStrideBytes;
  uint8_t* outScale;
  int64_t outScaleStrideBytes[3];  ///< expert (0 for packed), row, column
  int32_t packed;
  uint32_t padding;
  /// Config::dispatchCast (DispatchCast as an int): the send half reads bf16 x and casts it (the kernels that cast).
  uint32_t cast;
};

/// Arguments of the combine kernel (send half, recv half, or both).
struct CombineKernelArgs {
  Geometry g;
  char* peers[kMaxRanks];
  DeviceState st;
  // Send half.
  const uint8_t* y;
  int64_t yExpertStride;  ///< elements; 0 for packed
  int64_t yRowStride;     ///< elements
  const float* weights;
  int64_t weightStrides[2];
  uint32_t mSend;
  const int32_t* boundM;
  int32_t packed;
  uint32_t padding;
  // Recv half.
  uint8_t* out;
  int64_t outRowStride;  ///< elements
  const void* indices;
  int32_t indexKind;
  int64_t indexStrides[2];
  uint32_t m;
  int32_t accumulate;
};

/// Arguments of the elastic ranks' index mask (nvlink_elastic.cu): copies a call's indices [m, K] as int32 with every
/// position the active ranks drop set to -1 (its expert's rank is masked, or its token's sender: rank group * D + t %
/// D), so that the dispatch and combine kernels see those positions as empty. Launched before the dispatch or
/// combine kernel on its stream, only while some rank is masked.
struct MaskIndicesArgs {
  const void* indices;
  int32_t indexKind;
  int64_t indexStrides[2];
  uint32_t m, topK, numExperts, numLocalExperts, dpSize, group;
  uint32_t live;          ///< Geometry::live
  const int32_t* boundM;  ///< nullable device scalar: only positions of tokens t < min(m, *boundM) are counted
  int32_t* out;           ///< int32 [m, K], contiguous
  /// Counting (the combine's receive half; null: not counted): device words {dropped positions so far, blocks done},
  /// and the host-mapped word into which the launch's last block copies the first (droppedTokens reads it).
  unsigned long long* drops;
  unsigned long long* hostDrops;
};
/// Launches the index mask on `stream`; returns the cudaError_t.
int launchMaskIndices(const MaskIndicesArgs& args, void* stream);

/// One kernel launch: the instantiation, grid, block and dynamic shared memory; its single parameter is the
/// arguments struct.
struct KernelLaunch {
  const void* fn;
  uint32_t blocks;
  uint32_t threads;
  uint32_t smemBytes;
};
/// The dispatch kernel for these halves (a kernel that casts when args.cast is set).
KernelLaunch dispatchLaunch(const DispatchKernelArgs& args, bool doSend, bool doRecv);
/// The combine kernel; `yType` is expertY's type (the send half's; ignored without it), `outType` outTokens' (the
/// receive half's; ignored without it). The partials between the halves are fp32 whatever both types are.
KernelLaunch combineLaunch(const CombineKernelArgs& args, bool doSend, bool doRecv, int yType, int outType);
/// Launches `l` with `args` (a DispatchKernelArgs or CombineKernelArgs) on `stream`; returns the cudaError_t.
int launchKernel(const KernelLaunch& l, const void* args, void* stream);
/// Raises the dynamic shared-memory limit of every kernel to `bytes` (needed above 48 KiB).
int configureKernels(uint32_t bytes);

}  // namespace nvlink
}  // namespace epcomm
