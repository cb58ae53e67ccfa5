// The benchmarks' small kernels (kernels.cu): for epcomm-bench and the probes that link kernels.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

void epcommBenchSpin(cudaStream_t stream, unsigned nanoseconds);
void epcommBenchFillNearOne(cudaStream_t stream, uint16_t* y, uint64_t n, uint64_t seed);
void epcommBenchEmpty(cudaStream_t stream, int blocks);
void epcommBenchEmptyLike(cudaStream_t stream, int blocks, unsigned smemBytes);
void epcommBenchFlagPing(cudaStream_t stream, int blocks, uint64_t* nextFlag, const uint64_t* myFlag, uint64_t round);
