// epcomm-bench --fp8's separate cast kernel. Written apart from the library (which it is measured against): the same
// definition of the cast with CUDA's own IEEE division, so its output doubles as a check of the dispatch's bits.
#include <cuda_fp8.h>

#include "bench_cuda.hpp"
#include "fp8_cast.hpp"

namespace epcomm {
namespace bench {

namespace {

// One thread per 16 elements (32 bytes of bf16 in, 16 bytes of fp8 out): the 8 threads of a 128-element block take
// its amax with three xor shuffles, and the block's first thread stores the scale.
__global__ void castKernel(const uint16_t* x, uint8_t* q, float* scales, int64_t scaleRowStride, uint32_t m,
                           uint32_t hidden, bool pow2) {
  const uint64_t v = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t vectors = static_cast<uint64_t>(m) * hidden / 16;
  const bool live = v < vectors;
  int4 in[2] = {make_int4(0, 0, 0, 0), make_int4(0, 0, 0, 0)};
  if (live) {
    in[0] = __ldg(reinterpret_cast<const int4*>(x) + 2 * v);
    in[1] = __ldg(reinterpret_cast<const int4*>(x) + 2 * v + 1);
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(in);
  float f[16];
  float amax = 0.0f;
  for (int j = 0; j < 8; ++j) {
    f[2 * j] = __uint_as_float(w[j] << 16);
    f[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    amax = fmaxf(amax, fmaxf(fabsf(f[2 * j]), fabsf(f[2 * j + 1])));
  }
  for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  amax = fmaxf(amax, 1e-4f);
  float scale = __fdiv_rn(amax, 448.0f), inv = __fdiv_rn(448.0f, amax);
  if (pow2 && isfinite(scale)) {
    const uint32_t bits = __float_as_uint(scale), e = (bits >> 23) + ((bits & 0x7FFFFFu) != 0 ? 1u : 0u);
    scale = __uint_as_float(e << 23);
    inv = __uint_as_float((254u - e) << 23);
  }
  if (!live) return;
  uint32_t out[4];
  for (int j = 0; j < 4; ++j) {
    const uint32_t a =
        __nv_cvt_float2_to_fp8x2(make_float2(f[4 * j] * inv, f[4 * j + 1] * inv), __NV_SATFINITE, __NV_E4M3);
    const uint32_t b =
        __nv_cvt_float2_to_fp8x2(make_float2(f[4 * j + 2] * inv, f[4 * j + 3] * inv), __NV_SATFINITE, __NV_E4M3);
    out[j] = a | b << 16;
  }
  reinterpret_cast<int4*>(q)[v] = make_int4(out[0], out[1], out[2], out[3]);
  if (threadIdx.x % 8 == 0) {
    const uint64_t row = v * 16 / hidden, block = v * 16 % hidden / 128;
    scales[row * scaleRowStride + block] = scale;
  }
}

}  // namespace

void castFp8Blocks(cudaStream_t stream, const uint16_t* x, uint8_t* q, float* scales, int64_t scaleRowStride,
                   uint32_t m, uint32_t hidden, bool pow2) {
  const uint64_t vectors = static_cast<uint64_t>(m) * hidden / 16;
  if (vectors == 0) return;
  constexpr uint32_t kThreads = 256;
  const uint32_t blocks = static_cast<uint32_t>((vectors + kThreads - 1) / kThreads);
  castKernel<<<blocks, kThreads, 0, stream>>>(x, q, scales, scaleRowStride, m, hidden, pow2);
  BENCH_CUDA(cudaGetLastError());
}

}  // namespace bench
}  // namespace epcomm
