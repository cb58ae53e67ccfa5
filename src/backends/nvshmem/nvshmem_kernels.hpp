// Kernel argument structs and launchers of the nvshmem backend. The host object fills one struct per half; the kernels
// receive it by value. No CUDA or NVSHMEM headers here, so the host class compiles with the C++ compiler.
#pragma once

#include <cstdint>

#include "backends/nvshmem/nvshmem_layout.hpp"
#include "core/combine_type.hpp"

namespace epcomm {
namespace nvshmem {

/// Error record in host-mapped memory (this rank's slot of the object's abort board, core/abort_board.hpp), written by
/// the first kernel that times out or sees a bad index; the host reads it (no synchronisation) at the start of the next
/// call. `code` is written last.
struct ErrorRecord {
  int32_t code;    ///< 0 = none, else an ErrorPhase
  int32_t rank;    ///< rank that detected it
  int32_t peer;    ///< rank that never arrived (timeouts), -1 otherwise
  int32_t block;   ///< block that detected it
  int64_t seen;    ///< the signal value seen (timeouts) or the token index (bad index)
  int64_t wanted;  ///< the round waited for (timeouts) or position k << 32 | the index's low 32 bits (bad index)
  int64_t detail;  ///< the chunk (dispatch-recv) or token (combine-recv) waited for, -1 otherwise
};

/// What a kernel was doing when it recorded an error.
enum ErrorPhase : int32_t {
  kPhaseNone = 0,
  kPhaseDispatchRecv = 1,     ///< waiting for a sender's records
  kPhaseCombineWeights = 2,   ///< combine-send waiting for a rank's router weights (it entered the combine)
  kPhaseCombineDone = 3,      ///< combine-recv waiting for an expert rank to finish reading this rank's buffers
  kPhaseCombineRecv = 4,      ///< combine-recv waiting for an expert rank's partial of a token
  kPhaseBadIndex = 5,         ///< dispatch-send saw an expert index outside [-1, E)
  kPhaseBadIndexCombine = 6,  ///< combine-recv saw an expert index outside [-1, E)
  kPhasePeerAbort =
      7,  ///< a wait saw a peer's abort word (peer = that rank; seen = the wait's phase, wanted = its peer)
};

/// Per-object device state every kernel receives.
struct DeviceState {
  char* sym;               ///< this PE's address of the object's symmetric allocation (Geometry::off*)
  char* scratch;           ///< private device scratch (Geometry::offRows ... offWords), zeroed at creation
  ErrorRecord* hostError;  ///< device pointer of the host-mapped error record
  uint64_t timeoutNs;      ///< bound of every device wait (EPCOMM_TIMEOUT_MS)
  /// Elastic ranks: bit r set while rank r takes part (every bit while none is masked; ranks >= 32 are never masked).
  /// A masked rank is never put to, signalled or waited for; the positions of its experts are dropped from the
  /// indices before the kernels (docs/failures.md, "Elastic ranks").
  uint32_t live;
};

/// Arguments of the dispatch kernel: the send half's fields (used when it runs the send half), then the receive
/// half's.
struct DispatchKernelArgs {
  Geometry g;
  DeviceState st;
  // Send half.
  const uint8_t* x;  ///< [m, hiddenBytes], rows 16-byte aligned
  int64_t xRowStrideBytes;
  const uint8_t* xScale;  ///< [m, S] 4-byte elements, any strides, or null
  int64_t xScaleStrideBytes[2];
  const void* indices;  ///< [m, K]
  int32_t indexKind;    ///< see decodeIndex
  int64_t indexStrides[2];
  uint32_t m;
  const int32_t* boundM;  ///< nullable device scalar
  // Receive half.
  int32_t* outNumTokens;  ///< [L]
  uint8_t* outX;
  int64_t outExpertStrideBytes;  ///< 0 for packed
  int64_t outRowStrideBytes;
  uint8_t* outScale;               ///< null without scales
  int64_t outScaleStrideBytes[3];  ///< expert (0 for packed), row, column
};

/// Arguments of the combine kernel: the send half's fields, then the receive half's.
struct CombineKernelArgs {
  Geometry g;
  DeviceState st;
  // Send half.
  const uint8_t* y;       ///< expertY, layout of outExpertX with H elements per row
  int64_t yExpertStride;  ///< elements; 0 for packed
  int64_t yRowStride;     ///< elements
  int32_t yType;          ///< CombineType
  const float* weights;   ///< [m >= the dispatch's m, K]
  int64_t weightStrides[2];
  // Receive half.
  uint8_t* out;          ///< [m, H]
  int64_t outRowStride;  ///< elements
  int32_t outType;       ///< CombineType
  const void* indices;
  int32_t indexKind;
  int64_t indexStrides[2];
  uint32_t m;
  const int32_t* boundM;
  int32_t accumulate;
};

/// Launchers: enqueue one kernel that runs the call's halves on `stream` (a cudaStream_t) and return the cudaError_t
/// of the launch. The fields of a half that does not run are not read.
int launchDispatch(const DispatchKernelArgs& a, bool send, bool recv, void* stream);
int launchCombine(const CombineKernelArgs& a, bool send, bool recv, void* stream);
/// Raises the dynamic shared-memory limit of the dispatch kernels to what `g` needs, when it is lower (never lowers
/// it: the limit is the kernel's, shared by every object of the process); returns the cudaError_t.
int configureKernels(const Geometry& g);

}  // namespace nvshmem
}  // namespace epcomm
