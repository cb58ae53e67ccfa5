// Elastic ranks on a proxy channel driven as the GPU proxy backend drives it (ChannelOptions::externalDriver: the
// caller's thread runs every exchange and the agreement), without a GPU: a rank killed (SIGKILL) before its dispatch
// makes the survivors' exchange throw a round lost to a peer (takeLostRound) while the channel goes on with the agreed
// mask, and the next rounds run without the dead rank; setActiveRanks runs its agreement on the calling thread. The
// round tables of the GPU backend (gpuproxy::writeTables, where that backend is built) carry the mask its kernels
// read. Over tcp and shm.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "channel_cases.hpp"
#include "epcomm/error.hpp"
#include "host_harness.hpp"
#include "proxy/protocol.hpp"
#include "proxy/proxy_channel.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"
#ifdef EPCOMM_HAVE_PROXY_BACKEND
#include "backends/proxy/proxy_args.hpp"
#endif

namespace epcomm {
namespace test {
namespace {

constexpr int64_t kTimeoutMs = 2000;
constexpr uint32_t kWorld = 3;

proxy::ChannelOptions channelOptions(const std::string& provider, int elastic) {
  proxy::ChannelOptions o;
  o.provider = provider;
  o.timeoutMs = kTimeoutMs;
  o.bulkOverFabric.assign(kWorld, false);  // heads and immediates only: no entries to pack
  o.externalDriver = true;
  o.fixedCombineSend = true;
  o.elastic = elastic;
  return o;
}

std::vector<uint8_t> allBut(uint32_t masked) {
  std::vector<uint8_t> m(kWorld, 1);
  m[masked] = 0;
  return m;
}

// One round on the calling thread; checks its layout against `active`.
void round(proxy::ProxyChannel& ch, uint32_t rank, const std::vector<uint8_t>& active, uint32_t tokens) {
  packHeads(ch, tokens);
  ch.exchangeDispatch();
  const proxy::RoundLayout& lay = ch.layout();
  for (uint32_t s = 0; s < kWorld; ++s) {
    EXPECT_EQ(lay.isActive(s), active[s] != 0) << "rank " << s;
    EXPECT_EQ(lay.entries(s, rank), active[s] ? tokens : 0u) << "sender " << s;
  }
  for (uint32_t le = 0; le < ch.sizes().numLocalExperts; ++le) {
    uint32_t senders = 0;
    for (uint32_t s = 0; s < kWorld; ++s) senders += active[s];
    EXPECT_EQ(lay.localExpertRows(le), le == 0 ? static_cast<uint64_t>(senders) * tokens : 0u);
  }
#ifdef EPCOMM_HAVE_PROXY_BACKEND
  // The GPU backend's tables: the mask its route and combine kernels read.
  const gpuproxy::TableGeometry tg = gpuproxy::tableGeometry(ch.sizes());
  std::vector<uint32_t> tables(tg.words, 0xdeadbeefu);
  gpuproxy::writeTables(lay, tg, rank, false, tables.data());
  uint32_t masked = 0;
  for (uint32_t r = 0; r < kWorld; ++r) {
    EXPECT_EQ(tables[tg.offMasked + 1 + r], active[r] ? 0u : 1u) << "rank " << r;
    masked += active[r] ? 0 : 1;
  }
  EXPECT_EQ(tables[tg.offMasked], masked);
#endif
  ch.exchangeCombine(DType::kBf16);
}

class ChannelElastic : public ::testing::TestWithParam<std::string> {};

// Rank 2 dies before its dispatch of round 2: the survivors' exchange of that round throws, the channel is not
// broken, and 20 more rounds run under the mask.
TEST_P(ChannelElastic, ExternalDriverGoesOnWithoutADeadRank) {
  const std::string provider = GetParam();
  SKIP_WITHOUT(provider);
  constexpr uint32_t kVictim = 2;
  RunOptions ro;
  ro.deadlineMs = 60000;
  RunResult result = runRanks(
      kWorld,
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        proxy::ProxyChannel ch(channelConfig(kWorld, rank), bootstrap, channelOptions(provider, 1));
        ASSERT_TRUE(ch.elastic());
        const std::vector<uint8_t> all(kWorld, 1);
        for (uint32_t i = 0; i < 2; ++i) round(ch, rank, all, 3 + i);
        bootstrap.barrier();
        if (rank == kVictim) raise(SIGKILL);
        packHeads(ch, 5);
        try {
          ch.exchangeDispatch();
          ADD_FAILURE() << "the dispatch completed without rank " << kVictim;
        } catch (const Error& e) {
          EXPECT_TRUE(ch.takeLostRound()) << e.what();
          EXPECT_FALSE(ch.takeLostRound()) << "reported once";
          EXPECT_NE(e.message().find("without rank 2"), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("the object goes on"), std::string::npos) << e.what();
        }
        EXPECT_NO_THROW(ch.rethrowIfBroken());
        EXPECT_EQ(ch.activeRanks(), allBut(kVictim));
        for (uint32_t i = 0; i < 20; ++i) round(ch, rank, allBut(kVictim), 1 + i % 4);
      },
      ro);
  ASSERT_EQ(result.ranks.size(), kWorld);
  EXPECT_EQ(result.ranks[kVictim].signal, SIGKILL) << result.summary();
  for (uint32_t r = 0; r < kVictim; ++r) EXPECT_TRUE(result.ranks[r].ok()) << result.summary();
}

// setActiveRanks on a channel without its own proxy thread: the agreement runs on the calling thread; the rank it
// masks leaves, the others go on (with and without EPCOMM_ELASTIC's behaviour).
TEST_P(ChannelElastic, SetActiveRanksRunsOnTheCallingThread) {
  const std::string provider = GetParam();
  SKIP_WITHOUT(provider);
  for (int elastic = 0; elastic <= 1; ++elastic) {
    RunOptions ro;
    ro.deadlineMs = 60000;
    RunResult result = runRanks(
        kWorld,
        [&](int r, Bootstrap& bootstrap) {
          const uint32_t rank = static_cast<uint32_t>(r);
          proxy::ProxyChannel ch(channelConfig(kWorld, rank), bootstrap, channelOptions(provider, elastic));
          const std::vector<uint8_t> all(kWorld, 1);
          for (uint32_t i = 0; i < 2; ++i) round(ch, rank, all, 2);
          EXPECT_THROW(ch.setActiveRanks({1, 1}), Error);  // refused before anything is sent; the channel goes on
          ch.setActiveRanks(allBut(1));
          EXPECT_EQ(ch.activeRanks(), allBut(1));
          if (rank == 1) {
            EXPECT_THROW(ch.exchangeDispatch(), Error) << "the rank that left went on";
            return;
          }
          for (uint32_t i = 0; i < 10; ++i) round(ch, rank, allBut(1), 1 + i % 3);
        },
        ro);
    EXPECT_TRUE(result.allOk()) << "elastic " << elastic << ": " << result.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, ChannelElastic, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace test
}  // namespace epcomm
