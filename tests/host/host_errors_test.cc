// Errors on the host backend, across real processes: a refused call leaves a usable object, its peers hear of it at
// once (not after EPCOMM_TIMEOUT_MS), combine must use the dispatched routing, and a rank that leaves mid-round ends
// its peers' waits.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

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
  o.deadlineMs = 200000;
  return o;
}

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A dispatch (fused) that a peer may refuse first: its refusal ends this call with kPeerFailure, and the object
// waits on with the receive half (the peer then calls again). Returns whether the refusal was seen.
bool dispatchThroughRefusal(AllToAll& a2a, DispatchArgs da, const std::string& expected) {
  try {
    a2a.dispatch(da);
    return false;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
    EXPECT_NE(e.message().find(expected), std::string::npos) << e.what();
  }
  da.doSend = false;
  a2a.dispatch(da);
  return true;
}

bool combineThroughRefusal(AllToAll& a2a, CombineArgs ca, const std::string& expected) {
  try {
    a2a.combine(ca);
    return false;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
    EXPECT_NE(e.message().find(expected), std::string::npos) << e.what();
  }
  ca.doSend = false;
  a2a.combine(ca);
  return true;
}

// ---- Fail fast, together: a refused dispatch reaches every peer in milliseconds, and the round goes on. ----

TEST(HostErrors, RefusedDispatchReachesThePeersAtOnce) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 4;
  sc.E = 8;
  sc.K = 3;
  sc.T = 8;
  sc.options.provider = "tcp";
  sc.options.timeoutMs = 10000;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        ASSERT_TRUE(checkedRound(a2a, sc, rank, 0));
        const std::vector<RankInputs> in = makeRound(sc, 1);
        DispatchOutputs mine(sc);
        const DispatchArgs good = dispatchArgs(in[rank], mine);
        bootstrap.barrier();
        const auto start = std::chrono::steady_clock::now();
        if (rank == 1) {
          std::vector<RankInputs> bad = makeRound(sc, 1);
          bad[1].indices.data<int32_t>()[3 * sc.K + 1] = 9;
          DispatchOutputs scratch(sc);
          try {
            a2a.dispatch(dispatchArgs(bad[1], scratch));
            ADD_FAILURE() << "a dispatch with expert index 9 of 8 went through";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
            EXPECT_NE(e.message().find("rank 1 token 3 position k=1 has expert index 9"), std::string::npos)
                << e.what();
          }
          // The peers heard of it: the barrier completes long before their timeout.
          bootstrap.barrier();
          a2a.dispatch(good);  // the corrected call: the round goes on
        } else {
          bool refused = false;
          try {
            a2a.dispatch(good);
          } catch (const Error& e) {
            refused = true;
            const double s = secondsSince(start);
            EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
            EXPECT_NE(e.message().find("rank 1 aborted dispatch: rank 1 token 3 position k=1 has expert index 9"),
                      std::string::npos)
                << e.what();
            EXPECT_LT(s, 2.0) << "the peer's refusal took " << s << " s to arrive (timeout 10 s)";
            std::printf("rank %d: peer's refusal raised after %.1f ms\n", rank, s * 1e3);
          }
          EXPECT_TRUE(refused) << "rank " << rank << " never heard of rank 1's refusal";
          bootstrap.barrier();
          DispatchArgs recv = good;
          recv.doSend = false;
          a2a.dispatch(recv);  // waits on for rank 1's corrected dispatch
        }
        reference::HostTensor out = copyOf(in[rank].outInit);
        a2a.combine(combineArgs(in[rank], out));
        EXPECT_TRUE(matchesReference(sc, rank, 1, in, mine, out));
        ASSERT_TRUE(checkedRound(a2a, sc, rank, 2));
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Every check that refuses a call leaves the object usable: the corrected call completes the round. ----

struct Breaker {
  const char* name;
  bool inCombine;
  std::function<void(DispatchArgs&, CombineArgs&, std::vector<int32_t>& scratch)> apply;
  const char* expected;  ///< Part of the refusing rank's message.
};

std::vector<Breaker> breakers(const Scenario& sc) {
  const int32_t E = static_cast<int32_t>(sc.E);
  return {
      {"x row bytes", false, [](DispatchArgs& d, CombineArgs&, auto&) { d.x.shape[1] /= 2; }, "x rows are"},
      {"x null data", false, [](DispatchArgs& d, CombineArgs&, auto&) { d.x.data = nullptr; }, "null data pointer"},
      {"x misaligned", false, [](DispatchArgs& d, CombineArgs&, auto&) { d.x.data = static_cast<char*>(d.x.data) + 2; },
       "aligned"},
      {"indices dtype", false, [](DispatchArgs& d, CombineArgs&, auto&) { d.indices.dtype = DType::kBf16; }, "indices"},
      {"indices columns", false, [](DispatchArgs& d, CombineArgs&, auto&) { d.indices.shape[1] -= 1; },
       "experts per token K"},
      {"index out of range", false,
       [E](DispatchArgs& d, CombineArgs&, auto& s) {
         s.assign(static_cast<int32_t*>(d.indices.data), static_cast<int32_t*>(d.indices.data) + d.indices.numel());
         s[1] = E;
         d.indices.data = s.data();
       },
       "has expert index"},
      {"index -2", false,
       [](DispatchArgs& d, CombineArgs&, auto& s) {
         s.assign(static_cast<int32_t*>(d.indices.data), static_cast<int32_t*>(d.indices.data) + d.indices.numel());
         s[0] = -2;
         d.indices.data = s.data();
       },
       "has expert index -2"},
      {"boundM above m", false,
       [](DispatchArgs& d, CombineArgs&, auto& s) {
         s.assign(1, static_cast<int32_t>(d.x.shape[0] + 1));
         d.boundM = s.data();
       },
       "boundM"},
      {"outExpertX shape", false, [](DispatchArgs& d, CombineArgs&, auto&) { d.outExpertX.shape[0] += 1; },
       "outExpertX"},
      {"outExpertNumTokens dtype", false,
       [](DispatchArgs& d, CombineArgs&, auto&) { d.outExpertNumTokens.dtype = DType::kI64; }, "int32"},
      {"expertY dtype", true, [](DispatchArgs&, CombineArgs& c, auto&) { c.expertY.dtype = DType::kI32; },
       "expertY must be"},
      {"expertY shape", true, [](DispatchArgs&, CombineArgs& c, auto&) { c.expertY.shape[1] -= 1; }, "expertY"},
      {"outTokens columns", true, [](DispatchArgs&, CombineArgs& c, auto&) { c.outTokens.shape[1] -= 4; }, "outTokens"},
      {"weights dtype", true, [](DispatchArgs&, CombineArgs& c, auto&) { c.weights.dtype = DType::kBf16; },
       "weights must be fp32"},
      // The same experts per token count, other tokens: every count check passes, the routing digest does not.
      {"indices of two tokens swapped", true,
       [](DispatchArgs&, CombineArgs& c, auto& s) {
         const int64_t K = c.indices.shape[1];
         s.assign(static_cast<int32_t*>(c.indices.data), static_cast<int32_t*>(c.indices.data) + c.indices.numel());
         for (int64_t k = 0; k < K; ++k) std::swap(s[k], s[K + k]);
         c.indices.data = s.data();
       },
       "indices differ from the dispatched ones"},
      {"combine boundM not the dispatched one", true,
       [](DispatchArgs&, CombineArgs& c, auto& s) {
         s.assign(1, static_cast<int32_t>(c.indices.shape[0] - 1));
         c.boundM = s.data();
       },
       "boundM = "},
      {"combine index out of range", true,
       [E](DispatchArgs&, CombineArgs& c, auto& s) {
         s.assign(static_cast<int32_t*>(c.indices.data), static_cast<int32_t*>(c.indices.data) + c.indices.numel());
         s[2] = E + 3;
         c.indices.data = s.data();
       },
       "has expert index"},
  };
}

TEST(HostErrors, EveryRefusedCallLeavesTheObjectUsable) {
  SKIP_WITHOUT("shm");
  Scenario sc;
  sc.W = 2;
  sc.E = 8;
  sc.K = 3;
  sc.T = 6;
  sc.options.provider = "shm";
  sc.options.timeoutMs = 10000;
  const std::vector<Breaker> list = breakers(sc);
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        uint32_t round = 0;
        for (const Breaker& b : list) {
          SCOPED_TRACE(b.name);
          const std::vector<RankInputs> in = makeRound(sc, round);
          DispatchOutputs mine(sc);
          reference::HostTensor out = copyOf(in[rank].outInit);
          DispatchArgs da = dispatchArgs(in[rank], mine);
          CombineArgs ca = combineArgs(in[rank], out);
          std::vector<int32_t> scratch;
          auto refuse = [&](const std::function<void()>& call) {
            try {
              call();
              ADD_FAILURE() << "the broken call went through";
            } catch (const Error& e) {
              EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
              EXPECT_NE(e.message().find(b.expected), std::string::npos) << e.what();
            }
          };
          if (rank == 0) {
            DispatchArgs bd = da;
            CombineArgs bc = ca;
            b.apply(bd, bc, scratch);
            if (!b.inCombine) refuse([&] { a2a.dispatch(bd); });
            a2a.dispatch(da);
            if (b.inCombine) refuse([&] { a2a.combine(bc); });
            a2a.combine(ca);
          } else {
            const std::string heard = "rank 0 aborted ";
            if (!b.inCombine) {
              dispatchThroughRefusal(a2a, da, heard + "dispatch");
            } else {
              a2a.dispatch(da);
            }
            if (b.inCombine) {
              combineThroughRefusal(a2a, ca, heard + "combine");
            } else {
              a2a.combine(ca);
            }
          }
          ASSERT_TRUE(matchesReference(sc, rank, round, in, mine, out));
          ++round;
        }
        // Receive halves refused by their own checks (nothing of the round is lost: the send half went through).
        const std::vector<RankInputs> in = makeRound(sc, round);
        DispatchOutputs mine(sc);
        reference::HostTensor out = copyOf(in[rank].outInit);
        DispatchArgs da = dispatchArgs(in[rank], mine);
        CombineArgs ca = combineArgs(in[rank], out);
        da.doRecv = ca.doRecv = false;
        a2a.dispatch(da);
        da.doSend = false;
        da.doRecv = true;
        DispatchArgs bad = da;
        bad.outExpertX.shape[1] += 16;
        EXPECT_THROW(a2a.dispatch(bad), Error);
        EXPECT_THROW(a2a.combine(ca), Error);  // out of order: the dispatch is not received yet
        a2a.dispatch(da);
        a2a.combine(ca);
        ca.doSend = false;
        ca.doRecv = true;
        CombineArgs badC = ca;
        badC.weights.shape[1] -= 1;
        EXPECT_THROW(a2a.combine(badC), Error);
        a2a.combine(ca);
        EXPECT_TRUE(matchesReference(sc, rank, round, in, mine, out));
        ASSERT_TRUE(checkedRound(a2a, sc, rank, round + 1, CallMode::kSplit));
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- A rank that gives the object up mid-round ends its peers' waits at once. ----

TEST(HostErrors, RankThatLeavesMidRoundEndsThePeersWaits) {
  SKIP_WITHOUT("tcp");
  Scenario sc;
  sc.W = 3;
  sc.E = 6;
  sc.options.provider = "tcp";
  sc.options.timeoutMs = 10000;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        auto a2a = std::make_unique<host::HostAllToAll>(sc.config(rank), bootstrap, sc.options);
        ASSERT_TRUE(checkedRound(*a2a, sc, rank, 0));
        const std::vector<RankInputs> in = makeRound(sc, 1);
        DispatchOutputs mine(sc);
        a2a->dispatch(dispatchArgs(in[rank], mine));
        bootstrap.barrier();
        const auto start = std::chrono::steady_clock::now();
        if (rank == 2) {
          a2a.reset();  // leaves between dispatch and combine: its peers would wait for its combine rows
          return;
        }
        reference::HostTensor out = copyOf(in[rank].outInit);
        try {
          a2a->combine(combineArgs(in[rank], out));
          ADD_FAILURE() << "combine completed without rank 2";
        } catch (const Error& e) {
          const double s = secondsSince(start);
          EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
          EXPECT_NE(e.message().find("rank 2 left: it destroyed its object while 'dispatched'"), std::string::npos)
              << e.what();
          EXPECT_NE(e.message().find("destroy it and create a new one"), std::string::npos) << e.what();
          EXPECT_LT(s, 2.0) << "the peer's notice took " << s << " s (timeout 10 s)";
        }
        // The object is unusable from then on, and says so.
        try {
          a2a->synchronize();
          ADD_FAILURE() << "synchronize after a lost round did not throw";
        } catch (const Error& e) {
          EXPECT_NE(e.message().find("destroy it and create a new one"), std::string::npos) << e.what();
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- kill -9 of one rank mid-dispatch and mid-combine: the survivors raise a timeout naming it within the timeout
// (+ 1 s), destroy the object, and build a new one among themselves with a new bootstrap, in the same process. ----

class HostFaults : public ::testing::TestWithParam<bool> {};

TEST_P(HostFaults, SurvivorsNameTheDeadRankAndGoOnWithoutIt) {
  SKIP_WITHOUT("tcp");
  const bool inCombine = GetParam();
  constexpr int64_t kTimeoutMs = 2000;
  Scenario sc;
  sc.W = 3;
  sc.E = 6;
  sc.K = 3;
  sc.options.provider = "tcp";
  sc.options.timeoutMs = kTimeoutMs;
  Scenario after = sc;  // the survivors' world
  after.W = 2;
  after.E = 4;
  after.seed = 5;
  const std::string survivorsAddress = "127.0.0.1:" + std::to_string(freeTcpPort());
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        {
          host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
          ASSERT_TRUE(checkedRound(a2a, sc, rank, 0));
          const std::vector<RankInputs> in = makeRound(sc, 1);
          DispatchOutputs mine(sc);
          reference::HostTensor out = copyOf(in[rank].outInit);
          if (inCombine) a2a.dispatch(dispatchArgs(in[rank], mine));
          bootstrap.barrier();
          if (rank == 2) raise(SIGKILL);  // before its dispatch, or between its dispatch and its combine
          const auto start = std::chrono::steady_clock::now();
          try {
            if (!inCombine) a2a.dispatch(dispatchArgs(in[rank], mine));
            a2a.combine(combineArgs(in[rank], out));
            ADD_FAILURE() << "the round completed without rank 2";
          } catch (const Error& e) {
            const double s = secondsSince(start);
            // Its own timeout, or the other survivor's (sent at once, the code kept), or a failed write to the dead
            // rank (kFabric): each names rank 2.
            EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kFabric) << e.what();
            EXPECT_NE(e.message().find(inCombine ? "combine" : "dispatch"), std::string::npos) << e.what();
            EXPECT_NE(e.message().find("from rank 2"), std::string::npos) << e.what();
            EXPECT_LT(s, kTimeoutMs / 1000.0 + 1.0) << e.what();
            std::printf("rank %d: %s raised after %.0f ms: %s\n", rank, inCombine ? "combine" : "dispatch", s * 1e3,
                        e.message().c_str());
          }
          EXPECT_THROW(a2a.synchronize(), Error);
        }  // destroyed: the dead rank's object is gone for good
        // A smaller world, a new bootstrap, the same process.
        std::unique_ptr<Bootstrap> fresh = createTcpBootstrap(survivorsAddress, rank, 2, 10000);
        host::HostAllToAll a2a(after.config(rank), *fresh, after.options);
        for (uint32_t round = 0; round < 5; ++round) ASSERT_TRUE(checkedRound(a2a, after, rank, round));
      },
      runOptions());
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.summary();
  EXPECT_TRUE(result.ranks[1].ok()) << result.summary();
  EXPECT_EQ(result.ranks[2].signal, SIGKILL) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Host, HostFaults, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "MidCombine" : "MidDispatch"; });

}  // namespace
}  // namespace test
}  // namespace epcomm
