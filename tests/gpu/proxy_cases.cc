#include "proxy_cases.hpp"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <regex>

#include "epcomm/error.hpp"

namespace epcomm {
namespace gputest {

Scenario proxyScenario(uint32_t world) {
  Scenario s;
  s.world = world;
  s.experts = 4 * world;
  return s;
}

std::vector<Scenario> maskedLayouts(uint32_t world) {
  std::vector<Scenario> list;
  for (Layout layout : {Layout::kBatched, Layout::kPacked}) {
    Scenario s = proxyScenario(world);
    s.masked = true;
    s.deviceBound = true;
    s.layout = layout;
    s.padding = layout == Layout::kPacked ? 16 : 4;
    s.indexType = layout == Layout::kPacked ? DType::kI64 : DType::kU32;
    s.seed = 10 * world + (layout == Layout::kPacked ? 1 : 0);
    list.push_back(s);
  }
  return list;
}

void checkedRounds(AllToAll& a2a, const Scenario& s, int rank, DeviceTensors& dev, int rounds, uint64_t seed) {
  for (int round = 0; round < rounds; ++round) {
    Round r(s, seed + round);
    r.upload(rank, dev);
    a2a.dispatch(dev.dispatch);
    a2a.combine(dev.combine);
    a2a.synchronize();
    const std::string err = r.check(rank, dev);
    ASSERT_TRUE(err.empty()) << "round " << round << ": " << err;
  }
}

void expectControlPerRound(const proxy::ChannelStats& st, int world, int rank, int rounds) {
  EXPECT_EQ(st.dispatchRounds, static_cast<uint64_t>(rounds));
  EXPECT_EQ(st.combineRounds, static_cast<uint64_t>(rounds));
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    EXPECT_EQ(st.peers[p].headWrites, static_cast<uint64_t>(rounds)) << "peer " << p;
    EXPECT_EQ(st.peers[p].combineWrites, static_cast<uint64_t>(rounds)) << "peer " << p;
  }
}

void peerKilledMidRound(const Scenario& s, int rank, Bootstrap& bootstrap) {
  useRankDevice(rank);
  LoadedObject o(s, rank, bootstrap, 5, "proxy");
  o.a2a->dispatch(o.dev.dispatch);
  o.a2a->combine(o.dev.combine);
  o.a2a->synchronize();
  ASSERT_EQ(o.round.check(rank, o.dev), "");
  DispatchArgs send = o.dev.dispatch;
  send.doRecv = false;
  o.a2a->dispatch(send);
  if (rank == 2) raise(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  try {
    DispatchArgs recv = o.dev.dispatch;
    recv.doSend = false;
    o.a2a->dispatch(recv);
    o.a2a->combine(o.dev.combine);
    o.a2a->synchronize();
    ADD_FAILURE() << "round completed without rank 2";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kFabric ||
                e.code() == ErrorCode::kPeerFailure)
        << e.what();
    EXPECT_TRUE(std::regex_search(e.message(), std::regex("ranks? ([0-9]+, )*2([^0-9]|$)"))) << e.what();
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(sec, 3 * 2.0 + 3.0) << "the error took too long";
  EXPECT_THROW(o.a2a->synchronize(), Error);
}

void expectRank2Killed(const test::RunResult& result, int world, const std::string& what) {
  ASSERT_EQ(result.ranks.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    if (r == 2) {
      EXPECT_EQ(result.ranks[r].signal, SIGKILL) << (what.empty() ? "" : what + ": ") << result.summary();
    } else {
      EXPECT_TRUE(result.ranks[r].ok()) << (what.empty() ? "" : what + ": ") << result.summary();
    }
  }
}

}  // namespace gputest
}  // namespace epcomm
