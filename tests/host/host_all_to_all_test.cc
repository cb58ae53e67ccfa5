// The host backend end to end: W real processes over libfabric tcp / shm, every output compared bitwise with the
// CPU reference (dispatch is a copy; combine sums in the reference's order, so it is bitwise equal as well).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <regex>
#include <string>
#include <tuple>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "host_harness.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace test {
namespace {

RunOptions runOptions() {
  RunOptions o;
  o.deadlineMs = 150000;
  return o;
}

// Runs `rounds` checked rounds of the scenario on one object in every rank.
void runScenario(const Scenario& sc, uint32_t rounds, CallMode mode = CallMode::kFused) {
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        uint32_t done = 0;
        for (uint32_t round = 0; round < rounds; ++round, ++done) {
          if (!checkedRound(a2a, sc, rank, round, mode)) break;
        }
        EXPECT_EQ(done, rounds);
        EXPECT_EQ(a2a.stats().dispatchRounds, rounds);
        EXPECT_EQ(a2a.stats().combineRounds, rounds);
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- The main matrix: W in {2, 3, 4} x D in {1, 2} x {tcp, shm}, mixed routing, both layouts. ----

class HostMatrix : public ::testing::TestWithParam<std::tuple<std::string, uint32_t, uint32_t>> {};

TEST_P(HostMatrix, MatchesReference) {
  const auto [provider, W, D] = GetParam();
  SKIP_WITHOUT(provider);
  Scenario sc;
  sc.W = W;
  sc.D = D;
  sc.E = 4 * W;
  sc.K = 3;
  sc.T = 10;
  sc.options.provider = provider;
  sc.options.privateTokens = 2;  // small: most rounds take the overflow path too
  sc.ragged = true;
  sc.route = RouteMode::kMasked;
  sc.seed = 100 + W * 10 + D;
  runScenario(sc, 6);
  sc.layout = Layout::kPacked;
  sc.padding = 4;
  sc.route = RouteMode::kDuplicates;
  sc.indexDtype = DType::kI64;
  runScenario(sc, 6);
}

INSTANTIATE_TEST_SUITE_P(Host, HostMatrix,
                         ::testing::Values(std::make_tuple("tcp", 2u, 1u), std::make_tuple("tcp", 3u, 1u),
                                           std::make_tuple("tcp", 4u, 2u), std::make_tuple("shm", 2u, 2u),
                                           std::make_tuple("shm", 3u, 1u), std::make_tuple("shm", 4u, 1u),
                                           std::make_tuple("shm", 4u, 2u)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param)) + "_D" +
                                  std::to_string(std::get<2>(info.param));
                         });

// ---- Every dtype pair: dispatch payload (fp8 + scales, bf16, fp16, fp32) x expertY x outTokens. ----

// One round on `a2a` per (expertY, outTokens) dtype pair, accumulating on odd rounds; names the failing pair.
::testing::AssertionResult everyCombinePair(AllToAll& a2a, Scenario& sc, uint32_t rank, uint32_t& round) {
  const DType types[] = {DType::kBf16, DType::kF16, DType::kF32};
  for (DType y : types) {
    for (DType out : types) {
      sc.yDtype = y;
      sc.outDtype = out;
      sc.accumulate = (round % 2) == 1;
      if (!checkedRound(a2a, sc, rank, round++)) {
        return ::testing::AssertionFailure() << dtypeName(y) << " -> " << dtypeName(out);
      }
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(HostBackend, EveryDtypePair) {
  SKIP_WITHOUT("shm");
  const DType xTypes[] = {DType::kFp8E4M3, DType::kBf16, DType::kF16, DType::kF32};
  RunResult result = runRanks(
      2,
      [&](int rank, Bootstrap& bootstrap) {
        uint32_t round = 0;
        for (DType x : xTypes) {
          Scenario sc;
          sc.W = 2;
          sc.xDtype = x;
          sc.scales = x == DType::kFp8E4M3;
          sc.route = RouteMode::kMasked;
          sc.options.provider = "shm";
          sc.indexDtype = DType::kU32;
          host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
          ASSERT_TRUE(everyCombinePair(a2a, sc, rank, round)) << "payload " << dtypeName(x);
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Rows wider than the combine's vector block (64 elements) and not a multiple of it: full blocks and a tail. ----

TEST(HostBackend, WideRowsEveryCombineDtypePair) {
  SKIP_WITHOUT("shm");
  RunResult result = runRanks(
      2,
      [&](int rank, Bootstrap& bootstrap) {
        uint32_t round = 0;
        for (uint32_t H : {200u, 64u, 24u}) {
          Scenario sc;
          sc.W = 2;
          sc.H = H;
          sc.K = 6;
          sc.route = RouteMode::kDuplicates;
          sc.options.provider = "shm";
          host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
          ASSERT_TRUE(everyCombinePair(a2a, sc, rank, round)) << "H " << H;
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- The protocol's operation counts: the bulk is one write per peer, and only when the private area overflows.

TEST(HostBackend, OverflowIsOneWritePerPeer) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 3;
  sc.E = 12;
  sc.K = 3;
  sc.T = 16;
  sc.route = RouteMode::kOneRank;  // every token of every rank goes to rank 0
  sc.options.provider = "tcp";
  sc.options.privateTokens = 3;
  const uint32_t rounds = 5;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        const uint64_t bytesBefore = a2a.bufferBytes();
        for (uint32_t round = 0; round < rounds; ++round) ASSERT_TRUE(checkedRound(a2a, sc, rank, round));
        // Rank 0 owns every row (3 x 16 x 3 = 144, sized for 64 expected): its combine send buffer grew, and the
        // rounds after the growth still match the reference.
        if (rank == 0) EXPECT_GT(a2a.bufferBytes(), bytesBefore);
        const host::HostStats st = a2a.stats();
        EXPECT_EQ(st.dispatchRounds, rounds);
        for (uint32_t p = 0; p < sc.W; ++p) {
          if (p == static_cast<uint32_t>(rank)) continue;
          EXPECT_EQ(st.peers[p].headWrites, rounds) << "peer " << p;
          EXPECT_EQ(st.peers[p].combineWrites, rounds) << "peer " << p;
          EXPECT_EQ(st.peers[p].barrierImms, 0u) << "peer " << p;
          // 16 tokens > 3 private entries: exactly one bulk write per round to rank 0, none elsewhere.
          EXPECT_EQ(st.peers[p].bulkWrites, p == 0 ? rounds : 0u) << "peer " << p;
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(HostBackend, NoOverflowWhenPrivateAreaSuffices) {
  SKIP_WITHOUT("shm");
  Scenario sc;
  sc.W = 4;
  sc.E = 16;
  sc.K = 4;
  sc.T = 8;
  sc.options.provider = "shm";
  sc.options.privateTokens = 8;  // = T: every token fits
  sc.layout = Layout::kPacked;
  sc.padding = 8;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        EXPECT_EQ(a2a.sizes().overflowEntries, 0u);
        for (uint32_t round = 0; round < 4; ++round) ASSERT_TRUE(checkedRound(a2a, sc, rank, round));
        const host::HostStats st = a2a.stats();
        for (uint32_t p = 0; p < sc.W; ++p) {
          EXPECT_EQ(st.peers[p].bulkWrites, 0u) << "peer " << p;
          if (p != static_cast<uint32_t>(rank)) EXPECT_EQ(st.peers[p].headWrites, 4u) << "peer " << p;
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Empty batches: a rank with no tokens (null data, strides (0, 0)) still takes its part in every round. ----

TEST(HostBackend, EmptyBatchTakesPartInTheRound) {
  SKIP_WITHOUT("tcp");
  for (uint32_t D : {1u, 2u}) {
    Scenario sc;
    sc.W = 4;
    sc.D = D;
    sc.E = 8;
    sc.K = 3;
    sc.scales = true;
    sc.xDtype = DType::kFp8E4M3;
    sc.options.provider = "tcp";
    sc.options.privateTokens = 2;
    sc.bareEmpty = true;
    sc.emptyGroup = 1;  // ranks 1 (D = 1) or 2 and 3 (D = 2) have m = 0 in every round
    runScenario(sc, 3);
    runScenario(sc, 2, CallMode::kSplit);
    sc.emptyGroup = -1;
    sc.ragged = true;  // some groups empty in some rounds, with and without boundM
    sc.layout = Layout::kPacked;
    sc.padding = 16;
    sc.seed = 9;
    runScenario(sc, 8);
  }
}

// ---- Many rounds with fresh routing: buffer reuse across rounds must never mix data. ----

TEST(HostBackend, ThousandRounds) {
  SKIP_WITHOUT("shm");
  Scenario sc;
  sc.W = 3;
  sc.E = 6;
  sc.K = 2;
  sc.T = 6;
  sc.H = 16;
  sc.ragged = true;
  sc.route = RouteMode::kMasked;
  sc.options.provider = "shm";
  sc.options.privateTokens = 1;
  runScenario(sc, 1000);
}

// ---- Send/recv split, and dispatch followed by dispatch (the reuse barrier). ----

TEST(HostBackend, SplitSendRecvAndRepeatedDispatch) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 2;
  sc.D = 1;
  sc.options.provider = "tcp";
  sc.options.privateTokens = 2;
  sc.route = RouteMode::kDuplicates;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        for (uint32_t round = 0; round < 5; ++round) ASSERT_TRUE(checkedRound(a2a, sc, rank, round, CallMode::kSplit));
        // Two dispatches in a row (no combine between): the second waits for the barrier, results stay exact.
        for (uint32_t round = 5; round < 8; ++round) {
          const std::vector<RankInputs> in = makeRound(sc, round);
          DispatchOutputs mine(sc);
          a2a.dispatch(dispatchArgs(in[rank], mine));
        }
        ASSERT_TRUE(checkedRound(a2a, sc, rank, 8));
        EXPECT_GT(a2a.stats().peers[1 - rank].barrierImms, 0u);
        // Out-of-order calls are rejected, not silently accepted.
        const std::vector<RankInputs> in = makeRound(sc, 9);
        reference::HostTensor out = copyOf(in[rank].outInit);
        try {
          a2a.combine(combineArgs(in[rank], out));
          ADD_FAILURE() << "combine without a dispatch was accepted";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Two objects in flight at once, their halves interleaved. ----

TEST(HostBackend, TwoObjectsInterleaved) {
  SKIP_WITHOUT("shm");
  Scenario a, b;
  a.W = b.W = 3;
  a.options.provider = b.options.provider = "shm";
  a.E = 6;
  b.E = 12;
  b.K = 5;
  b.layout = Layout::kPacked;
  b.padding = 2;
  a.options.privateTokens = 1;
  b.seed = 77;
  RunResult result = runRanks(
      3,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll x(a.config(rank), bootstrap, a.options);
        host::HostAllToAll y(b.config(rank), bootstrap, b.options);
        EXPECT_NE(x.sizes().worldSize, 0u);
        for (uint32_t round = 0; round < 10; ++round) {
          const std::vector<RankInputs> ia = makeRound(a, round), ib = makeRound(b, round);
          DispatchOutputs oa(a), ob(b);
          DispatchArgs da = dispatchArgs(ia[rank], oa), db = dispatchArgs(ib[rank], ob);
          da.doRecv = db.doRecv = false;
          x.dispatch(da);
          y.dispatch(db);
          da.doSend = db.doSend = false;
          da.doRecv = db.doRecv = true;
          y.dispatch(db);
          x.dispatch(da);
          reference::HostTensor outA = copyOf(ia[rank].outInit), outB = copyOf(ib[rank].outInit);
          CombineArgs ca = combineArgs(ia[rank], outA), cb = combineArgs(ib[rank], outB);
          ca.doRecv = cb.doRecv = false;
          y.combine(cb);
          x.combine(ca);
          ca.doSend = cb.doSend = false;
          ca.doRecv = cb.doRecv = true;
          x.combine(ca);
          y.combine(cb);
          // Same rounds again through the checked path on each object: both still agree with the reference.
          ASSERT_TRUE(checkedRound(x, a, rank, round + 100));
          ASSERT_TRUE(checkedRound(y, b, rank, round + 100));
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Failures: a bad index names rank, token and position; a dead peer is named by every survivor. ----

TEST(HostBackend, BadIndexNamesRankTokenAndPosition) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 2;
  sc.options.provider = "tcp";
  sc.options.timeoutMs = 1500;
  RunResult result = runRanks(
      2,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        std::vector<RankInputs> in = makeRound(sc, 0);
        if (rank == 0) in[0].indices.data<int32_t>()[3 * sc.K + 1] = static_cast<int32_t>(sc.E);
        DispatchOutputs out(sc);
        try {
          a2a.dispatch(dispatchArgs(in[rank], out));
          ADD_FAILURE() << "dispatch succeeded";
        } catch (const Error& e) {
          if (rank == 0) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
            EXPECT_NE(e.message().find("rank 0 token 3 position k=1"), std::string::npos) << e.what();
          } else {
            // Rank 0 refused its call and told its peers: rank 1 raises rank 0's message at once ("rank 0 aborted
            // dispatch: ...", or "rank 0 left: ..." when rank 0's object is destroyed before rank 1 reads it).
            EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
            EXPECT_TRUE(std::regex_search(e.message(), std::regex("rank 0 (aborted dispatch|left): .*rank 0 token 3 "
                                                                  "position k=1 has expert index")))
                << e.what();
          }
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(HostBackend, DeadPeerIsNamedBySurvivors) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 3;
  sc.E = 6;
  sc.options.provider = "tcp";
  sc.options.timeoutMs = 2000;
  RunResult result = runRanks(
      3,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        ASSERT_TRUE(checkedRound(a2a, sc, rank, 0));
        const std::vector<RankInputs> in = makeRound(sc, 1);
        DispatchOutputs out(sc);
        DispatchArgs da = dispatchArgs(in[rank], out);
        da.doRecv = false;
        a2a.dispatch(da);
        if (rank == 2) raise(SIGKILL);  // dies mid-round, after posting its dispatch
        const auto start = std::chrono::steady_clock::now();
        try {
          da.doSend = false;
          da.doRecv = true;
          a2a.dispatch(da);
          reference::HostTensor o = copyOf(in[rank].outInit);
          a2a.combine(combineArgs(in[rank], o));
          ADD_FAILURE() << "round completed without rank 2";
        } catch (const Error& e) {
          // Its silence (kTimeout) or the engine's failed transfer to it (the engine's own code, kept).
          EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kFabric) << e.what();
          // Rank 2 must be named, alone ("rank 2") or in the list of silent ranks ("ranks 1, 2"): a survivor whose
          // other peer was slowed by the dead rank names both.
          EXPECT_TRUE(std::regex_search(e.message(), std::regex("ranks? ([0-9]+, )*2([^0-9]|$)"))) << e.what();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_LT(s, 3 * 2.0 + 2.0) << "the error took too long";
        // The object stays broken but usable for a clean shutdown.
        EXPECT_THROW(a2a.synchronize(), Error);
      },
      runOptions());
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.summary();
  EXPECT_TRUE(result.ranks[1].ok()) << result.summary();
  EXPECT_EQ(result.ranks[2].signal, SIGKILL) << result.summary();
}

// ---- Settings of the host backend that every rank must share are checked at construction, on every rank. ----

TEST(HostBackend, ChannelSettingsMustAgree) {
  SKIP_WITHOUT("tcp");
  SKIP_WITHOUT("shm");
  Scenario sc;
  sc.W = 3;
  sc.E = 6;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        auto expectMismatch = [&](host::HostOptions options, const std::string& expected) {
          try {
            host::HostAllToAll a2a(sc.config(rank), bootstrap, options);
            ADD_FAILURE() << "constructed with mismatched settings";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidConfig) << e.what();
            EXPECT_EQ(e.message(), "host/proxy channel mismatch: " + expected) << e.what();
          }
        };
        host::HostOptions o;
        o.provider = "tcp";
        o.privateTokens = rank == 2 ? 3 : 2;
        expectMismatch(o, "private_tokens (EPCOMM_PRIVATE_TOKENS) is 2 on rank 0 but 3 on rank 2");
        o.privateTokens = 2;
        o.provider = rank == 1 ? "shm" : "tcp";
        expectMismatch(o, "fabric provider (EPCOMM_FABRIC_PROVIDER) is tcp;ofi_rxm on rank 0 but shm on rank 1");
        // Agreeing settings construct and run.
        o.provider = "shm";
        host::HostAllToAll a2a(sc.config(rank), bootstrap, o);
        ASSERT_TRUE(checkedRound(a2a, sc, rank, 0));
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Through the public factory. ----

TEST(HostBackend, FactoryCreatesHost) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 2;
  sc.D = 2;
  RunResult result = runRanks(
      2,
      [&](int rank, Bootstrap& bootstrap) {
        setenv("EPCOMM_FABRIC_PROVIDER", "tcp", 1);
        std::unique_ptr<AllToAll> a2a = createAllToAll(sc.config(rank), bootstrap, "host");
        EXPECT_STREQ(a2a->backendName(), "host");
        EXPECT_GT(a2a->bufferBytes(), 0u);
        for (uint32_t round = 0; round < 3; ++round) ASSERT_TRUE(checkedRound(*a2a, sc, rank, round));
        a2a->synchronize();
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace test
}  // namespace epcomm
