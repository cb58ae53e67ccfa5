// The benchmark's expertY values, the same on the host and on the device: bf16 near 1 (0x3f80 with the low 7
// mantissa bits from a hash of the element's index), so a 15 GB prefill expertY is generated in place in well under
// a second on the GPU instead of a minute of host random numbers (and 15 GB of host memory per rank).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define EPCOMM_BENCH_HD __host__ __device__
#else
#define EPCOMM_BENCH_HD
#endif

/// bf16 bits of a value in [1, 2): splitmix64 of (seed, i), low 7 bits as the mantissa.
EPCOMM_BENCH_HD inline uint16_t epcommBenchNearOne(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<uint16_t>(0x3f80u ^ (z & 0x7fu));
}
