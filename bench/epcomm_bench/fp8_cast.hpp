// The separate fp8 cast that epcomm-bench --fp8 times against the dispatch that casts (Config::dispatchCast): DeepEP's
// per-token cast (per_token_cast_to_fp8) as one kernel launch, as an engine runs it before an fp8 dispatch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epcomm {
namespace bench {

/// x: bf16 bits [m, hidden] (contiguous, device); q: fp8 e4m3 [m, hidden]; scales: fp32 [m, hidden / 128] (row
/// stride `scaleRowStride` elements). Per block of 128 elements of a row: amax = max(|x|, 1e-4), scale = amax / 448
/// (`pow2`: rounded up to a power of two), q = e4m3(x / scale), as the library defines the cast. hidden % 128 == 0.
void castFp8Blocks(cudaStream_t stream, const uint16_t* x, uint8_t* q, float* scales, int64_t scaleRowStride,
                   uint32_t m, uint32_t hidden, bool pow2);

}  // namespace bench
}  // namespace epcomm
