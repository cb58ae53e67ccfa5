// BENCH_CUDA: a failed CUDA runtime call in the benchmark becomes an epcomm::Error naming the call.
#pragma once

#include <cuda_runtime.h>

#include "epcomm/error.hpp"

#define BENCH_CUDA(expr)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) EPCOMM_THROW(kCuda, #expr << ": " << cudaGetErrorString(e_)); \
  } while (0)
