// CUDA helpers of the GPU backends (nvlink, nvshmem, proxy): the check every CUDA runtime call goes through, the device
// a rank runs on, and whether this process sees a device at all. Header-only, and the one header of src/core that
// includes <cuda_runtime.h>: only the GPU backends include it, so the core builds without CUDA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/env.hpp"
#include "epcomm/config.hpp"
#include "epcomm/error.hpp"

/// Throws Error(kCuda) naming the call and CUDA's message unless `expr` returns cudaSuccess.
#define EPCOMM_CHECK_CUDA(expr)                                                           \
  do {                                                                                    \
    cudaError_t epcomm_err_ = (expr);                                                     \
    if (epcomm_err_ != cudaSuccess) {                                                     \
      EPCOMM_THROW(kCuda, #expr << " failed: " << cudaGetErrorString(epcomm_err_) << " (" \
                                << static_cast<int>(epcomm_err_) << ")");                 \
    }                                                                                     \
  } while (0)

namespace epcomm {

/// The CUDA device of rank `c.rank`: EPCOMM_LOCAL_RANK when set, else the rank modulo the devices this process sees.
/// Does not make it current. Throws Error(kUnavailable) when there is no device ("<prefix>no CUDA device") or
/// EPCOMM_LOCAL_RANK names one beyond them, Error(kCuda) when CUDA cannot count them.
inline int pickDevice(const Config& c, const char* prefix = "") {
  int count = 0;
  EPCOMM_CHECK_CUDA(cudaGetDeviceCount(&count));
  EPCOMM_CHECK(count > 0, kUnavailable, prefix << "no CUDA device");
  const int local = env().localRank >= 0 ? env().localRank : static_cast<int>(c.rank) % count;
  EPCOMM_CHECK(local < count, kUnavailable,
               "EPCOMM_LOCAL_RANK = " << local << " but this process sees " << count << " CUDA devices");
  return local;
}

/// Throws Error(kInvalidArgument) unless `device` is the current CUDA device ("<prefix>rank <rank>: the current CUDA
/// device is ... but this object lives on ..."): an object's kernels run on the device it was made on.
inline void checkCurrentDevice(int device, uint32_t rank, const char* prefix = "") {
  int cur = -1;
  EPCOMM_CHECK_CUDA(cudaGetDevice(&cur));
  EPCOMM_CHECK(
      cur == device, kInvalidArgument,
      prefix << "rank " << rank << ": the current CUDA device is " << cur << " but this object lives on " << device);
}

/// Throws Error(kCuda) "<prefix>rank <rank>: <what> launch failed: <CUDA's message>" unless `rc` (a kernel launch's
/// cudaError_t, as an int) is cudaSuccess.
inline void checkLaunch(int rc, const char* prefix, uint32_t rank, const char* what) {
  EPCOMM_CHECK(rc == 0, kCuda,
               prefix << "rank " << rank << ": " << what
                      << " launch failed: " << cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

/// Whether this process sees at least one CUDA device; when not, `whyNot` (unless null) says why, and CUDA's last
/// error is cleared. Never throws.
inline bool cudaDeviceSeen(std::string* whyNot) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    if (whyNot != nullptr) {
      *whyNot = e != cudaSuccess ? std::string("no CUDA device (") + cudaGetErrorString(e) + ")" : "no CUDA device";
    }
    cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace epcomm
