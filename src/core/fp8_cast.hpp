// The per-block fp8 e4m3 cast of DeepEP's low-latency dispatch (Config::dispatchCast), written once for every place
// that computes it: the CPU reference (reference::castFp8Blocks), the host backend's dispatch and the nvlink dispatch
// kernel. The scale arithmetic below is the one definition; the loops around it read a block's elements, take their
// largest magnitude and convert each element times `inv`, which is exact to reproduce (max is order-free, the product
// is one rounding, the e4m3 conversion rounds to nearest even in core/dtype_convert.hpp and in the hardware alike).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype_convert.hpp"
#include "core/layout.hpp"
#include "epcomm/config.hpp"

namespace epcomm {

/// The largest finite fp8 e4m3 ("fn") value, and the floor of a block's amax (an all-zero block gets a finite scale).
constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8MinAmax = 1e-4f;

/// A block's scale (x ~ fp8 * scale) and the factor its elements are multiplied by before the conversion.
struct Fp8BlockScale {
  float scale;
  float inv;
};

/// a / b rounded to nearest even, from multiplies and FMAs only, for the divisions of fp8BlockScale: a = 448 and b a
/// finite amax >= 1e-4, or a such an amax and b = 448. The kernels use it instead of the division operator, whose
/// CUDA implementation calls an out-of-line slow path (a call and its spills in the dispatch kernels). Newton's
/// iteration for 1 / b from a bit-trick guess (3 steps), then q = a * r corrected once by the remainder
/// (Markstein); b above 2^120 is scaled down first (with a = 448: exact), so that 1 / b stays a normal number. Equal
/// to the IEEE division for every b in [1, 2) with a = 448 and every a in [1, 2) with b = 448, hence (every step
/// scales exactly with a power of two) for all the operands above: tests/host/host_fp8_cast_test.cc checks it.
EPCOMM_HD float fp8DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  auto fma = [](float x, float y, float z) { return __fmaf_rn(x, y, z); };
  auto mul = [](float x, float y) { return __fmul_rn(x, y); };
#else
  auto fma = [](float x, float y, float z) { return std::fma(x, y, z); };
  auto mul = [](float x, float y) { return x * y; };
#endif
  if (b > 0x1p120f) {
    a = mul(a, 0x1p-8f);
    b = mul(b, 0x1p-8f);
  }
  float r = bitsFloat(0x7EF311C3u - floatBits(b));
  for (int i = 0; i < 3; ++i) r = fma(r, fma(-b, r, 1.0f), r);
  const float q = mul(a, r);
  return fma(fma(-b, q, a), r, q);
}

/// The scale of a block whose largest magnitude is `amax` (a max that skipped NaN elements, as fmaxf and
/// `a > b ? a : b` do): amax is floored at 1e-4, scale = amax / 448, inv = 448 / amax, both rounded to nearest (the
/// division operator on the CPU, fp8DivRn in kernels: the same bits). `pow2` (DeepEP's round_scale): scale rounded
/// up to the next power of two, from its bits (exact: a scale that is a power of two stays, any other takes the next
/// exponent), and inv = 1 / scale exactly. An infinite amax gives scale = inf and inv = 0.
EPCOMM_HD Fp8BlockScale fp8BlockScale(float amax, bool pow2) {
  amax = amax > kFp8MinAmax ? amax : kFp8MinAmax;
#if defined(__CUDA_ARCH__)
  Fp8BlockScale s{fp8DivRn(amax, kFp8E4M3Max), fp8DivRn(kFp8E4M3Max, amax)};
  if (floatBits(amax) == 0x7F800000u) s = Fp8BlockScale{amax, 0.0f};
#else
  Fp8BlockScale s{amax / kFp8E4M3Max, kFp8E4M3Max / amax};
#endif
  if (pow2) {
    // scale >= 1e-4 / 448 > 2^-23: a normal number, so its biased exponent is bits >> 23 (the sign is 0). An infinite
    // scale stays.
    const uint32_t bits = floatBits(s.scale);
    const uint32_t exponent = bits >> 23;
    if (exponent < 255) {
      const uint32_t up = exponent + ((bits & 0x7FFFFFu) != 0 ? 1u : 0u);  // biased exponent of 2^ceil(log2 scale)
      s.scale = bitsFloat(up << 23);
      s.inv = bitsFloat((254u - up) << 23);  // 2^-(up - 127): amax < 2^128 keeps up <= 246, so this is normal
    }
  }
  return s;
}

/// Casts one token: `x` holds `hidden` contiguous elements of `dtype` (bf16, fp16 or fp32), `out` receives `hidden`
/// fp8 e4m3 bytes and scales[b * scaleStride] the scale of block b (hidden / block of them; hidden % block == 0).
/// CPU and device code may call it; the nvlink kernel has its own vectorised loop around fp8BlockScale.
EPCOMM_HD void castFp8Row(DType dtype, const void* x, uint32_t hidden, bool pow2, uint8_t* out, float* scales,
                          int64_t scaleStride, uint32_t block = kFp8CastBlock) {
  for (uint32_t h0 = 0; h0 < hidden; h0 += block) {
    float amax = 0.0f;
    for (uint32_t h = h0; h < h0 + block; ++h) {
      const float a = bitsFloat(floatBits(loadAsFloat(dtype, x, h)) & 0x7FFFFFFFu);
      amax = a > amax ? a : amax;  // NaN compares false: skipped, as fmaxf skips it
    }
    const Fp8BlockScale s = fp8BlockScale(amax, pow2);
    scales[static_cast<int64_t>(h0 / block) * scaleStride] = s.scale;
    for (uint32_t h = h0; h < h0 + block; ++h) out[h] = floatToFp8E4M3(loadAsFloat(dtype, x, h) * s.inv);
  }
}

/// Whether `cast` rounds the scales to powers of two.
EPCOMM_HD bool castPow2(DispatchCast cast) { return cast == DispatchCast::kFp8BlocksPow2; }

}  // namespace epcomm
