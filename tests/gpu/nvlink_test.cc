// The nvlink backend against the CPU reference, one process per GPU (forked before any CUDA call, TCP bootstrap).
// On a machine without enough GPUs every test reports skipped. NVLINK_TEST_SHARE_GPU=1 runs the multi-rank cases with
// several ranks on one GPU (rank % devices): a check of correctness only, since the ranks' contexts take turns on the
// GPU (scripts/gpu-check does this when the machine has one GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/error.hpp"
#include "gpu_cases.hpp"
#include "gpu_harness.hpp"
#include "host/fp8_cast_cases.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace {

using gputest::DeviceBuffer;
using gputest::Scenario;
using test::ScopedEnv;

#define REQUIRE_GPUS(n)                                                               \
  do {                                                                                \
    const int have_ = gputest::gpuCount();                                            \
    if (have_ == 0) GTEST_SKIP() << "no CUDA device";                                 \
    if (have_ < (n) && std::getenv("NVLINK_TEST_SHARE_GPU") == nullptr)               \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, this machine has " << have_; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

test::RunOptions options() {
  test::RunOptions o;
  o.deadlineMs = 240000;
  return o;
}

// Runs every scenario in `list` on `world` ranks (one process each); each scenario creates its own object.
void runAll(int world, const std::vector<Scenario>& list) {
  if (world == 1 && std::getenv("NVLINK_TEST_INPROCESS") != nullptr) {
    // For compute-sanitizer: no fork, one rank in this process.
    std::unique_ptr<Bootstrap> self = createSelfBootstrap();
    gputest::runScenarios(list, 0, *self, "nvlink");
    return;
  }
  gputest::runScenariosOnRanks(world, list, "nvlink", options());
}

// Every nvlink case checks the combine against the exact sum: within one final rounding of an fp32 sum (the partials
// cross in fp32; a 16-bit partial would round each expert rank's sum once more and fail wherever a token's experts
// span two ranks, an fp32 or fp16 output follows bf16 expertY, or accumulate adds to outTokens).
Scenario base(uint32_t world) {
  Scenario s;
  s.world = world;
  s.oneRounding = true;
  return s;
}

TEST(NvlinkGpu, W1Basic) {
  REQUIRE_GPUS(1);
  runAll(1, {base(1)});
}

// 512 experts: the routing tables need ~66 KB of shared memory, above the 48 KB every kernel gets without
// configureKernels raising its limit (fused and split halves, fp32 expert outputs into fp16 tokens as well).
TEST(NvlinkGpu, W1ManyExpertsNeedMoreSharedMemory) {
  REQUIRE_GPUS(1);
  Scenario s = base(1);
  s.experts = 512;
  s.topK = 8;
  s.masked = true;
  Scenario split = s;
  split.split = true;
  split.yType = DType::kF32;
  split.outType = DType::kF16;
  runAll(1, {s, split});
}

TEST(NvlinkGpu, W1MaskedRaggedBoundPackedPadded) {
  REQUIRE_GPUS(1);
  runAll(1, gputest::maskedBoundLayouts(base(1)));
}

TEST(NvlinkGpu, W2Basic) {
  REQUIRE_GPUS(2);
  runAll(2, {base(2)});
}

// The accuracy of pplx-kernels and DeepEP: fp16 and bf16 outputs within one final rounding of the exact sum, in fused,
// split and accumulating calls. K = 8 of 16 experts: nearly every token's experts span both ranks, so it takes the
// sum of two partials (every case built by base() checks the same bound).
TEST(NvlinkGpu, W2CombineIsOneRoundingOfAnFp32Sum) {
  REQUIRE_GPUS(2);
  std::vector<Scenario> list;
  uint64_t seed = 700;
  for (DType t : {DType::kF16, DType::kBf16}) {
    for (int mode = 0; mode < 3; ++mode) {
      Scenario s = base(2);
      s.topK = 8;
      s.hidden = 512;
      s.ragged = false;
      s.yType = s.outType = t;
      s.split = mode == 1;
      s.accumulate = mode == 2;
      s.rounds = 1;
      s.seed = seed++;
      list.push_back(s);
    }
  }
  runAll(2, list);
}

TEST(NvlinkGpu, W2MaskedRaggedBoundLayouts) {
  REQUIRE_GPUS(2);
  std::vector<Scenario> list;
  for (Layout layout : {Layout::kBatched, Layout::kPacked}) {
    for (uint32_t pad : {1u, 16u}) {
      Scenario s = base(2);
      s.masked = true;
      s.deviceBound = true;
      s.layout = layout;
      s.padding = pad;
      s.seed = 10 + pad;
      list.push_back(s);
    }
  }
  runAll(2, list);
}

TEST(NvlinkGpu, W2SplitAccumulate) {
  REQUIRE_GPUS(2);
  Scenario s = base(2);
  s.split = true;
  s.accumulate = true;
  s.masked = true;
  Scenario f = s;
  f.split = false;
  runAll(2, {s, f});
}

// Batches large enough for pull mode (a sender stages its tokens in its own region, receivers read them over NVLink;
// nvlink::makeGeometry: at least one 4 KiB unit per warp): 16 KB tokens, 1300 per rank (650 slots with D = 2), so
// 2600 units against 132 blocks x 16 warps. Packed with padding, D = 2, split + accumulate, masked, ragged, device
// boundM.
TEST(NvlinkGpu, W2PullLayouts) {
  REQUIRE_GPUS(2);
  std::vector<Scenario> list;
  for (int v = 0; v < 3; ++v) {
    Scenario s = base(2);
    s.maxTokens = 1300;
    s.experts = 32;
    s.topK = 6;
    s.hidden = 8192;
    s.masked = true;
    s.ragged = true;
    s.deviceBound = v != 1;
    s.layout = v == 0 ? Layout::kPacked : Layout::kBatched;
    s.padding = v == 0 ? 16 : 1;
    s.dp = v == 1 ? 2 : 1;
    s.split = v == 2;
    s.accumulate = v == 2;
    s.rounds = 2;
    s.seed = 500 + v;
    list.push_back(s);
  }
  runAll(2, list);
}

// `s` with a sender of more than one 4 KiB work unit per warp (pull mode, dynamic schedules): 1300 tokens of 7 KB.
Scenario pullSized(Scenario s) {
  s.maxTokens = 1300;
  s.experts = 32;
  s.topK = 6;
  s.hidden = 7168;
  return s;
}

// One rank fuses its calls while the other splits them, in the same rounds: the protocol does not depend on the
// peer's choice. Decode-sized tokens, and a sender with many work units (its copy signalled in parts where the
// backend does so).
TEST(NvlinkGpu, W2MixedFusedAndSplit) {
  REQUIRE_GPUS(2);
  Scenario s = base(2);
  s.splitOddRanks = true;
  s.masked = true;
  s.rounds = 3;
  Scenario wide = pullSized(s);
  wide.ragged = true;
  wide.seed = 77;
  runAll(2, {s, wide});
}

// Rounds in which no token crosses between the ranks (every index names an expert of the token's own rank): only
// the flags, counts and barriers do, and every round must still see its own data (fused, split, and one rank of
// each; push and pull mode).
TEST(NvlinkGpu, W2NothingCrossesBetweenRanks) {
  REQUIRE_GPUS(2);
  Scenario own = base(2);
  own.ownExperts = true;
  own.masked = true;
  own.rounds = 5;
  own.seed = 92;
  Scenario split = own;
  split.split = true;
  split.seed = 93;
  Scenario mixed = own;
  mixed.splitOddRanks = true;
  mixed.seed = 94;
  Scenario pull = pullSized(own);
  pull.rounds = 3;
  pull.seed = 95;
  runAll(2, {own, split, mixed, pull});
}

TEST(NvlinkGpu, W2DpGroupD2) {
  REQUIRE_GPUS(2);
  runAll(2, gputest::dpGroupsOfTwo(base(2)));
}

// SPEC's decode shape on two ranks, 128 and 64 tokens (the fused push kernel).
TEST(NvlinkGpu, W2DecodeShape) {
  REQUIRE_GPUS(2);
  Scenario s = gputest::decodeShape(base(2));
  s.ragged = false;
  Scenario lean = gputest::decodeShape(base(2));
  lean.maxTokens = 64;
  lean.masked = true;
  lean.seed = 64;
  runAll(2, {s, lean});
}

// More than 512 tokens per sender: the routing scan is shared by several blocks (each counts its chunk, they wait
// for each other on the GPU, then emit positions offset by the earlier chunks). Fused and split, masked and repeated
// experts, ragged m and device boundM (chunks may be empty), both layouts; one and two GPUs. Variant 3 has wide
// tokens (4 work units each): enough peer units that the fused kernel's own-token blocks join the peers' expansion
// (ownBlocksJoin), which decode-sized batches do not exercise.
std::vector<Scenario> routingChunks(uint32_t world) {
  std::vector<Scenario> list;
  for (int v = 0; v < 4; ++v) {
    Scenario s = base(world);
    s.maxTokens = 1300;
    s.experts = 32;
    s.topK = 6;
    s.hidden = v == 3 ? 7168 : 128;
    s.masked = true;
    s.deviceBound = v == 1 || v == 2;
    s.ragged = v == 1 || v == 2;
    s.split = v == 1;
    s.layout = v == 2 ? Layout::kPacked : Layout::kBatched;
    s.padding = v == 2 ? 8 : 1;
    s.rounds = 3;
    s.seed = 300 + v;
    list.push_back(s);
  }
  return list;
}

TEST(NvlinkGpu, W1RoutingChunks) {
  REQUIRE_GPUS(1);
  runAll(1, routingChunks(1));
}

TEST(NvlinkGpu, W2RoutingChunks) {
  REQUIRE_GPUS(2);
  runAll(2, routingChunks(2));
}

// Every payload dtype with every (expertY, outTokens) pair, on one and on two GPUs.
TEST(NvlinkGpu, W1DtypeMatrix) {
  REQUIRE_GPUS(1);
  runAll(1, gputest::dtypeMatrix(base(1)));
}

TEST(NvlinkGpu, W2DtypeMatrix) {
  REQUIRE_GPUS(2);
  runAll(2, gputest::dtypeMatrix(base(2)));
}

// Two objects (micro-batches) in flight at once on two streams, each with its own buffers and flags.
TEST(NvlinkGpu, W2TwoObjectsInFlight) {
  REQUIRE_GPUS(2);
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::twoObjectsInFlight(base(2), gputest::secondObject(base(2)), rank, bootstrap, "nvlink");
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Capture dispatch + combine once; replay 100 times with new inputs and a new *boundM each time.
void graphReplay(int world) {
  test::RunResult result = test::runRanks(
      world, [world](int rank, Bootstrap& bootstrap) { gputest::graphReplay(base(world), rank, bootstrap, "nvlink"); },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(NvlinkGpu, W1GraphReplay100) {
  REQUIRE_GPUS(1);
  graphReplay(1);
}

TEST(NvlinkGpu, W2GraphReplay100) {
  REQUIRE_GPUS(2);
  graphReplay(2);
}

// Rank 1 never enters `phase` ("dispatch": it makes no call at all; "combine": it dispatches, then stops): rank 0
// must get Error(kTimeout) naming rank 1 and the phase, within the timeout, and the object then refuses further use.
void peerNeverEnters(const std::string& phase) {
  ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "1500"}});  // read once per process, in the children
  test::RunResult result = test::runRanks(
      2,
      [&](int rank, Bootstrap& bootstrap) {
        gputest::Silence silence;
        silence.phase = phase;
        gputest::peerNeverEnters(base(2), rank, bootstrap, "nvlink", silence);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(NvlinkGpu, W2PeerNeverEntersCombineTimesOut) {
  REQUIRE_GPUS(2);
  peerNeverEnters("combine");
}

// Rank 0's receivers wait on rank 1's tagged token count and never see it.
TEST(NvlinkGpu, W2PeerNeverDispatchesTimesOut) {
  REQUIRE_GPUS(2);
  peerNeverEnters("dispatch");
}

// Failing together: in round 1 rank 1's call is refused (a bad argument) or its kernel finds a bad expert index; every
// other rank's call raises within 2 s naming rank 1 and what was wrong (with EPCOMM_TIMEOUT_MS = 10 s, not its
// timeout), and its object is then lost.
void peerFails(int world, gputest::Refusal what) {
  gputest::peerRefusesOnRanks(world, base(static_cast<uint32_t>(world)), "nvlink", what, options());
}

TEST(NvlinkGpu, W2PeerRefusesDispatchFailsTogether) {
  REQUIRE_GPUS(2);
  peerFails(2, gputest::Refusal::kDispatch);
}

TEST(NvlinkGpu, W3PeerRefusesDispatchFailsTogether) {
  REQUIRE_GPUS(3);
  peerFails(3, gputest::Refusal::kDispatch);
}

TEST(NvlinkGpu, W3PeerRefusesCombineFailsTogether) {
  REQUIRE_GPUS(3);
  peerFails(3, gputest::Refusal::kCombine);
}

TEST(NvlinkGpu, W3PeerBadIndexFailsTogether) {
  REQUIRE_GPUS(3);
  peerFails(3, gputest::Refusal::kDeviceIndex);
}

// Threads per block shape the protocol (the routing scan's tables, the work split), so ranks that would use different
// counts are refused at setup, each naming the knob and both values. Configs that differ (a batch size on either side
// of 256 tokens) are refused earlier, by the factory's config check; what is left is the knob itself set differently
// per rank: EPCOMM_NVLINK_THREADS = 256 on rank 0 and 512 on rank 1 (EPCOMM_NVLINK_BLOCKS keeps the block counts
// equal). The variables are read once per process, in the children, after each child set its own.
TEST(NvlinkGpu, W2RanksThatDisagreeOnThreadsAreRefused) {
  REQUIRE_GPUS(2);
  ScopedEnv env({{"EPCOMM_NVLINK_BLOCKS", "66"}});  // read once per process, in the children
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::useRankDevice(rank);
        setenv("EPCOMM_NVLINK_THREADS", rank == 0 ? "256" : "512", 1);
        Scenario s = base(2);
        s.maxTokens = 128;
        try {
          std::unique_ptr<AllToAll> a2a = createAllToAll(gputest::scenarioConfig(s, rank), bootstrap, "nvlink");
          ADD_FAILURE() << "rank " << rank << ": ranks with 256- and 512-thread blocks were not refused";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInvalidConfig) << e.what();
          for (const char* text : {"EPCOMM_NVLINK_THREADS", "uses 256", "uses 512"}) {
            EXPECT_NE(e.message().find(text), std::string::npos) << "no '" << text << "' in: " << e.what();
          }
        }
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Calls out of order are refused before anything is launched, and the object stays usable: combine before any
// dispatch, a receive half without its send half, a second dispatch before the combine, combine weights with fewer
// rows than the dispatch had tokens.
TEST(NvlinkGpu, W1CallsOutOfOrderAreRefused) {
  REQUIRE_GPUS(1);
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        gputest::callsOutOfOrderAreRefused(base(1), rank, bootstrap, "nvlink", true);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- The dispatch's fp8 cast (Config::dispatchCast): fused into the send half
// ----------------------------------------

// `rounds` rounds of `cc` on one nvlink object per rank (whole calls, or send and receive halves with a kernel of ours
// in between), each compared bit for bit, counts, fp8 rows and scales (rows in use or not: the outputs start zeroed),
// with the same tokens cast separately (reference::castFp8Blocks) and dispatched by the reference; a combine between
// rounds. Round 1 repeats round 0's inputs through the same buffers (the backend's cached arguments).
void castRounds(const test::CastCase& cc, uint32_t rounds, bool split) {
  test::RunResult result = test::runRanks(
      static_cast<int>(cc.W),
      [&](int rank, Bootstrap& bootstrap) {
        gputest::useRankDevice(rank);
        const Config c = cc.config(static_cast<uint32_t>(rank));
        std::unique_ptr<AllToAll> a2a = createAllToAll(c, bootstrap, "nvlink");
        int device = 0;
        CUDA_OK(cudaGetDevice(&device));
        cudaStream_t stream = nullptr;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        const int64_t T = cc.T, H = cc.H, K = cc.K;
        const int64_t rows = static_cast<int64_t>(c.totalExpertRows());
        test::CastOutputs shape(cc, static_cast<uint32_t>(rank));
        DeviceBuffer x(T * H * 2), indices(T * K * 4), counts(shape.counts.bytes()), outX(shape.x.bytes()),
            outScale(shape.scaleStorage.bytes()), y(rows * H * 2), out(T * H * 2), weights(T * K * 4);
        CUDA_OK(cudaMemset(y.get(), 0, rows * H * 2));
        CUDA_OK(cudaMemset(weights.get(), 0, T * K * 4));
        auto onDevice = [&](TensorView v, void* data) {
          v.data = data;
          v.memory = MemoryKind::kCuda;
          v.device = device;
          return v;
        };
        for (uint32_t round = 0; round < rounds; ++round) {
          const std::vector<test::CastInputs> in = test::castInputs(cc, round == 1 ? 0 : round);
          const std::vector<test::CastOutputs> want = test::separateCastReference(cc, in);
          const test::CastInputs& mine = in[rank];
          const int64_t m = mine.m;
          if (m > 0) {
            x.upload(mine.x.data<void>(), mine.x.bytes());
            indices.upload(mine.indices.data<void>(), mine.indices.bytes());
          }
          for (const DeviceBuffer* b : {&counts, &outX, &outScale}) CUDA_OK(cudaMemset(b->get(), 0, b->bytes()));
          // cudaMemset and the uploads go to the legacy default stream, which `stream` (non-blocking) does not wait
          // for: without this the zeroing can land after the dispatch's writes.
          CUDA_OK(cudaDeviceSynchronize());
          DispatchArgs d;
          d.outExpertNumTokens = onDevice(shape.counts.view(), counts.get());
          d.outExpertX = onDevice(shape.x.view(), outX.get());
          d.outExpertXScale = onDevice(shape.scales, outScale.get());
          d.x = TensorView::contiguous(x.get(), DType::kBf16, {m, H}, MemoryKind::kCuda, device);
          d.indices = TensorView::contiguous(indices.get(), DType::kI32, {m, K}, MemoryKind::kCuda, device);
          d.stream = stream;
          if (split) {
            const auto [send, recv] = gputest::halves(d);
            a2a->dispatch(send);
            CUDA_OK(cudaMemsetAsync(y.get(), 0, 256, stream));  // other work on the stream between the halves
            a2a->dispatch(recv);
          } else {
            a2a->dispatch(d);
          }
          a2a->synchronize();
          test::CastOutputs got(cc, static_cast<uint32_t>(rank));
          counts.download(got.counts.data<void>(), got.counts.bytes());
          outX.download(got.x.data<void>(), got.x.bytes());
          outScale.download(got.scaleStorage.data<void>(), got.scaleStorage.bytes());
          const std::string diff = test::compareCastOutputs(got, want[rank]);
          ASSERT_TRUE(diff.empty()) << "rank " << rank << " round " << round << " (" << c.toString() << "): " << diff;
          CombineArgs cb;
          cb.outTokens = TensorView::contiguous(out.get(), DType::kBf16, {m, H}, MemoryKind::kCuda, device);
          cb.indices = d.indices;
          cb.weights = TensorView::contiguous(weights.get(), DType::kF32, {m, K}, MemoryKind::kCuda, device);
          cb.expertY =
              cc.layout == Layout::kBatched
                  ? TensorView::contiguous(y.get(), DType::kBf16,
                                           {c.numLocalExperts(), static_cast<int64_t>(c.batchedRowsPerExpert()), H},
                                           MemoryKind::kCuda, device)
                  : TensorView::contiguous(y.get(), DType::kBf16, {rows, H}, MemoryKind::kCuda, device);
          cb.stream = stream;
          a2a->combine(cb);
          a2a->synchronize();
        }
        a2a.reset();
        cudaStreamDestroy(stream);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// One GPU: own tokens only (the fused kernel expands them straight from bf16 x, casting as it goes). Decode-sized
// tokens (7168 elements, 56 scales) and DeepEP's column-major scales; split halves with power-of-two scales, masked
// and repeated experts, packed rows; a batch of 600 tokens (two routing blocks, 512 threads per block).
TEST(NvlinkGpu, W1Fp8CastMatchesSeparateCast) {
  REQUIRE_GPUS(1);
  test::CastCase decode;
  decode.W = 1;
  decode.E = 32;
  decode.K = 8;
  decode.H = 7168;
  decode.T = 128;
  decode.columnMajorScales = true;
  decode.seed = 41;
  castRounds(decode, 3, false);
  test::CastCase split = decode;
  split.cast = DispatchCast::kFp8BlocksPow2;
  split.masked = true;
  split.layout = Layout::kPacked;
  split.padding = 8;
  split.seed = 42;
  castRounds(split, 2, true);
  test::CastCase wide;
  wide.W = 1;
  wide.E = 16;
  wide.K = 4;
  wide.H = 1024;
  wide.T = 600;
  wide.masked = true;
  wide.seed = 43;
  castRounds(wide, 2, false);
}

// Two ranks (NVLINK_TEST_SHARE_GPU=1: on one GPU): the send half casts the peers' tokens into their staging (push)
// and the own tokens into the rows. SPEC's decode shape with DeepEP's column-major scales; power-of-two scales with
// split halves, masked experts and packed rows; DP groups of 2; a batch large enough for pull mode (1300 tokens of 8192
// elements: the sender stages its cast tokens in its own region, the receivers read them over NVLink).
TEST(NvlinkGpu, W2Fp8CastMatchesSeparateCast) {
  REQUIRE_GPUS(2);
  test::CastCase decode;
  decode.W = 2;
  decode.E = 256;
  decode.K = 8;
  decode.H = 7168;
  decode.T = 128;
  decode.columnMajorScales = true;
  decode.ragged = false;
  decode.seed = 51;
  castRounds(decode, 3, false);
  test::CastCase split = decode;
  split.cast = DispatchCast::kFp8BlocksPow2;
  split.masked = true;
  split.ragged = true;
  split.layout = Layout::kPacked;
  split.padding = 4;
  split.seed = 52;
  castRounds(split, 2, true);
  test::CastCase dp;
  dp.W = 2;
  dp.D = 2;
  dp.E = 16;
  dp.K = 4;
  dp.H = 512;
  dp.T = 48;
  dp.masked = true;
  dp.seed = 53;
  castRounds(dp, 2, false);
  test::CastCase pull;
  pull.W = 2;
  pull.E = 32;
  pull.K = 6;
  pull.H = 8192;
  pull.T = 1300;
  pull.masked = true;
  pull.seed = 54;
  castRounds(pull, 2, false);
  pull.seed = 55;
  castRounds(pull, 1, true);
}

// An expert index outside [-1, E) is detected on the device and reported as kDeviceError by the next call.
// synchronize() waits for the object's own launches, not for another stream's work (gpu_cases.hpp).
TEST(NvlinkGpu, W1SynchronizeWaitsForItsOwnWork) {
  REQUIRE_GPUS(1);
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        gputest::synchronizeWaitsForItsOwnWork(base(1), rank, bootstrap, "nvlink");
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(NvlinkGpu, W1BadIndexIsDeviceError) {
  REQUIRE_GPUS(1);
  test::RunResult result = test::runRanks(
      1, [](int rank, Bootstrap& bootstrap) { gputest::badIndexIsDeviceError(base(1), rank, bootstrap, "nvlink"); },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace epcomm
