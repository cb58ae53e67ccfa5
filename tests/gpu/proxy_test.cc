// The proxy backend against the CPU reference: one process per rank (forked before any CUDA call, TCP bootstrap),
// ranks on GPU rank % devices (so W = 2, 3, 4 run on one GPU), every peer over the libfabric provider of the test's
// parameter (tcp, shm) with EPCOMM_PROXY_LOCAL_SIZE=1. Without a GPU every test reports skipped; without the provider
// too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "backends/proxy/proxy_all_to_all.hpp"
#include "epcomm/error.hpp"
#include "gpu_cases.hpp"
#include "gpu_harness.hpp"
#include "proxy_cases.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace {

using gputest::DeviceTensors;
using gputest::Scenario;
using test::ScopedEnv;

test::RunOptions options() {
  test::RunOptions o;
  o.deadlineMs = 120000;
  return o;
}

Scenario base(uint32_t world) { return gputest::proxyScenario(world); }

// The fixture: the provider of the parameter, every peer over it. The variables are set before the ranks fork (epcomm
// reads them once per process, in the children).
class ProxyGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (gputest::gpuCount() == 0) GTEST_SKIP() << "no CUDA device";
    SKIP_WITHOUT(GetParam());
    env_ = std::make_unique<ScopedEnv>(std::initializer_list<std::pair<const char*, const char*>>{
        {"EPCOMM_FABRIC_PROVIDER", GetParam().c_str()}, {"EPCOMM_PROXY_LOCAL_SIZE", "1"}});
  }
  void TearDown() override { env_.reset(); }

  // Runs every scenario of `list` on `world` ranks; each scenario creates its own object through the factory.
  void runAll(int world, const std::vector<Scenario>& list) {
    gputest::runScenariosOnRanks(world, list, "proxy", options());
  }

  std::unique_ptr<ScopedEnv> env_;
};

TEST_P(ProxyGpu, W1Basic) { runAll(1, {base(1)}); }

// W = 2, 3, 4 ranks: masked and repeated experts, ragged m, a device boundM, both layouts with padding.
TEST_P(ProxyGpu, Worlds234MaskedRaggedBoundLayouts) {
  for (uint32_t world : {2u, 3u, 4u}) runAll(static_cast<int>(world), gputest::maskedLayouts(world));
}

// DP groups of 2: each token is sent once per group (by rank t % D of it) and every rank of the group gets the sum.
TEST_P(ProxyGpu, DpGroupD2) {
  Scenario s = base(2);
  s.dp = 2;
  s.masked = true;
  s.deviceBound = true;
  Scenario p = base(4);
  p.dp = 2;
  p.layout = Layout::kPacked;
  p.padding = 4;
  p.split = true;
  p.masked = true;
  runAll(2, {s});
  runAll(4, {p});
}

// Send and receive halves as separate calls with other work between them (all ranks, then only the odd ones), and
// accumulate.
TEST_P(ProxyGpu, SplitHalvesAndAccumulate) {
  Scenario s = base(2);
  s.split = true;
  s.accumulate = true;
  s.masked = true;
  Scenario mixed = base(3);
  mixed.splitOddRanks = true;
  mixed.masked = true;
  mixed.seed = 7;
  runAll(2, {s});
  runAll(3, {mixed});
}

// Every payload dtype with every (expertY, outTokens) pair.
TEST_P(ProxyGpu, DtypeMatrix) { runAll(2, gputest::dtypeMatrix(base(2))); }

// A private area of 2 tokens: most rounds also take the overflow path (one bulk write per peer).
TEST_P(ProxyGpu, OverflowPath) {
  ScopedEnv priv({{"EPCOMM_PRIVATE_TOKENS", "2"}});
  Scenario s = base(3);
  s.masked = true;
  s.ragged = true;
  s.deviceBound = true;
  Scenario p = base(2);
  p.layout = Layout::kPacked;
  p.padding = 8;
  p.dp = 2;
  p.seed = 44;
  runAll(3, {s});
  runAll(2, {p});
}

// Beyond the kernels' fast paths: E > 384 (the route kernel's counts in the scratch, not shared memory) with K > 32
// (the first expert of each owner found by looking back, not by a warp match) on three ranks; tables over 32 KiB
// (E = 4096 on two ranks: the rank kernel reads them from host memory where it uses them).
TEST_P(ProxyGpu, LargeExpertCountsAndTopK) {
  Scenario wide = base(3);
  wide.experts = 1032;
  wide.topK = 40;
  wide.masked = true;
  Scenario big = base(2);
  big.experts = 4096;
  big.layout = Layout::kPacked;
  big.masked = true;
  big.seed = 9;
  runAll(3, {wide});
  runAll(2, {big});
}

// SPEC's decode shape on two ranks: 256 experts, top-8, 128 tokens of 7168 fp8 bytes and 56 fp32 scales.
TEST_P(ProxyGpu, DecodeShape) {
  Scenario s = gputest::decodeShape(base(2));
  s.ragged = false;
  runAll(2, {s});
}

// EPCOMM_PROXY_TRACE=1: every round's phases are stamped (kernels into host-mapped memory, the proxy thread on the
// host) and summarised at destruction; the rounds still match the reference. EPCOMM_PROXY_TRACE_FILE: each rank
// writes its rounds' stamps, one JSON line per round, every phase stamped and in order on the host clock.
TEST_P(ProxyGpu, TraceOn) {
  char dir[] = "/tmp/epcomm-trace-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string prefix = std::string(dir) + "/t";
  ScopedEnv trace({{"EPCOMM_PROXY_TRACE", "1"}, {"EPCOMM_PROXY_TRACE_FILE", prefix.c_str()}});
  Scenario s = base(2);
  s.masked = true;
  s.rounds = 4;
  runAll(2, {s});
  for (int rank = 0; rank < 2; ++rank) {
    const std::string path = prefix + ".rank" + std::to_string(rank) + ".jsonl";
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << path;
    std::string line;
    int rounds = 0;
    while (std::getline(in, line)) {
      ++rounds;
      // The stamps of one round in the order the round takes them: each after the one before.
      long long last = 0;
      for (const char* name :
           {"packStart",    "routeEnd",    "packEntered", "packReady",   "proxySeen", "proxyPosting", "proxyPosted",
            "proxyArrived", "unpackStart", "rankEnd",     "copyEntered", "unpackEnd", "combStart",    "combReady",
            "combSeen",     "combPosting", "combPosted",  "combArrived", "sumStart",  "sumEnd"}) {
        const std::string key = std::string("\"") + name + "\":";
        const size_t at = line.find(key);
        ASSERT_NE(at, std::string::npos) << name << " in " << line;
        const long long v = std::stoll(line.substr(at + key.size()));
        EXPECT_GT(v, 0) << name << " in " << line;
        // Across the two clocks a stamp may precede the one before by the clock check's error (well under 50 us).
        EXPECT_GT(v, last - 50000) << name << " in " << line;
        last = v;
      }
      EXPECT_NE(line.find("\"rank\":" + std::to_string(rank)), std::string::npos) << line;
    }
    EXPECT_GE(rounds, 4) << path;
    std::remove(path.c_str());
  }
  rmdir(dir);
}

// Fabric counters of the object: one head write and one combine write per peer per round; bulk writes only when the
// private area overflows.
TEST_P(ProxyGpu, OneHeadAndOneCombineWritePerPeerPerRound) {
  test::RunResult result = test::runRanks(
      3,
      [](int rank, Bootstrap& bootstrap) {
        gputest::useRankDevice(rank);
        Scenario s = base(3);
        s.masked = true;
        gpuproxy::ProxyAllToAll a2a(gputest::scenarioConfig(s, rank), bootstrap);
        EXPECT_NE(a2a.memoryPath().find("staging"), std::string::npos) << a2a.memoryPath();
        DeviceTensors dev;
        gputest::allocateDevice(s, rank, dev);
        const int rounds = 4;
        ASSERT_NO_FATAL_FAILURE(gputest::checkedRounds(a2a, s, rank, dev, rounds, 70));
        const proxy::ChannelStats st = a2a.stats();
        gputest::expectControlPerRound(st, 3, rank, rounds);
        for (int p = 0; p < 3; ++p) {
          if (p == rank) continue;
          EXPECT_EQ(st.peers[p].barrierImms, 0u) << "peer " << p;
        }
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Two objects (micro-batches) in flight at once on two streams, each with its own channel and proxy thread.
TEST_P(ProxyGpu, TwoObjectsInFlight) {
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::twoObjectsInFlight(base(2), gputest::secondObject(base(2)), rank, bootstrap, "proxy");
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Capture dispatch + combine once; replay 100 times with new inputs and a new *boundM each time: the proxy thread
// serves every replay on its own (no host call), following the device's round counters.
TEST_P(ProxyGpu, GraphReplay100) {
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::Replays replays;
        replays.repeatFirst = true;  // replays 0 and 1 repeat the same inputs: their outputs must be bitwise equal
        gputest::graphReplay(base(2), rank, bootstrap, "proxy", replays);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Rank 1 never dispatches: rank 0 gets Error(kTimeout) naming rank 1 and the dispatch, within the timeout, and the
// object then refuses further use while the process stays usable.
TEST_P(ProxyGpu, PeerThatNeverDispatchesTimesOut) {
  ScopedEnv timeout({{"EPCOMM_TIMEOUT_MS", "1500"}});
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::Silence silence;
        silence.names = "rank ";
        gputest::peerNeverEnters(base(2), rank, bootstrap, "proxy", silence);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Failing together: in round 1 rank 1's call is refused (a bad argument) or its kernel finds a bad expert index; every
// other rank's call raises within 2 s naming rank 1 and what was wrong (with EPCOMM_TIMEOUT_MS = 10 s, not its timeout:
// rank 1's proxy thread sends a notice, the peers' proxy threads end their exchange and raise the mailbox's abort
// word), and its object is then lost.
void peerFails(int world, gputest::Refusal what) {
  gputest::peerRefusesOnRanks(world, base(static_cast<uint32_t>(world)), "proxy", what, options());
}

TEST_P(ProxyGpu, W2PeerRefusesDispatchFailsTogether) { peerFails(2, gputest::Refusal::kDispatch); }
TEST_P(ProxyGpu, W3PeerRefusesDispatchFailsTogether) { peerFails(3, gputest::Refusal::kDispatch); }
TEST_P(ProxyGpu, W3PeerRefusesCombineFailsTogether) { peerFails(3, gputest::Refusal::kCombine); }
TEST_P(ProxyGpu, W3PeerBadIndexFailsTogether) { peerFails(3, gputest::Refusal::kDeviceIndex); }

// Rank 2 dies (SIGKILL) after its dispatch send half, mid-round: the survivors raise an error naming it (its silence,
// kTimeout, or the engine's failed transfer to it, kFabric) within a few timeouts, and stay usable for a clean
// shutdown.
TEST_P(ProxyGpu, PeerKilledMidRoundIsNamed) {
  ScopedEnv timeout({{"EPCOMM_TIMEOUT_MS", "2000"}});
  test::RunResult result = test::runRanks(
      3, [](int rank, Bootstrap& bootstrap) { gputest::peerKilledMidRound(base(3), rank, bootstrap); }, options());
  gputest::expectRank2Killed(result, 3);
}

// Calls out of order are refused before anything is launched, and the object stays usable.
TEST_P(ProxyGpu, CallsOutOfOrderAreRefused) {
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        gputest::callsOutOfOrderAreRefused(base(1), rank, bootstrap, "proxy", false);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// synchronize() waits for the object's own launches, not for another stream's work (gpu_cases.hpp).
TEST_P(ProxyGpu, W1SynchronizeWaitsForItsOwnWork) {
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) { gputest::synchronizeWaitsForItsOwnWork(base(1), rank, bootstrap, "proxy"); },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// An expert index outside [-1, E) is detected by the dispatch kernel (the entry is skipped, the round completes on
// every rank) and reported as kDeviceError naming the token and the index by the next call.
TEST_P(ProxyGpu, BadIndexIsDeviceError) {
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        ASSERT_NO_FATAL_FAILURE(gputest::badIndexIsDeviceError(base(2), rank, bootstrap, "proxy"));
        bootstrap.barrier();
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Providers, ProxyGpu, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace epcomm
