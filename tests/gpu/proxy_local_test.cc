// The proxy backend's same-node path against the CPU reference: one process per rank (forked before any CUDA call,
// TCP bootstrap), ranks on GPU rank % devices (so W = 2, 3, 4 share one GPU), EPCOMM_PROXY_LOCAL_SIZE = W (every peer
// on the node: entries and combine rows over NVLink through CUDA IPC, heads and immediates over the fabric) and = 2
// with W = 4 (two "nodes" of two ranks: node peers over NVLink, the others over the fabric), with the control (and the
// other node's bulk) over the libfabric provider of the test's parameter (tcp, shm). Without a GPU every GPU test
// reports skipped; without the provider too. The choice of ranks per node, and the channel's per-peer mark that keeps
// node peers' bulk off the fabric, are checked without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/proxy/proxy_all_to_all.hpp"
#include "backends/proxy/proxy_local.hpp"
#include "epcomm/error.hpp"
#include "gpu_cases.hpp"
#include "gpu_harness.hpp"
#include "proxy/proxy_channel.hpp"
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
  o.deadlineMs = 180000;
  return o;
}

Scenario base(uint32_t world) { return gputest::proxyScenario(world); }

// ---- Ranks per node (no GPU) -------------------------------------------------------------------------------------

TEST(ProxyLocalSize, FromTheVariableOrTheHostNames) {
  using gpuproxy::chooseLocalSize;
  std::string note;
  const std::vector<std::string> one(4, "a"), two = {"a", "a", "b", "b"}, mixed = {"a", "b", "a", "b"},
                                              uneven = {"a", "a", "a", "b"};
  EXPECT_EQ(chooseLocalSize(0, one, &note), 4u);
  EXPECT_EQ(chooseLocalSize(0, two, &note), 2u);
  EXPECT_EQ(chooseLocalSize(0, {"a"}, &note), 1u);
  EXPECT_TRUE(note.empty()) << note;
  // Hosts not in blocks of consecutive ranks of one size: every peer over the fabric, and the note says why.
  EXPECT_EQ(chooseLocalSize(0, mixed, &note), 1u);
  EXPECT_NE(note.find("not grouped"), std::string::npos) << note;
  note.clear();
  EXPECT_EQ(chooseLocalSize(0, uneven, &note), 1u);
  EXPECT_FALSE(note.empty());
  // The variable: 1 is every peer over the fabric; a size must divide the world and each block share a host.
  EXPECT_EQ(chooseLocalSize(1, one, &note), 1u);
  EXPECT_EQ(chooseLocalSize(2, one, &note), 2u);
  EXPECT_EQ(chooseLocalSize(2, two, &note), 2u);
  EXPECT_EQ(chooseLocalSize(4, one, &note), 4u);
  auto refused = [&](int64_t wanted, const std::vector<std::string>& hosts, const char* text) {
    try {
      chooseLocalSize(wanted, hosts, &note);
      ADD_FAILURE() << "EPCOMM_PROXY_LOCAL_SIZE = " << wanted << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidConfig) << e.what();
      EXPECT_NE(e.message().find(text), std::string::npos) << e.what();
    }
  };
  refused(3, one, "divide worldSize");
  refused(8, one, "divide worldSize");
  refused(-1, one, "divide worldSize");
  refused(4, two, "rank 2 on 'b'");
  refused(2, mixed, "rank 1 on 'b'");
}

// ---- The channel's per-peer mark (no GPU) --------------------------------------------------------------------------

// Two ranks over the parameter's provider fill their send slots (heads of 5 entries per peer, 2 private, so 3 overflow)
// and combine rows, and run one round with ChannelOptions::bulkOverFabric empty (every peer's bulk over the fabric)
// and all false (the peer reached another way): marked, a peer gets the head alone (no private tokens, no bulk write)
// and a combine immediate without rows, and nothing of its entries or rows lands; unmarked, everything lands.
class ChannelMark : public ::testing::TestWithParam<std::string> {};

TEST_P(ChannelMark, MarkedPeersGetHeadsAndImmediatesOnly) {
  SKIP_WITHOUT(GetParam());
  ScopedEnv env({{"EPCOMM_FABRIC_PROVIDER", GetParam().c_str()}});
  for (bool marked : {false, true}) {
    test::RunResult result = test::runRanks(
        2,
        [&](int rank, Bootstrap& bootstrap) {
          Config c;
          c.maxNumTokens = 8;
          c.numExperts = 4;
          c.expertsPerToken = 2;
          c.worldSize = 2;
          c.rank = static_cast<uint32_t>(rank);
          c.hiddenDim = 16;
          c.hiddenDimBytes = 32;
          c.hiddenDimScaleBytes = 8;
          c.layout = Layout::kPacked;
          proxy::ChannelOptions o;
          o.privateTokens = 2;
          if (marked) o.bulkOverFabric = {false, false};
          proxy::ProxyChannel ch(c, bootstrap, o);
          const proxy::ProtocolSizes& s = ch.sizes();
          const uint32_t peer = 1 - static_cast<uint32_t>(rank), entries = 5;
          for (uint32_t p = 0; p < 2; ++p) {
            uint8_t* slot = ch.sendSlot(p);
            for (uint32_t e = 0; e < 4; ++e) proxy::headExpertCounts(slot)[e] = 1;
            for (uint32_t q = 0; q < 2; ++q) proxy::headEntryCounts(slot, 4)[q] = entries;
            for (uint32_t j = 0; j < entries; ++j)
              slot[s.headBytes + j * s.entryBytes] = static_cast<uint8_t>(16 * (rank + 1) + j);
          }
          ch.postDispatch();
          ch.waitDispatch();
          for (uint32_t j = 0; j < entries; ++j) {
            EXPECT_EQ(ch.entry(peer, j)[0], marked ? 0 : 16 * (peer + 1) + j) << "entry " << j << ", marked " << marked;
          }
          const uint64_t rowBytes = 2ull * c.hiddenDim;
          ch.combineSendBufferFor(rowBytes);
          const uint64_t rows = ch.layout().combineRows(static_cast<uint32_t>(rank), peer);  // each expert's one row
          ASSERT_EQ(rows, 2u);
          std::memset(ch.combineSendRows(peer, rowBytes), rank + 1, rows * rowBytes);
          ch.postCombine(DType::kBf16);
          ch.waitCombine();
          EXPECT_EQ(ch.combineRows(peer, rowBytes)[0], marked ? 0 : peer + 1) << "marked " << marked;
          const proxy::PeerOps ops = ch.stats().peers[peer];
          EXPECT_EQ(ops.headWrites, 1u);
          EXPECT_EQ(ops.combineWrites, 1u);
          EXPECT_EQ(ops.bulkWrites, marked ? 0u : 1u);
          EXPECT_EQ(ops.bytes, marked ? s.headBytes : s.headBytes + entries * s.entryBytes + rows * rowBytes);
        },
        options());
    EXPECT_TRUE(result.allOk()) << "marked " << marked << ": " << result.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, ChannelMark, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

// ---- On the GPU --------------------------------------------------------------------------------------------------

// The fixture: the provider of the parameter for the control and the other node's peers. EPCOMM_PROXY_LOCAL_SIZE is
// set per run, before the ranks fork (epcomm reads the variables in the children).
class ProxyLocalGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (gputest::gpuCount() == 0) GTEST_SKIP() << "no CUDA device";
    SKIP_WITHOUT(GetParam());
    env_ = std::make_unique<ScopedEnv>(
        std::initializer_list<std::pair<const char*, const char*>>{{"EPCOMM_FABRIC_PROVIDER", GetParam().c_str()}});
  }
  void TearDown() override { env_.reset(); }

  // Runs every scenario of `list` on `world` ranks, `localSize` ranks per node; each scenario creates its own object
  // through the factory.
  void runAll(int world, int localSize, const std::vector<Scenario>& list) {
    const std::string ls = std::to_string(localSize);
    ScopedEnv local({{"EPCOMM_PROXY_LOCAL_SIZE", ls.c_str()}});
    gputest::runScenariosOnRanks(world, list, "proxy", options(),
                                 "W = " + std::to_string(world) + ", local size " + ls);
  }

  std::unique_ptr<ScopedEnv> env_;
};

// Masked and repeated experts, ragged m, a device boundM, both layouts with padding and three index dtypes.
std::vector<Scenario> layoutsFor(uint32_t world) {
  std::vector<Scenario> list = gputest::maskedLayouts(world);
  Scenario own = base(world);  // every token to its own rank's experts: nothing crosses
  own.ownExperts = true;
  own.seed = 300 + world;
  list.push_back(own);
  return list;
}

// Every peer on the node: W = 2, 3, 4.
TEST_P(ProxyLocalGpu, AllLocalWorlds234) {
  for (int world : {2, 3, 4}) runAll(world, world, layoutsFor(static_cast<uint32_t>(world)));
}

// Two nodes of two ranks: node peers over NVLink, the other node over the fabric, in one round.
TEST_P(ProxyLocalGpu, TwoNodesOfTwo) { runAll(4, 2, layoutsFor(4)); }

// DP groups within a node (D = 2, local size 2 and 4) and across the nodes (D = 4, local size 2: a group's rows go to
// its node peers' regions and to the send buffer for the others).
TEST_P(ProxyLocalGpu, DpGroups) {
  Scenario d2 = base(4);
  d2.dp = 2;
  d2.masked = true;
  d2.deviceBound = true;
  Scenario d4 = base(4);
  d4.dp = 4;
  d4.layout = Layout::kPacked;
  d4.padding = 4;
  d4.masked = true;
  d4.seed = 21;
  Scenario d2split = d2;
  d2split.split = true;
  d2split.seed = 22;
  runAll(4, 2, {d2, d4, d2split});
  runAll(4, 4, {d2, d4});
  Scenario w2 = base(2);
  w2.dp = 2;
  w2.masked = true;
  runAll(2, 2, {w2});
}

// Send and receive halves as separate calls with other work between them (all ranks, then only the odd ones), and
// accumulate.
TEST_P(ProxyLocalGpu, SplitHalvesAndAccumulate) {
  Scenario s = base(2);
  s.split = true;
  s.accumulate = true;
  s.masked = true;
  Scenario mixed = base(3);
  mixed.splitOddRanks = true;
  mixed.masked = true;
  mixed.seed = 7;
  Scenario four = base(4);
  four.splitOddRanks = true;
  four.accumulate = true;
  four.masked = true;
  four.seed = 8;
  runAll(2, 2, {s});
  runAll(3, 3, {mixed});
  runAll(4, 2, {four});
}

// Every payload dtype with every (expertY, outTokens) pair, all local; a few over two nodes.
TEST_P(ProxyLocalGpu, DtypeMatrix) {
  const std::vector<Scenario> all = gputest::dtypeMatrix(base(2));
  std::vector<Scenario> some;
  for (const Scenario& s : all) {
    if (s.yType == s.outType) {
      Scenario f = s;
      f.world = 4;
      f.experts = 16;
      some.push_back(f);
    }
  }
  runAll(2, 2, all);
  runAll(4, 2, some);
}

// A private area of 2 tokens: the fabric peers' tokens overflow (one bulk write per peer), the node peers' do not
// travel over the fabric at all; SPEC's decode shape on two ranks.
TEST_P(ProxyLocalGpu, OverflowAndDecodeShape) {
  {
    ScopedEnv priv({{"EPCOMM_PRIVATE_TOKENS", "2"}});
    Scenario s = base(4);
    s.masked = true;
    s.ragged = true;
    s.deviceBound = true;
    Scenario t = s;
    t.world = 3;
    t.experts = 12;
    t.layout = Layout::kPacked;
    t.padding = 8;
    t.seed = 44;
    runAll(4, 2, {s});
    runAll(3, 3, {t});
  }
  Scenario d = gputest::decodeShape(base(2));
  d.ragged = false;
  runAll(2, 2, {d});
}

// Fabric counters with two nodes of two: every peer gets one head write and one combine write per round (the control);
// a node peer's carry no entries and no rows (the head alone, a combine immediate alone) and it never gets a bulk
// write, even when the private area overflows. The memory path names the NVLink peers.
TEST_P(ProxyLocalGpu, NodePeersGetControlOnly) {
  ScopedEnv local({{"EPCOMM_PROXY_LOCAL_SIZE", "2"}, {"EPCOMM_PRIVATE_TOKENS", "2"}});
  test::RunResult result = test::runRanks(
      4,
      [](int rank, Bootstrap& bootstrap) {
        gputest::useRankDevice(rank);
        Scenario s = base(4);
        s.masked = true;
        s.ragged = false;
        gpuproxy::ProxyAllToAll a2a(gputest::scenarioConfig(s, rank), bootstrap);
        EXPECT_NE(a2a.memoryPath().find("NVLink"), std::string::npos) << a2a.memoryPath();
        DeviceTensors dev;
        gputest::allocateDevice(s, rank, dev);
        const int rounds = 4;
        ASSERT_NO_FATAL_FAILURE(gputest::checkedRounds(a2a, s, rank, dev, rounds, 70));
        const proxy::ChannelStats st = a2a.stats();
        const uint64_t head = a2a.sizes().headBytes;
        gputest::expectControlPerRound(st, 4, rank, rounds);
        uint64_t fabricBulk = 0;
        for (int p = 0; p < 4; ++p) {
          if (p == rank) continue;
          if (p / 2 == rank / 2) {
            EXPECT_EQ(st.peers[p].bulkWrites, 0u) << "node peer " << p;
            EXPECT_EQ(st.peers[p].bytes, rounds * head) << "node peer " << p << ": only its heads";
          } else {
            EXPECT_GT(st.peers[p].bytes, rounds * head) << "peer " << p << " of the other node";
            fabricBulk += st.peers[p].bulkWrites;
          }
        }
        // 24 tokens of 4 experts each among 16: with 2 private tokens some rounds overflow towards the other node.
        EXPECT_GT(fabricBulk, 0u);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Two objects in flight at once on two streams, each with its own regions, channel and proxy thread.
TEST_P(ProxyLocalGpu, TwoObjectsInFlight) {
  ScopedEnv local({{"EPCOMM_PROXY_LOCAL_SIZE", "2"}});
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::twoObjectsInFlight(base(2), gputest::secondObject(base(2)), rank, bootstrap, "proxy");
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Capture dispatch + combine once, replay with new inputs and a new *boundM each time: the node peers' flags are round
// numbers the device keeps, so replays need no host work (W = 2 all local, 100 replays; W = 4 on two nodes, 30).
TEST_P(ProxyLocalGpu, GraphReplay) {
  for (int world : {2, 4}) {
    const int replays = world == 2 ? 100 : 30;
    ScopedEnv local({{"EPCOMM_PROXY_LOCAL_SIZE", "2"}});
    test::RunResult result = test::runRanks(
        world,
        [&](int rank, Bootstrap& bootstrap) {
          gputest::Replays r;
          r.count = replays;
          r.repeatFirst = true;  // replays 0 and 1 repeat the same inputs: their outputs must be bitwise equal
          r.what = "W = " + std::to_string(world);
          gputest::graphReplay(base(static_cast<uint32_t>(world)), rank, bootstrap, "proxy", r);
        },
        options());
    EXPECT_TRUE(result.allOk()) << "W = " << world << ": " << result.summary();
  }
}

// Rank 1 never dispatches: rank 0 (its node peer) gets Error(kTimeout) naming rank 1 and the dispatch within the
// timeout (the channel still waits for every peer's head), and the object then refuses further use.
TEST_P(ProxyLocalGpu, NodePeerThatNeverDispatchesTimesOut) {
  ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "1500"}, {"EPCOMM_PROXY_LOCAL_SIZE", "2"}});
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::Silence silence;
        silence.names = "rank ";
        silence.contextUsable = false;
        silence.who = "a node peer";
        gputest::peerNeverEnters(base(2), rank, bootstrap, "proxy", silence);
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Rank 2 dies (SIGKILL) after its dispatch send half, mid-round: all local at W = 3, and on two nodes of two at W = 4
// (rank 3 its node peer, ranks 0 and 1 over the fabric). The survivors raise an error naming it within a few
// timeouts, and destroy their objects (the teardown's barriers fail without rank 2 and are skipped).
TEST_P(ProxyLocalGpu, PeerKilledMidRoundIsNamed) {
  for (int world : {3, 4}) {
    const std::string ls = world == 3 ? "3" : "2";
    ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}, {"EPCOMM_PROXY_LOCAL_SIZE", ls.c_str()}});
    test::RunResult result = test::runRanks(
        world,
        [&](int rank, Bootstrap& bootstrap) {
          gputest::peerKilledMidRound(base(static_cast<uint32_t>(world)), rank, bootstrap);
        },
        options());
    ASSERT_NO_FATAL_FAILURE(gputest::expectRank2Killed(result, world, "W = " + std::to_string(world)));
  }
}

// Ranks that disagree on the ranks per node are refused at creation, on every rank, naming the setting.
TEST_P(ProxyLocalGpu, RanksDisagreeingOnTheLocalSizeAreRefused) {
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        gputest::useRankDevice(rank);
        setenv("EPCOMM_PROXY_LOCAL_SIZE", rank == 0 ? "2" : "1", 1);  // read at creation
        try {
          auto a2a = createAllToAll(gputest::scenarioConfig(base(2), rank), bootstrap, "proxy");
          ADD_FAILURE() << "created with local sizes 2 and 1";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInvalidConfig) << e.what();
          EXPECT_NE(e.message().find("EPCOMM_PROXY_LOCAL_SIZE"), std::string::npos) << e.what();
        }
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Providers, ProxyLocalGpu, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace epcomm
