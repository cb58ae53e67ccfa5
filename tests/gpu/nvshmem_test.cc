// The nvshmem backend against the CPU reference, one process per rank (forked before any CUDA call, TCP bootstrap,
// NVSHMEM initialised from it). Rank r uses GPU r % devices, so every case runs on a machine with one GPU too: several
// PEs then share it (NVSHMEM's multi-process-per-GPU mode, whose contexts take turns on the GPU: correctness only).
// Without a GPU every test reports skipped.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/error.hpp"
#include "gpu_cases.hpp"
#include "gpu_harness.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace {

using gputest::Scenario;
using test::ScopedEnv;

#define REQUIRE_GPU()                                               \
  do {                                                              \
    if (gputest::gpuCount() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// NVSHMEM settings for one host, each applied only when the environment does not set it already: NVLink/P2P only (no
// remote transport to probe), no NVLS multicast, the unique-ID rendezvous over loopback. Set before the ranks fork.
class OneHostNvshmem {
 public:
  OneHostNvshmem() {
    for (const auto& [name, value] : {std::pair<const char*, const char*>{"NVSHMEM_REMOTE_TRANSPORT", "none"},
                                      {"NVSHMEM_DISABLE_NVLS", "1"},
                                      {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"}}) {
      if (std::getenv(name) == nullptr) {
        setenv(name, value, 1);
        set_.push_back(name);
      }
    }
  }
  ~OneHostNvshmem() {
    for (const char* name : set_) unsetenv(name);
  }
  OneHostNvshmem(const OneHostNvshmem&) = delete;
  OneHostNvshmem& operator=(const OneHostNvshmem&) = delete;

 private:
  std::vector<const char*> set_;
};

test::RunOptions options() {
  test::RunOptions o;
  o.deadlineMs = 400000;
  return o;
}

// Runs every scenario in `list` on `world` ranks (one process each); each scenario creates its own object.
void runAll(int world, const std::vector<Scenario>& list) {
  OneHostNvshmem nvshmemEnv;
  gputest::runScenariosOnRanks(world, list, "nvshmem", options());
}

// Every case checks the combine against the exact sum: within one final rounding of an fp32 sum (the partials cross in
// fp32 and each (token, piece) is summed in ascending rank order, once).
Scenario base(uint32_t world) {
  Scenario s;
  s.world = world;
  s.oneRounding = true;
  return s;
}

// One rank: basic rounds, masked and repeated experts with ragged m and a device boundM in both layouts with padding,
// every index type, split halves with accumulate; 512 experts, and 1024 (the dispatch's ranking tables, per warp and
// local expert, then need more than the default 48 KiB of shared memory).
TEST(NvshmemGpu, W1Layouts) {
  REQUIRE_GPU();
  std::vector<Scenario> list = {base(1)};
  for (const Scenario& s : gputest::maskedBoundLayouts(base(1))) list.push_back(s);
  Scenario many = base(1);
  many.experts = 512;
  many.topK = 8;
  many.masked = true;
  Scenario more = many;
  more.experts = 1024;
  more.split = true;
  more.seed = 11;
  list.push_back(many);
  list.push_back(more);
  runAll(1, list);
}

TEST(NvshmemGpu, W2Basic) {
  REQUIRE_GPU();
  runAll(2, {base(2)});
}

TEST(NvshmemGpu, W3Basic) {
  REQUIRE_GPU();
  Scenario s = base(3);
  s.experts = 24;
  s.masked = true;
  runAll(3, {s});
}

TEST(NvshmemGpu, W4Basic) {
  REQUIRE_GPU();
  Scenario s = base(4);
  s.masked = true;
  s.deviceBound = true;
  runAll(4, {s});
}

// Masked and repeated experts, ragged m, device boundM, both layouts with and without padding, on 2 and 4 ranks.
std::vector<Scenario> layouts(uint32_t world) {
  std::vector<Scenario> list;
  for (Layout layout : {Layout::kBatched, Layout::kPacked}) {
    for (uint32_t pad : {1u, 16u}) {
      Scenario s = base(world);
      s.masked = true;
      s.deviceBound = true;
      s.layout = layout;
      s.padding = pad;
      s.indexType = pad == 16 ? DType::kI64 : DType::kI32;
      s.seed = 10 + pad + world;
      list.push_back(s);
    }
  }
  return list;
}

TEST(NvshmemGpu, W2MaskedRaggedBoundLayouts) {
  REQUIRE_GPU();
  runAll(2, layouts(2));
}

TEST(NvshmemGpu, W3MaskedRaggedBoundLayouts) {
  REQUIRE_GPU();
  std::vector<Scenario> list = layouts(3);
  for (Scenario& s : list) s.experts = 24;
  runAll(3, list);
}

TEST(NvshmemGpu, W4MaskedRaggedBoundLayouts) {
  REQUIRE_GPU();
  runAll(4, layouts(4));
}

// Split halves (with our kernel between them), accumulate; one rank fusing while the other splits.
TEST(NvshmemGpu, W2SplitAccumulateMixed) {
  REQUIRE_GPU();
  Scenario s = base(2);
  s.split = true;
  s.accumulate = true;
  s.masked = true;
  Scenario mixed = base(2);
  mixed.splitOddRanks = true;
  mixed.masked = true;
  mixed.seed = 7;
  runAll(2, {s, mixed});
}

TEST(NvshmemGpu, W3SplitMixed) {
  REQUIRE_GPU();
  Scenario s = base(3);
  s.experts = 12;
  s.splitOddRanks = true;
  s.masked = true;
  s.deviceBound = true;
  runAll(3, {s});
}

// DP groups: D = 2 on 2 ranks (one group) and on 4 ranks (two groups); every rank of a group gets the combine.
TEST(NvshmemGpu, W2DpGroupD2) {
  REQUIRE_GPU();
  runAll(2, gputest::dpGroupsOfTwo(base(2)));
}

TEST(NvshmemGpu, W4DpGroupD2) {
  REQUIRE_GPU();
  Scenario s = base(4);
  s.dp = 2;
  s.masked = true;
  s.deviceBound = true;
  Scenario p = s;
  p.layout = Layout::kPacked;
  p.padding = 8;
  p.splitOddRanks = true;
  p.seed = 3;
  runAll(4, {s, p});
}

// Rounds in which no token crosses between ranks: only the signals and the barrier do.
TEST(NvshmemGpu, W2NothingCrossesBetweenRanks) {
  REQUIRE_GPU();
  Scenario own = base(2);
  own.ownExperts = true;
  own.masked = true;
  own.rounds = 5;
  Scenario split = own;
  split.split = true;
  split.seed = 93;
  runAll(2, {own, split});
}

// SPEC's decode shape: 256 experts, top-8, 128 tokens of 7168 fp8 bytes and 56 fp32 scales.
TEST(NvshmemGpu, W2DecodeShape) {
  REQUIRE_GPU();
  Scenario s = gputest::decodeShape(base(2));
  s.ragged = false;
  Scenario masked = s;
  masked.maxTokens = 64;
  masked.masked = true;
  masked.ragged = true;
  masked.seed = 64;
  runAll(2, {s, masked});
}

// More tokens than the routing block has threads (its positions carry over between chunks) and many records per
// pack-and-put block; fused and split, both layouts.
TEST(NvshmemGpu, W2ManyTokens) {
  REQUIRE_GPU();
  std::vector<Scenario> list;
  for (int v = 0; v < 3; ++v) {
    Scenario s = base(2);
    s.maxTokens = 1300;
    s.experts = 32;
    s.topK = 6;
    s.hidden = 128;
    s.masked = true;
    s.deviceBound = v != 0;
    s.split = v == 1;
    s.layout = v == 2 ? Layout::kPacked : Layout::kBatched;
    s.padding = v == 2 ? 8 : 1;
    s.dp = v == 2 ? 2 : 1;
    s.rounds = 2;
    s.seed = 300 + v;
    list.push_back(s);
  }
  runAll(2, list);
}

// Every payload dtype with every (expertY, outTokens) pair on 2 ranks; on 3 and 4 ranks every (expertY, outTokens)
// pair once, the payload dtypes in turn.
std::vector<Scenario> dtypeMatrix(uint32_t world, bool full) {
  std::vector<Scenario> list;
  const DType payloads[] = {DType::kFp8E4M3, DType::kBf16, DType::kF16, DType::kF32};
  const DType combine[] = {DType::kBf16, DType::kF16, DType::kF32};
  uint64_t seed = 100;
  for (int pi = 0; pi < 4; ++pi) {
    const DType p = payloads[pi];
    for (int pair = 0; pair < 9; ++pair) {
      if (!full && pair % 4 != pi) continue;
      Scenario s = base(world);
      s.experts = 8 * world;
      s.xType = p;
      s.scales = p == DType::kFp8E4M3;
      s.yType = combine[pair / 3];
      s.outType = combine[pair % 3];
      s.hidden = 128;
      s.rounds = 1;
      s.masked = true;
      s.seed = seed++;
      list.push_back(s);
    }
  }
  return list;
}

TEST(NvshmemGpu, W2DtypeMatrix) {
  REQUIRE_GPU();
  runAll(2, dtypeMatrix(2, true));
}

TEST(NvshmemGpu, W3DtypeMatrix) {
  REQUIRE_GPU();
  runAll(3, dtypeMatrix(3, false));
}

TEST(NvshmemGpu, W4DtypeMatrix) {
  REQUIRE_GPU();
  runAll(4, dtypeMatrix(4, false));
}

// Hidden sizes that end in a partial piece: the combine works in pieces of 512 elements, each with its own signal, the
// dispatch receive in pieces of 2 KiB. H = 1032 (fp32 payload: 258 vectors, the last piece two; the last combine
// piece 8 elements; 16-bit rows stay a multiple of 16 bytes, as the API requires) and H = 1040 (fp8 with scales);
// fused, split, D = 2, accumulate, 40 experts per token (two lanes' worth of routing entries).
std::vector<Scenario> pieces(uint32_t world) {
  std::vector<Scenario> list;
  for (int v = 0; v < 4; ++v) {
    Scenario s = base(world);
    s.experts = (v == 3 ? 32 : 16) * world;
    s.hidden = v % 2 == 0 ? 1032 : 1040;
    s.xType = v % 2 == 0 ? DType::kF32 : DType::kFp8E4M3;
    s.scales = v % 2 == 1;
    s.yType = v == 1 ? DType::kF32 : DType::kBf16;
    s.outType = v == 2 ? DType::kF16 : DType::kBf16;
    s.masked = true;
    s.deviceBound = v != 0;
    s.split = v == 1;
    s.accumulate = v == 2;
    s.dp = v == 2 && world % 2 == 0 ? 2 : 1;
    s.topK = v == 3 ? 40 : 4;
    s.layout = v == 3 ? Layout::kPacked : Layout::kBatched;
    s.padding = v == 3 ? 8 : 1;
    s.rounds = 2;
    s.seed = 400 + v;
    list.push_back(s);
  }
  return list;
}

TEST(NvshmemGpu, W2Pieces) {
  REQUIRE_GPU();
  runAll(2, pieces(2));
}

TEST(NvshmemGpu, W4Pieces) {
  REQUIRE_GPU();
  runAll(4, pieces(4));
}

// Two objects (micro-batches) in flight at once on two streams, each with its own symmetric buffers and rounds; on 4
// ranks object B's calls are split halves with the other object's calls between them.
void twoObjectsInFlight(int world) {
  OneHostNvshmem nvshmemEnv;
  test::RunResult result = test::runRanks(
      world,
      [world](int rank, Bootstrap& bootstrap) {
        Scenario sa = base(world);
        sa.experts = 4 * world;
        Scenario sb = gputest::secondObject(sa);
        sb.deviceBound = true;
        gputest::twoObjectsInFlight(sa, sb, rank, bootstrap, "nvshmem", world > 2);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(NvshmemGpu, W2TwoObjectsInFlight) {
  REQUIRE_GPU();
  twoObjectsInFlight(2);
}

TEST(NvshmemGpu, W4TwoObjectsInFlight) {
  REQUIRE_GPU();
  twoObjectsInFlight(4);
}

// Capture dispatch + combine once; replay 100 times with new inputs and a new *boundM each time. The rounds live on
// the device, so every replay waits for the peers' new data, not the first capture's. `split`: the capture holds the
// four halves as separate calls (each kernel's round counters advance on their own); `dp`: the DP group size.
void graphReplay(int world, bool split = false, uint32_t dp = 1) {
  OneHostNvshmem nvshmemEnv;
  test::RunResult result = test::runRanks(
      world,
      [world, split, dp](int rank, Bootstrap& bootstrap) {
        Scenario s = base(world);
        s.experts = 8 * world;  // a multiple of every world size
        s.dp = dp;
        s.layout = split ? Layout::kPacked : Layout::kBatched;
        s.padding = split ? 4 : 1;
        gputest::Replays replays;
        replays.splitHalves = split;
        gputest::graphReplay(s, rank, bootstrap, "nvshmem", replays);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(NvshmemGpu, W2GraphReplay100) {
  REQUIRE_GPU();
  graphReplay(2);
}

TEST(NvshmemGpu, W2GraphReplay100SplitHalves) {
  REQUIRE_GPU();
  graphReplay(2, true);
}

TEST(NvshmemGpu, W3GraphReplay100) {
  REQUIRE_GPU();
  graphReplay(3);
}

TEST(NvshmemGpu, W4GraphReplay100DpGroupD2) {
  REQUIRE_GPU();
  graphReplay(4, false, 2);
}

// The last rank never enters `phase` ("dispatch": it makes no call; "combine": it dispatches, then stops): rank 0 gets
// Error(kTimeout) naming that rank and the phase within the timeout, the object then refuses further use, the CUDA
// context stays usable, and every object is destroyed cleanly. On 3 ranks (dispatch) rank 1 times out as well: every
// dispatch-recv waits only for the senders' signals, and the one missing is the last rank's.
void peerNeverEnters(int world, const std::string& phase) {
  OneHostNvshmem nvshmemEnv;
  ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "1500"}});  // read once per process, in the children
  test::RunResult result = test::runRanks(
      world,
      [&](int rank, Bootstrap& bootstrap) {
        Scenario s = base(static_cast<uint32_t>(world));
        s.experts = 8 * static_cast<uint32_t>(world);
        gputest::Silence silence;
        silence.phase = phase;
        silence.withinMs = 1500 + 5000;
        gputest::peerNeverEnters(s, rank, bootstrap, "nvshmem", silence);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(NvshmemGpu, W2PeerNeverDispatchesTimesOut) {
  REQUIRE_GPU();
  peerNeverEnters(2, "dispatch");
}

TEST(NvshmemGpu, W3PeerNeverDispatchesTimesOut) {
  REQUIRE_GPU();
  peerNeverEnters(3, "dispatch");
}

TEST(NvshmemGpu, W2PeerNeverEntersCombineTimesOut) {
  REQUIRE_GPU();
  peerNeverEnters(2, "combine");
}

// Failing together: in round 1 rank 1's call is refused (a bad argument) or its kernel finds a bad expert index; every
// other rank's call raises within 2 s naming rank 1 and what was wrong (with EPCOMM_TIMEOUT_MS = 10 s, not its
// timeout), and its object is then lost.
void peerFails(int world, gputest::Refusal what) {
  OneHostNvshmem nvshmemEnv;
  gputest::peerRefusesOnRanks(world, base(static_cast<uint32_t>(world)), "nvshmem", what, options());
}

TEST(NvshmemGpu, W2PeerRefusesDispatchFailsTogether) {
  REQUIRE_GPU();
  peerFails(2, gputest::Refusal::kDispatch);
}

TEST(NvshmemGpu, W3PeerRefusesDispatchFailsTogether) {
  REQUIRE_GPU();
  peerFails(3, gputest::Refusal::kDispatch);
}

TEST(NvshmemGpu, W3PeerRefusesCombineFailsTogether) {
  REQUIRE_GPU();
  peerFails(3, gputest::Refusal::kCombine);
}

TEST(NvshmemGpu, W3PeerBadIndexFailsTogether) {
  REQUIRE_GPU();
  peerFails(3, gputest::Refusal::kDeviceIndex);
}

// Calls out of order are refused before anything is launched, and the object stays usable.
TEST(NvshmemGpu, W1CallsOutOfOrderAreRefused) {
  REQUIRE_GPU();
  OneHostNvshmem nvshmemEnv;
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        gputest::callsOutOfOrderAreRefused(base(1), rank, bootstrap, "nvshmem", true);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// synchronize() waits for the object's own launches, not for another stream's work (gpu_cases.hpp).
TEST(NvshmemGpu, W1SynchronizeWaitsForItsOwnWork) {
  REQUIRE_GPU();
  OneHostNvshmem nvshmemEnv;
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        gputest::synchronizeWaitsForItsOwnWork(base(1), rank, bootstrap, "nvshmem");
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// An expert index outside [-1, E) is detected on the device and reported as kDeviceError by the next call; the
// object can still be destroyed.
TEST(NvshmemGpu, W1BadIndexIsDeviceError) {
  REQUIRE_GPU();
  OneHostNvshmem nvshmemEnv;
  test::RunResult result = test::runRanks(
      1, [](int rank, Bootstrap& bootstrap) { gputest::badIndexIsDeviceError(base(1), rank, bootstrap, "nvshmem"); },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// With NVSHMEM's static heap (CUDA VMM off, so the heap cannot grow) of 128 MiB, an object that needs more is refused
// with kUnavailable naming NVSHMEM_SYMMETRIC_SIZE, and a small one in the same process still works.
TEST(NvshmemGpu, W1HeapTooSmallIsUnavailable) {
  REQUIRE_GPU();
  OneHostNvshmem nvshmemEnv;
  ScopedEnv env({{"NVSHMEM_DISABLE_CUDA_VMM", "1"}, {"NVSHMEM_SYMMETRIC_SIZE", "128M"}});
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        gputest::useRankDevice(rank);
        Scenario small = base(1);
        { auto first = createAllToAll(gputest::scenarioConfig(small, rank), bootstrap, "nvshmem"); }
        // ~3.2 GB of symmetric buffers: far beyond the heap and NVSHMEM's own extra room.
        Scenario big = base(1);
        big.maxTokens = 16384;
        big.hidden = 16384;
        big.experts = 16;
        try {
          auto a2a = createAllToAll(gputest::scenarioConfig(big, rank), bootstrap, "nvshmem");
          ADD_FAILURE() << "an object of ~3.2 GB was created on a 128 MiB heap";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
          EXPECT_NE(e.message().find("NVSHMEM_SYMMETRIC_SIZE"), std::string::npos) << e.what();
        }
        std::string err = gputest::runScenario(small, static_cast<uint32_t>(rank), bootstrap, "nvshmem");
        EXPECT_TRUE(err.empty()) << err;
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace epcomm
