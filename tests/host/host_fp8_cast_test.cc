// The dispatch's fp8 cast (Config::dispatchCast): its arithmetic (the kernels' division against the IEEE one, the
// power-of-two scales), the config and argument checks, the reference, and the host backend end to end, whose
// outputs must be the bits of a separate cast (reference::castFp8Blocks) followed by a dispatch that copies.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/agreement.hpp"
#include "core/fp8_cast.hpp"
#include "core/validate.hpp"
#include "epcomm/error.hpp"
#include "fp8_cast_cases.hpp"
#include "support/multiprocess.hpp"
#ifdef EPCOMM_HAVE_HOST_BACKEND
#include "backends/host/host_all_to_all.hpp"
#include "support/fabric_probe.hpp"
#endif

namespace epcomm {
namespace test {
namespace {

void expectError(const std::function<void()>& fn, ErrorCode code, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected " << errorCodeName(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& p : parts) EXPECT_NE(e.message().find(p), std::string::npos) << p << " in " << e.what();
  }
}

// ---- Arithmetic ---------------------------------------------------------------------------------------------------

// fp8DivRn (the kernels' division) equals the IEEE division for every operand fp8BlockScale gives it: every mantissa
// of the divisor with 448 over it, every mantissa of the dividend over 448 (each step scales exactly with a power of
// two, so one binade stands for all), and then every bf16 amax from the 1e-4 floor up, and the range edges.
TEST(Fp8CastArithmetic, KernelDivisionIsTheIeeeDivision) {
  uint64_t bad = 0;
  for (uint32_t u = 0x3F800000u; u < 0x40000000u; ++u) {
    const float v = bitsFloat(u);
    bad += floatBits(fp8DivRn(kFp8E4M3Max, v)) != floatBits(kFp8E4M3Max / v);
    bad += floatBits(fp8DivRn(v, kFp8E4M3Max)) != floatBits(v / kFp8E4M3Max);
  }
  EXPECT_EQ(bad, 0u) << "over every fp32 in [1, 2)";
  std::vector<float> edges = {kFp8MinAmax, 448.0f, 0x1p120f, 0x1.fffffep120f, 0x1p121f, 0x1.fffffep127f};
  for (uint32_t h = 0; h < 0x7F80u; ++h) {
    const float v = bf16ToFloat(static_cast<uint16_t>(h));
    if (v >= kFp8MinAmax) edges.push_back(v);
  }
  for (float v : edges) {
    ASSERT_EQ(floatBits(fp8DivRn(kFp8E4M3Max, v)), floatBits(kFp8E4M3Max / v)) << "448 / " << v;
    ASSERT_EQ(floatBits(fp8DivRn(v, kFp8E4M3Max)), floatBits(v / kFp8E4M3Max)) << v << " / 448";
  }
}

// DeepEP's round_scale: the smallest power of two >= amax / 448, and its exact inverse.
TEST(Fp8CastArithmetic, PowerOfTwoScales) {
  for (int k = -20; k <= 20; ++k) {
    const float p = std::ldexp(1.0f, k);
    // amax / 448 a power of two exactly: it stays; one ulp above: the next power.
    Fp8BlockScale s = fp8BlockScale(p * 448.0f, true);
    EXPECT_EQ(s.scale, p) << k;
    EXPECT_EQ(s.inv, 1.0f / p) << k;
    const float above = std::nextafter(p, 2 * p) * 448.0f;
    s = fp8BlockScale(above, true);
    EXPECT_EQ(s.scale, 2 * p) << k;
    EXPECT_EQ(s.inv, 0.5f / p) << k;
  }
  // Just above a power of two, log2 in fp32 rounds to the power itself (the former std::log2 form gave 2^-10 here).
  EXPECT_EQ(fp8BlockScale(std::nextafter(0x1p-10f, 1.0f) * 448.0f, true).scale, 0x1p-9f);
  // The floor: an all-zero block.
  EXPECT_EQ(fp8BlockScale(0.0f, false).scale, kFp8MinAmax / 448.0f);
  EXPECT_EQ(fp8BlockScale(0.0f, false).inv, 448.0f / kFp8MinAmax);
  const Fp8BlockScale inf = fp8BlockScale(INFINITY, true);
  EXPECT_TRUE(std::isinf(inf.scale));
  EXPECT_EQ(inf.inv, 0.0f);
  for (uint32_t h = 0x0100; h < 0x7F80u; h += 37) {
    const float amax = bf16ToFloat(static_cast<uint16_t>(h));
    const Fp8BlockScale r = fp8BlockScale(amax, true), n = fp8BlockScale(amax, false);
    EXPECT_GE(r.scale, n.scale) << amax;
    EXPECT_LT(r.scale, 2 * n.scale) << amax;
    EXPECT_EQ(r.scale * r.inv, 1.0f) << amax;
  }
}

// ---- Config and argument checks -----------------------------------------------------------------------------------

TEST(Fp8CastConfig, ValidateNamesWhatDoesNotFit) {
  CastCase cc;
  Config c = cc.config(0);
  EXPECT_NO_THROW(c.validate());
  EXPECT_NE(c.toString().find(" cast=fp8_blocks "), std::string::npos) << c.toString();
  Config bad = c;
  bad.hiddenDim = bad.hiddenDimBytes = 192;
  bad.hiddenDimScaleBytes = 8;
  expectError([&] { bad.validate(); }, ErrorCode::kInvalidConfig, {"dispatchCast = fp8_blocks", "hiddenDim % 128"});
  bad = c;
  bad.hiddenDimBytes = 2 * c.hiddenDim;
  expectError([&] { bad.validate(); }, ErrorCode::kInvalidConfig, {"hiddenDimBytes must be hiddenDim = 256"});
  bad = c;
  bad.hiddenDimScaleBytes = 0;
  expectError([&] { bad.validate(); }, ErrorCode::kInvalidConfig, {"hiddenDimScaleBytes must be", "= 8, got 0"});
  bad = c;
  bad.dispatchCast = static_cast<DispatchCast>(7);
  expectError([&] { bad.validate(); }, ErrorCode::kInvalidConfig, {"dispatchCast 7"});
  // Every rank must agree on it: part of the settings checked at construction.
  Config plain = cc.config(0, DispatchCast::kNone);
  EXPECT_EQ(settingsDifference(configSettings(c), 0, configSettings(plain), 1),
            "dispatch_cast is fp8_blocks on rank 0 but none on rank 1");
  EXPECT_EQ(std::string(dispatchCastName(DispatchCast::kFp8BlocksPow2)), "fp8_blocks_pow2");
  EXPECT_EQ(dispatchCastBackends(), (std::vector<std::string>{"nvlink", "host"}));
}

struct CheckFixture {
  CastCase cc;
  std::vector<CastInputs> in = castInputs(cc, 0);
  CastOutputs out{cc, 0};
  DispatchArgs args() const {
    DispatchArgs a;
    out.setOutputs(a);
    a.x = in[0].x.view();
    a.indices = in[0].indices.view();
    return a;
  }
};

TEST(Fp8CastConfig, ArgumentChecks) {
  CheckFixture f;
  f.cc.ragged = false;
  f.in = castInputs(f.cc, 0);
  const Config c = f.cc.config(0);
  const CheckedDispatch ok = checkDispatchArgs(c, f.args(), MemoryKind::kHost, -1, true);
  EXPECT_EQ(ok.xRowStrideBytes, 2 * f.cc.H);
  EXPECT_EQ(ok.m, f.cc.T);
  // A backend that does not cast refuses, whatever the arguments.
  expectError([&] { checkDispatchArgs(c, f.args(), MemoryKind::kHost, -1); }, ErrorCode::kUnavailable,
              {"dispatchCast = fp8_blocks", "proxy and nvshmem"});
  // x: bf16 [m, H], not the fp8 payload.
  reference::HostTensor fp8x(DType::kFp8E4M3, {f.cc.T, f.cc.H});
  DispatchArgs a = f.args();
  a.x = fp8x.view();
  expectError([&] { checkDispatchArgs(c, a, MemoryKind::kHost, -1, true); }, ErrorCode::kInvalidArgument,
              {"x must be bf16", "fp8_e4m3"});
  reference::HostTensor narrow(DType::kBf16, {f.cc.T, f.cc.H / 2});
  a = f.args();
  a.x = narrow.view();
  expectError([&] { checkDispatchArgs(c, a, MemoryKind::kHost, -1, true); }, ErrorCode::kInvalidArgument,
              {"x dimension 1 must be 256"});
  // The scales are the dispatch's to compute.
  reference::HostTensor xs(DType::kF32, {f.cc.T, f.cc.H / 128});
  a = f.args();
  a.xScale = xs.view();
  expectError([&] { checkDispatchArgs(c, a, MemoryKind::kHost, -1, true); }, ErrorCode::kInvalidArgument,
              {"xScale given", "computes the scales"});
  // Outputs: fp8 e4m3 rows and fp32 scales.
  const Config plain = f.cc.config(0, DispatchCast::kNone);
  reference::HostTensor u8(DType::kU8,
                           {plain.numLocalExperts(), static_cast<int64_t>(plain.batchedRowsPerExpert()), f.cc.H});
  a = f.args();
  a.outExpertX = u8.view();
  expectError([&] { checkDispatchArgs(c, a, MemoryKind::kHost, -1, true); }, ErrorCode::kInvalidArgument,
              {"outExpertX must be fp8_e4m3", "u8"});
  a = f.args();
  a.outExpertXScale.dtype = DType::kI32;
  expectError([&] { checkDispatchArgs(c, a, MemoryKind::kHost, -1, true); }, ErrorCode::kInvalidArgument,
              {"outExpertXScale must be fp32"});
  // Without the cast the same bf16 x is the wrong size for an fp8 payload.
  expectError([&] { checkDispatchArgs(plain, f.args(), MemoryKind::kHost, -1); }, ErrorCode::kInvalidArgument,
              {"x rows are 512 bytes"});
}

// ---- The reference -----------------------------------------------------------------------------------------------

// reference::dispatch with a cast config casts as castFp8Blocks does: the same bits as the separate cast.
TEST(Fp8CastReference, DispatchWithCastIsCastThenDispatch) {
  for (DispatchCast cast : {DispatchCast::kFp8Blocks, DispatchCast::kFp8BlocksPow2}) {
    for (Layout layout : {Layout::kBatched, Layout::kPacked}) {
      CastCase cc;
      cc.W = 3;
      cc.E = 9;
      cc.cast = cast;
      cc.layout = layout;
      cc.padding = layout == Layout::kPacked ? 4 : 1;
      cc.masked = true;
      cc.columnMajorScales = true;
      cc.seed = 7;
      const std::vector<CastInputs> in = castInputs(cc, 0);
      const std::vector<CastOutputs> want = separateCastReference(cc, in);
      std::vector<CastOutputs> got;
      std::vector<DispatchArgs> args(cc.W);
      for (uint32_t r = 0; r < cc.W; ++r) got.emplace_back(cc, r);
      for (uint32_t r = 0; r < cc.W; ++r) {
        got[r].setOutputs(args[r]);
        args[r].x = in[r].x.view();
        args[r].indices = in[r].indices.view();
      }
      reference::dispatch(cc.config(0), args);
      uint64_t rows = 0;
      for (uint32_t r = 0; r < cc.W; ++r) {
        EXPECT_EQ(compareCastOutputs(got[r], want[r]), "") << "rank " << r << " " << dispatchCastName(cast);
        for (uint32_t le = 0; le < cc.E / cc.W; ++le) rows += got[r].counts.data<int32_t>()[le];
      }
      EXPECT_GT(rows, 0u);
    }
  }
}

// ---- The host backend, end to end ----------------------------------------------------------------------------------

#ifdef EPCOMM_HAVE_HOST_BACKEND
RunOptions runOptions() {
  RunOptions o;
  o.deadlineMs = 150000;
  return o;
}

// `rounds` rounds of `cc` on one host object per rank (whole calls, or send and receive halves), each compared bit
// for bit with the separate cast; a combine between rounds (dispatch and combine alternate).
void runHost(const CastCase& cc, uint32_t rounds, bool split) {
  RunResult result = runRanks(
      static_cast<int>(cc.W),
      [&](int rank, Bootstrap& bootstrap) {
        host::HostOptions options;
        options.provider = "tcp";
        options.privateTokens = 2;  // most rounds take the overflow path too
        host::HostAllToAll a2a(cc.config(static_cast<uint32_t>(rank)), bootstrap, options);
        for (uint32_t round = 0; round < rounds; ++round) {
          const std::vector<CastInputs> in = castInputs(cc, round);
          const std::vector<CastOutputs> want = separateCastReference(cc, in);
          CastOutputs got(cc, static_cast<uint32_t>(rank));
          DispatchArgs a;
          got.setOutputs(a);
          a.x = in[rank].x.view();
          a.indices = in[rank].indices.view();
          if (split) {
            a.doRecv = false;
            a2a.dispatch(a);
            a.doRecv = true;
            a.doSend = false;
            a2a.dispatch(a);
          } else {
            a2a.dispatch(a);
          }
          ASSERT_EQ(compareCastOutputs(got, want[rank]), "") << "rank " << rank << " round " << round;
          // Combine (zeros): the next dispatch must follow one.
          const Config c = cc.config(static_cast<uint32_t>(rank));
          const uint32_t m = in[rank].m;
          reference::HostTensor y(DType::kBf16,
                                  {c.numLocalExperts(), static_cast<int64_t>(c.batchedRowsPerExpert()), cc.H});
          reference::HostTensor yp(DType::kBf16, {static_cast<int64_t>(c.packedRows()), cc.H});
          reference::HostTensor out(DType::kBf16, {m, cc.H}), w(DType::kF32, {m, cc.K});
          CombineArgs cb;
          cb.outTokens = out.view();
          cb.indices = in[rank].indices.view();
          cb.weights = w.view();
          cb.expertY = cc.layout == Layout::kBatched ? y.view() : yp.view();
          a2a.combine(cb);
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(HostFp8Cast, MatchesTheSeparateCast) {
  SKIP_WITHOUT("tcp");
  CastCase cc;
  cc.seed = 11;
  runHost(cc, 3, false);
  cc.W = 3;
  cc.E = 12;
  cc.masked = true;
  cc.columnMajorScales = true;
  cc.cast = DispatchCast::kFp8BlocksPow2;
  cc.seed = 12;
  runHost(cc, 3, true);
}

TEST(HostFp8Cast, DpGroupsAndPackedLayout) {
  SKIP_WITHOUT("tcp");
  CastCase cc;
  cc.W = 4;
  cc.D = 2;
  cc.E = 8;
  cc.K = 4;
  cc.H = 384;
  cc.layout = Layout::kPacked;
  cc.padding = 8;
  cc.masked = true;
  cc.seed = 21;
  runHost(cc, 2, false);
}
#endif

}  // namespace
}  // namespace test
}  // namespace epcomm
