// Shared by the single-process NVLink probes (line_probe.cu, queue_probe.cu): the exit status for "this machine
// cannot run the probe" (ctest's SKIP_RETURN_CODE) and a CUDA call check that prints the failure and returns 2 from
// main.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

namespace probe {

constexpr int kSkipped = 77;

}  // namespace probe

#define PROBE_CHECK(expr)                                                                          \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s: %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 2;                                                                                    \
    }                                                                                              \
  } while (0)
