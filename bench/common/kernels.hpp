// The benchmark's small kernels (spin.cu): declared for epcomm-bench and the probes that link spin.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

void epcommBenchSpin(cudaStream_t stream, unsigned nanoseconds);
void epcommBenchFillNearOne(cudaStream_t stream, uint16_t* y, uint64_t n, uint64_t seed);
void epcommBenchEmpty(cudaStream_t stream, int blocks);
void epcommBenchEmptyLike(cudaStream_t stream, int blocks, unsigned smemBytes);
void epcommBenchFlagPing(cudaStream_t stream, int blocks, uint64_t* nextFlag, const uint64_t* myFlag, uint64_t round);
void epcommBenchStoreProbe(cudaStream_t stream, int blocks, char* dst, int n, int stride, uint64_t* out);
