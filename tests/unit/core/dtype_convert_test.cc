// fp32 <-> bf16 / fp16 / fp8 conversions: known values, ties to even, inf/NaN, exhaustive round trips, and a
// brute-force check that narrowing picks the nearest representable value.
#include "core/dtype_convert.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace epcomm {
namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNan = std::numeric_limits<float>::quiet_NaN();

float pow2(int e) { return std::ldexp(1.0f, e); }

TEST(Bf16, KnownValues) {
  EXPECT_EQ(floatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(floatToBf16(-2.0f), 0xC000);
  EXPECT_EQ(floatToBf16(0.0f), 0x0000);
  EXPECT_EQ(floatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(floatToBf16(kInf), 0x7F80);
  EXPECT_EQ(floatToBf16(-kInf), 0xFF80);
  EXPECT_EQ(bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(bf16ToFloat(0x4049), 3.140625f);
  EXPECT_EQ(floatToBf16(3.14159265f), 0x4049);
}

TEST(Bf16, RoundsTiesToEven) {
  EXPECT_EQ(floatToBf16(1.0f + pow2(-8)), 0x3F80);                    // halfway between 0x3F80 and 0x3F81: keep even
  EXPECT_EQ(floatToBf16(1.0f + 3 * pow2(-8)), 0x3F82);                // halfway between 0x3F81 and 0x3F82: go to even
  EXPECT_EQ(floatToBf16(1.0f + pow2(-8) + pow2(-20)), 0x3F81);        // just above halfway
  EXPECT_EQ(floatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to inf
}

TEST(Bf16, NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(bf16ToFloat(floatToBf16(kNan))));
  EXPECT_TRUE(std::isnan(bf16ToFloat(floatToBf16(-kNan))));
  // A NaN whose payload lives only in the low 16 bits must not collapse to inf.
  const uint16_t b = floatToBf16(bitsFloat(0x7F800001u));
  EXPECT_EQ(b & 0x7F80, 0x7F80);
  EXPECT_NE(b & 0x007F, 0);
}

TEST(Bf16, ExhaustiveRoundTrip) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const float f = bf16ToFloat(static_cast<uint16_t>(code));
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToBf16(f), code) << "code " << code;
  }
}

TEST(F16, KnownValues) {
  EXPECT_EQ(floatToF16(1.0f), 0x3C00);
  EXPECT_EQ(floatToF16(-2.0f), 0xC000);
  EXPECT_EQ(floatToF16(0.5f), 0x3800);
  EXPECT_EQ(floatToF16(-0.0f), 0x8000);
  EXPECT_EQ(floatToF16(65504.0f), 0x7BFF);
  EXPECT_EQ(floatToF16(65519.0f), 0x7BFF);
  EXPECT_EQ(floatToF16(65520.0f), 0x7C00);  // halfway to 65536: the even side is inf
  EXPECT_EQ(floatToF16(1e6f), 0x7C00);
  EXPECT_EQ(floatToF16(kInf), 0x7C00);
  EXPECT_EQ(floatToF16(-kInf), 0xFC00);
  EXPECT_EQ(floatToF16(pow2(-14)), 0x0400);  // smallest normal
  EXPECT_EQ(floatToF16(pow2(-24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f16ToFloat(0x0001), pow2(-24));
  EXPECT_EQ(f16ToFloat(0x03FF), pow2(-14) - pow2(-24));
  EXPECT_EQ(f16ToFloat(0x3555), 0.333251953125f);
}

TEST(F16, RoundsTiesToEven) {
  EXPECT_EQ(floatToF16(1.0f + pow2(-11)), 0x3C00);
  EXPECT_EQ(floatToF16(1.0f + 3 * pow2(-11)), 0x3C02);
  EXPECT_EQ(floatToF16(pow2(-25)), 0x0000);      // half the smallest subnormal: ties to 0
  EXPECT_EQ(floatToF16(3 * pow2(-25)), 0x0002);  // 1.5 subnormal units: ties to 2
  EXPECT_EQ(floatToF16(pow2(-25) + pow2(-40)), 0x0001);
  EXPECT_EQ(floatToF16(pow2(-14) - pow2(-25)), 0x0400);  // rounds up from the subnormals into the normals
  EXPECT_EQ(floatToF16(pow2(-30)), 0x0000);
  EXPECT_EQ(floatToF16(-pow2(-30)), 0x8000);
  EXPECT_EQ(floatToF16(bitsFloat(1)), 0x0000);  // fp32 subnormal
}

TEST(F16, NaN) {
  const uint16_t h = floatToF16(kNan);
  EXPECT_EQ(h & 0x7C00, 0x7C00);
  EXPECT_NE(h & 0x03FF, 0);
  EXPECT_TRUE(std::isnan(f16ToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(f16ToFloat(0xFC01)));
  EXPECT_EQ(f16ToFloat(0x7C00), kInf);
  EXPECT_EQ(f16ToFloat(0xFC00), -kInf);
}

TEST(F16, ExhaustiveRoundTrip) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const float f = f16ToFloat(static_cast<uint16_t>(code));
    if (std::isnan(f)) continue;
    ASSERT_EQ(floatToF16(f), code) << "code " << code;
  }
}

TEST(Fp8E4M3, KnownValues) {
  EXPECT_EQ(floatToFp8E4M3(1.0f), 0x38);
  EXPECT_EQ(floatToFp8E4M3(-1.0f), 0xB8);
  EXPECT_EQ(floatToFp8E4M3(448.0f), 0x7E);
  EXPECT_EQ(floatToFp8E4M3(-448.0f), 0xFE);
  EXPECT_EQ(floatToFp8E4M3(464.0f), 0x7E);  // halfway between 448 and 480 (not representable): even side
  EXPECT_EQ(floatToFp8E4M3(480.0f), 0x7F);  // rounds past 448: NaN without saturation
  EXPECT_EQ(floatToFp8E4M3(480.0f, true), 0x7E);
  EXPECT_EQ(floatToFp8E4M3(-1e9f, true), 0xFE);
  EXPECT_EQ(floatToFp8E4M3(kInf), 0x7F);
  EXPECT_EQ(floatToFp8E4M3(-kInf), 0xFF);
  EXPECT_EQ(floatToFp8E4M3(kInf, true), 0x7E);
  EXPECT_EQ(floatToFp8E4M3(kNan) & 0x7F, 0x7F);
  EXPECT_EQ(floatToFp8E4M3(pow2(-9)), 0x01);   // smallest subnormal
  EXPECT_EQ(floatToFp8E4M3(pow2(-10)), 0x00);  // tie to even (0)
  EXPECT_EQ(floatToFp8E4M3(pow2(-6)), 0x08);   // smallest normal
  EXPECT_EQ(fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(fp8E4M3ToFloat(0x01), pow2(-9));
  EXPECT_EQ(fp8E4M3ToFloat(0x77), 240.0f);  // exponent 14 is a normal value in e4m3fn
  EXPECT_EQ(fp8E4M3ToFloat(0x78), 256.0f);  // exponent 15 with mantissa != 7 is a normal value too
  EXPECT_TRUE(std::isnan(fp8E4M3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(fp8E4M3ToFloat(0xFF)));
  EXPECT_EQ(fp8E4M3ToFloat(0x80), -0.0f);
  EXPECT_TRUE(std::signbit(fp8E4M3ToFloat(0x80)));
}

TEST(Fp8E5M2, KnownValues) {
  EXPECT_EQ(floatToFp8E5M2(1.0f), 0x3C);
  EXPECT_EQ(floatToFp8E5M2(-1.0f), 0xBC);
  EXPECT_EQ(floatToFp8E5M2(57344.0f), 0x7B);
  EXPECT_EQ(floatToFp8E5M2(61440.0f), 0x7C);  // halfway to 65536: the even side is inf
  EXPECT_EQ(floatToFp8E5M2(61440.0f, true), 0x7B);
  EXPECT_EQ(floatToFp8E5M2(kInf), 0x7C);
  EXPECT_EQ(floatToFp8E5M2(-kInf), 0xFC);
  EXPECT_EQ(floatToFp8E5M2(kInf, true), 0x7B);  // saturation also clamps inf (as __NV_SATFINITE)
  EXPECT_EQ(floatToFp8E5M2(-kInf, true), 0xFB);
  EXPECT_EQ(floatToFp8E5M2(pow2(-16)), 0x01);  // smallest subnormal
  EXPECT_EQ(floatToFp8E5M2(1.125f), 0x3C);     // 1 + 1/8 is halfway between 1 and 1.25: even
  EXPECT_EQ(floatToFp8E5M2(1.375f), 0x3E);     // halfway between 1.25 and 1.5: even
  EXPECT_EQ(fp8E5M2ToFloat(0x7B), 57344.0f);
  EXPECT_EQ(fp8E5M2ToFloat(0x7C), kInf);
  EXPECT_EQ(fp8E5M2ToFloat(0xFC), -kInf);
  EXPECT_TRUE(std::isnan(fp8E5M2ToFloat(0x7D)));
  const uint8_t n = floatToFp8E5M2(kNan);
  EXPECT_EQ(n & 0x7C, 0x7C);
  EXPECT_NE(n & 0x03, 0);
}

TEST(Fp8, ExhaustiveRoundTrip) {
  for (uint32_t code = 0; code < 256; ++code) {
    const float a = fp8E4M3ToFloat(static_cast<uint8_t>(code));
    if (!std::isnan(a)) EXPECT_EQ(floatToFp8E4M3(a), code) << "e4m3 code " << code;
    const float b = fp8E5M2ToFloat(static_cast<uint8_t>(code));
    if (!std::isnan(b)) EXPECT_EQ(floatToFp8E5M2(b), code) << "e5m2 code " << code;
  }
}

// The nearest finite code by brute force over every code (ties: the even code), or ~0u when |f| is beyond
// the largest finite value plus half an ulp.
template <typename Decode>
uint32_t nearestCode(float f, uint32_t numCodes, Decode decode, float halfUlpAboveMax) {
  if (std::fabs(f) >= halfUlpAboveMax) return ~0u;
  uint32_t best = 0;
  double bestErr = INFINITY;
  for (uint32_t c = 0; c < numCodes; ++c) {
    const float v = decode(c);
    if (std::isnan(v) || std::isinf(v) || std::signbit(v) != std::signbit(f)) continue;
    const double err = std::fabs(static_cast<double>(v) - static_cast<double>(f));
    if (err < bestErr || (err == bestErr && (c & 1u) == 0)) {
      best = c;
      bestErr = err;
    }
  }
  return best;
}

TEST(Fp8, NarrowingPicksTheNearestValue) {
  uint64_t state = 12345;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int i = 0; i < 20000; ++i) {
    // Random magnitudes over the formats' whole range, including subnormals and values between codes.
    const float f = (next() & 1 ? -1.0f : 1.0f) * static_cast<float>(next() % (1u << 20)) *
                    pow2(static_cast<int>(next() % 40) - 40);
    const uint32_t e4 = nearestCode(
        f, 256, [](uint32_t c) { return fp8E4M3ToFloat(c); }, 464.0f);
    if (e4 != ~0u) ASSERT_EQ(floatToFp8E4M3(f), e4) << "e4m3 of " << f;
    const uint32_t e5 = nearestCode(
        f, 256, [](uint32_t c) { return fp8E5M2ToFloat(c); }, 61440.0f);
    if (e5 != ~0u) ASSERT_EQ(floatToFp8E5M2(f), e5) << "e5m2 of " << f;
  }
}

TEST(F16, NarrowingPicksTheNearestValue) {
  uint64_t state = 777;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  for (int i = 0; i < 300; ++i) {
    const float f = (next() & 1 ? -1.0f : 1.0f) * static_cast<float>(next() % (1u << 24)) *
                    pow2(static_cast<int>(next() % 50) - 50);
    const uint32_t want = nearestCode(
        f, 0x10000, [](uint32_t c) { return f16ToFloat(c); }, 65520.0f);
    if (want != ~0u) ASSERT_EQ(floatToF16(f), want) << "fp16 of " << f;
  }
}

TEST(LoadStore, EveryFloatDtype) {
  alignas(16) uint8_t buf[64] = {};
  for (DType d : {DType::kF32, DType::kBf16, DType::kF16, DType::kFp8E4M3, DType::kFp8E5M2}) {
    storeFromFloat(d, buf, 3, -1.5f);
    EXPECT_EQ(loadAsFloat(d, buf, 3), -1.5f) << dtypeName(d);
  }
  storeFromFloat(DType::kBf16, buf, 0, 1.0f);
  EXPECT_EQ(reinterpret_cast<uint16_t*>(buf)[0], 0x3F80);
  storeFromFloat(DType::kFp8E4M3, buf, 0, 1000.0f);
  EXPECT_EQ(buf[0], 0x7F);
}

}  // namespace
}  // namespace epcomm
