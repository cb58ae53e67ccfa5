// Conversions between fp32 and the narrow float types epcomm moves (bf16, fp16, fp8 e4m3 / e5m2), usable from host
// and device code. Every narrowing conversion rounds to nearest, ties to even, like the hardware cvt instructions,
// so the CPU reference and the kernels produce the same bits.
// NOTE: checked bit for bit against an H200's conversions (__float2bfloat16_rn, __float2half_rn,
// __nv_cvt_float_to_fp8 with __NV_NOSAT and __NV_SATFINITE, __nv_cvt_fp8_to_halfraw) on 4M inputs biased towards
// ties and range edges: no mismatch, host and device paths identical.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/layout.hpp"
#include "epcomm/tensor.hpp"

namespace epcomm {

/// The IEEE bits of an fp32 value.
EPCOMM_HD uint32_t floatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

/// The fp32 value of IEEE bits.
EPCOMM_HD float bitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

namespace detail {

// Encodes fp32 into a small float with kExp exponent bits and kMan mantissa bits (sign bit on top), rounding to
// nearest even. kIeee: the all-ones exponent means inf/NaN (fp16, e5m2); otherwise (e4m3fn) there is no inf and
// only the all-ones code is NaN. Overflow gives inf (kIeee) or NaN (e4m3fn); with `saturate`, overflow and inf give
// the largest finite value.
template <int kExp, int kMan, bool kIeee>
EPCOMM_HD uint32_t encodeSmallFloat(float f, bool saturate) {
  constexpr int kBias = (1 << (kExp - 1)) - 1;
  constexpr int kEmin = 1 - kBias;
  constexpr uint32_t kExpMask = (1u << kExp) - 1;
  constexpr uint32_t kInfCode = kExpMask << kMan;
  constexpr uint32_t kNanCode = kIeee ? (kInfCode | (1u << (kMan - 1))) : ((kExpMask << kMan) | ((1u << kMan) - 1));
  constexpr uint32_t kMaxFinite = kIeee ? (kInfCode - 1) : (kNanCode - 1);
  const uint32_t bits = floatBits(f);
  const uint32_t sign = (bits >> 31) << (kExp + kMan);
  const uint32_t absBits = bits & 0x7FFFFFFFu;
  if (absBits > 0x7F800000u) return sign | kNanCode;
  if (absBits == 0x7F800000u) return sign | (saturate ? kMaxFinite : (kIeee ? kInfCode : kNanCode));
  // |f| = sig * 2^(e32 - 23); the result keeps kMan fraction bits at exponent e = max(e32, kEmin).
  const uint32_t expField = absBits >> 23;
  const uint32_t sig = expField == 0 ? (absBits & 0x7FFFFFu) : ((absBits & 0x7FFFFFu) | 0x800000u);
  const int e32 = expField == 0 ? -126 : static_cast<int>(expField) - 127;
  const int e = e32 > kEmin ? e32 : kEmin;
  const int shift = 23 - kMan + (e - e32);
  if (shift > 24) return sign;  // below half the smallest subnormal: rounds to zero
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // Subnormals (e == kEmin, q < 2^kMan) and normals share this formula; a carry out of the mantissa moves
  // into the exponent field by itself.
  const uint32_t code = (static_cast<uint32_t>(e - kEmin) << kMan) + q;
  if (code > kMaxFinite) return sign | (saturate ? kMaxFinite : (kIeee ? kInfCode : kNanCode));
  return sign | code;
}

template <int kExp, int kMan, bool kIeee>
EPCOMM_HD float decodeSmallFloat(uint32_t code) {
  constexpr int kBias = (1 << (kExp - 1)) - 1;
  constexpr uint32_t kExpMask = (1u << kExp) - 1;
  const uint32_t sign = ((code >> (kExp + kMan)) & 1u) << 31;
  uint32_t expField = (code >> kMan) & kExpMask;
  uint32_t man = code & ((1u << kMan) - 1);
  if (kIeee && expField == kExpMask) return bitsFloat(sign | 0x7F800000u | (man != 0 ? 0x400000u : 0u));
  if (!kIeee && expField == kExpMask && man == (1u << kMan) - 1) return bitsFloat(sign | 0x7FC00000u);
  if (expField == 0) {
    if (man == 0) return bitsFloat(sign);
    // Subnormal here, normal in fp32: shift the leading one into the implicit position.
    int e = 1 - kBias;
    while ((man & (1u << kMan)) == 0) {
      man <<= 1;
      --e;
    }
    man &= (1u << kMan) - 1;
    return bitsFloat(sign | (static_cast<uint32_t>(e + 127) << 23) | (man << (23 - kMan)));
  }
  return bitsFloat(sign | ((expField - kBias + 127) << 23) | (man << (23 - kMan)));
}

}  // namespace detail

/// fp32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
EPCOMM_HD uint16_t floatToBf16(float f) {
  const uint32_t u = floatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
/// bf16 bits -> fp32 (exact).
EPCOMM_HD float bf16ToFloat(uint16_t h) { return bitsFloat(static_cast<uint32_t>(h) << 16); }

/// fp32 -> IEEE fp16 bits, round to nearest even; overflow gives inf.
EPCOMM_HD uint16_t floatToF16(float f) {
  return static_cast<uint16_t>(detail::encodeSmallFloat<5, 10, true>(f, false));
}
/// fp16 bits -> fp32 (exact).
EPCOMM_HD float f16ToFloat(uint16_t h) { return detail::decodeSmallFloat<5, 10, true>(h); }

/// fp32 -> fp8 e4m3 ("fn": no inf, max 448, 0x7F/0xFF = NaN), round to nearest even. Values that round above 448
/// and +-inf become NaN (as torch's float8_e4m3fn cast and CUDA's __NV_NOSAT), or +-448 when `saturate`.
EPCOMM_HD uint8_t floatToFp8E4M3(float f, bool saturate = false) {
  return static_cast<uint8_t>(detail::encodeSmallFloat<4, 3, false>(f, saturate));
}
/// fp8 e4m3 bits -> fp32 (exact).
EPCOMM_HD float fp8E4M3ToFloat(uint8_t b) { return detail::decodeSmallFloat<4, 3, false>(b); }

/// fp32 -> fp8 e5m2 (IEEE-like, max 57344, has inf), round to nearest even; overflow gives inf, or +-57344 when
/// `saturate` (then +-inf also becomes +-57344, as with __NV_SATFINITE).
EPCOMM_HD uint8_t floatToFp8E5M2(float f, bool saturate = false) {
  return static_cast<uint8_t>(detail::encodeSmallFloat<5, 2, true>(f, saturate));
}
/// fp8 e5m2 bits -> fp32 (exact).
EPCOMM_HD float fp8E5M2ToFloat(uint8_t b) { return detail::decodeSmallFloat<5, 2, true>(b); }

/// Element `i` of a float tensor of dtype `dtype` (bf16, fp16, fp32, fp8 e4m3 / e5m2) as fp32; 0 for other dtypes.
EPCOMM_HD float loadAsFloat(DType dtype, const void* base, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kBf16:
      return bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16:
      return f16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFp8E4M3:
      return fp8E4M3ToFloat(static_cast<const uint8_t*>(base)[i]);
    case DType::kFp8E5M2:
      return fp8E5M2ToFloat(static_cast<const uint8_t*>(base)[i]);
    default:
      return 0.0f;
  }
}

/// Stores fp32 `v` as element `i` of a float tensor of dtype `dtype`, rounding to nearest even; other dtypes are
/// left untouched.
EPCOMM_HD void storeFromFloat(DType dtype, void* base, int64_t i, float v) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::kBf16:
      static_cast<uint16_t*>(base)[i] = floatToBf16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = floatToF16(v);
      break;
    case DType::kFp8E4M3:
      static_cast<uint8_t*>(base)[i] = floatToFp8E4M3(v);
      break;
    case DType::kFp8E5M2:
      static_cast<uint8_t*>(base)[i] = floatToFp8E5M2(v);
      break;
    default:
      break;
  }
}

}  // namespace epcomm
