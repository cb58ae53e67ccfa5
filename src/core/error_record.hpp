// The error record that the nvlink and proxy kernels leave for the host: pinned host memory mapped into the GPU,
// written once by the first kernel that times out or sees a bad input, and turned into a named error by the next API
// call (the host reads it without synchronising). No CUDA headers: host code includes it too; the device half is
// compiled only by nvcc.
#pragma once

#include <cstdint>

namespace epcomm {

/// One kernel failure. `code` is written last, so a host that sees it sees the other fields too.
struct KernelErrorRecord {
  int32_t code;   ///< 0 = none, else the backend's ErrorPhase
  int32_t rank;   ///< rank that detected it
  int32_t peer;   ///< peer involved (timeouts: the one that never arrived), -1 when none
  int32_t block;  ///< block that detected it
  int64_t a;      ///< token or entry index (bad input), or the flag value seen (timeouts)
  int64_t b;      ///< position and index (bad input), or the expected flag value (timeouts)
};

#if defined(__CUDACC__)
/// Writes the fields of `r`, then (after a system-scope fence) its code `phase`, then fences again. The caller has
/// claimed the record (the first error wins).
__device__ __forceinline__ void publishKernelError(volatile KernelErrorRecord* r, int32_t phase, int32_t rank,
                                                   int32_t peer, int64_t a, int64_t b) {
  r->rank = rank;
  r->peer = peer;
  r->block = static_cast<int32_t>(blockIdx.x);
  r->a = a;
  r->b = b;
  __threadfence_system();
  r->code = phase;
  __threadfence_system();
}
#endif

}  // namespace epcomm
