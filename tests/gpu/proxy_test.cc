// The proxy backend against the CPU reference: one process per rank (forked before any CUDA call, TCP bootstrap),
// ranks on GPU rank % devices (so W = 2, 3, 4 run on one GPU), every peer over the libfabric provider of the test's
// parameter (tcp, shm) with EPCOMM_PROXY_LOCAL_SIZE=1. Without a GPU every test reports skipped; without the provider
// too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "backends/proxy/proxy_all_to_all.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "gpu_harness.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace {

using gputest::DeviceBuffer;
using gputest::DeviceTensors;
using gputest::Round;
using gputest::Scenario;
using test::ScopedEnv;

test::RunOptions options() {
  test::RunOptions o;
  o.deadlineMs = 120000;
  return o;
}

Scenario base(uint32_t world) {
  Scenario s;
  s.world = world;
  s.experts = 4 * world;
  return s;
}

// Selects the GPU of `rank` (rank % devices).
void useGpu(int rank) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(rank % count), cudaSuccess);
}

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
    test::RunResult result = test::runRanks(
        world,
        [&](int rank, Bootstrap& bootstrap) {
          for (size_t i = 0; i < list.size(); ++i) {
            std::string err = gputest::runScenario(list[i], static_cast<uint32_t>(rank), bootstrap, "proxy");
            ASSERT_TRUE(err.empty()) << "scenario " << i << ": " << err;
          }
        },
        options());
    EXPECT_TRUE(result.allOk()) << result.summary();
  }

  std::unique_ptr<ScopedEnv> env_;
};

// One rank's proxy object for `s`, its device tensors and one round's inputs uploaded into them.
struct LoadedObject {
  LoadedObject(const Scenario& s, int rank, Bootstrap& bootstrap, uint64_t seed)
      : a2a(createAllToAll(gputest::scenarioConfig(s, rank), bootstrap, "proxy")), round(s, seed) {
    gputest::allocateDevice(s, rank, dev);
    round.upload(rank, dev);
  }
  std::unique_ptr<AllToAll> a2a;
  DeviceTensors dev;
  Round round;
};

TEST_P(ProxyGpu, W1Basic) { runAll(1, {base(1)}); }

// W = 2, 3, 4 ranks: masked and repeated experts, ragged m, a device boundM, both layouts with padding.
TEST_P(ProxyGpu, Worlds234MaskedRaggedBoundLayouts) {
  for (uint32_t world : {2u, 3u, 4u}) {
    std::vector<Scenario> list;
    for (Layout layout : {Layout::kBatched, Layout::kPacked}) {
      Scenario s = base(world);
      s.masked = true;
      s.deviceBound = true;
      s.layout = layout;
      s.padding = layout == Layout::kPacked ? 16 : 4;
      s.indexType = layout == Layout::kPacked ? DType::kI64 : DType::kU32;
      s.seed = 10 * world + (layout == Layout::kPacked ? 1 : 0);
      list.push_back(s);
    }
    runAll(static_cast<int>(world), list);
  }
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
TEST_P(ProxyGpu, DtypeMatrix) {
  std::vector<Scenario> list;
  const DType payloads[] = {DType::kFp8E4M3, DType::kBf16, DType::kF16, DType::kF32};
  const DType combine[] = {DType::kBf16, DType::kF16, DType::kF32};
  uint64_t seed = 100;
  for (DType p : payloads) {
    for (DType y : combine) {
      for (DType o : combine) {
        Scenario s = base(2);
        s.xType = p;
        s.scales = p == DType::kFp8E4M3;
        s.yType = y;
        s.outType = o;
        s.hidden = 128;
        s.rounds = 1;
        s.masked = true;
        s.seed = seed++;
        list.push_back(s);
      }
    }
  }
  runAll(2, list);
}

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

// SPEC's decode shape on two ranks: 256 experts, top-8, 128 tokens of 7168 fp8 bytes and 56 fp32 scales.
TEST_P(ProxyGpu, DecodeShape) {
  Scenario s = base(2);
  s.experts = 256;
  s.topK = 8;
  s.hidden = 7168;
  s.maxTokens = 128;
  s.xType = DType::kFp8E4M3;
  s.scales = true;
  s.ragged = false;
  s.rounds = 2;
  runAll(2, {s});
}

// EPCOMM_PROXY_TRACE=1: every round's phases are stamped (kernels into host-mapped memory, the proxy thread on the
// host) and summarised at destruction; the rounds still match the reference.
TEST_P(ProxyGpu, TraceOn) {
  ScopedEnv trace({{"EPCOMM_PROXY_TRACE", "1"}});
  Scenario s = base(2);
  s.masked = true;
  s.rounds = 4;
  runAll(2, {s});
}

// Fabric counters of the object: one head write and one combine write per peer per round; bulk writes only when the
// private area overflows.
TEST_P(ProxyGpu, OneHeadAndOneCombineWritePerPeerPerRound) {
  test::RunResult result = test::runRanks(
      3,
      [](int rank, Bootstrap& bootstrap) {
        useGpu(rank);
        Scenario s = base(3);
        s.masked = true;
        gpuproxy::ProxyAllToAll a2a(gputest::scenarioConfig(s, rank), bootstrap);
        EXPECT_NE(a2a.memoryPath().find("staging"), std::string::npos) << a2a.memoryPath();
        DeviceTensors dev;
        gputest::allocateDevice(s, rank, dev);
        const int rounds = 4;
        for (int round = 0; round < rounds; ++round) {
          Round r(s, 70 + round);
          r.upload(rank, dev);
          a2a.dispatch(dev.dispatch);
          a2a.combine(dev.combine);
          a2a.synchronize();
          const std::string err = r.check(rank, dev);
          ASSERT_TRUE(err.empty()) << "round " << round << ": " << err;
        }
        const proxy::ChannelStats st = a2a.stats();
        EXPECT_EQ(st.dispatchRounds, static_cast<uint64_t>(rounds));
        EXPECT_EQ(st.combineRounds, static_cast<uint64_t>(rounds));
        for (int p = 0; p < 3; ++p) {
          if (p == rank) continue;
          EXPECT_EQ(st.peers[p].headWrites, static_cast<uint64_t>(rounds)) << "peer " << p;
          EXPECT_EQ(st.peers[p].combineWrites, static_cast<uint64_t>(rounds)) << "peer " << p;
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
        useGpu(rank);
        Scenario sa = base(2), sb = base(2);
        sb.layout = Layout::kPacked;
        sb.hidden = 512;
        sb.masked = true;
        auto a = createAllToAll(gputest::scenarioConfig(sa, rank), bootstrap, "proxy");
        auto b = createAllToAll(gputest::scenarioConfig(sb, rank), bootstrap, "proxy");
        DeviceTensors da, db;
        gputest::allocateDevice(sa, rank, da);
        gputest::allocateDevice(sb, rank, db);
        cudaStream_t s1, s2;
        ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
        ASSERT_EQ(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
        for (int round = 0; round < 3; ++round) {
          Round ra(sa, 500 + round), rb(sb, 600 + round);
          ra.upload(rank, da);
          rb.upload(rank, db);
          da.dispatch.stream = da.combine.stream = s1;
          db.dispatch.stream = db.combine.stream = s2;
          a->dispatch(da.dispatch);
          b->dispatch(db.dispatch);
          a->combine(da.combine);
          b->combine(db.combine);
          a->synchronize();
          b->synchronize();
          std::string ea = ra.check(rank, da), eb = rb.check(rank, db);
          ASSERT_TRUE(ea.empty()) << "object A round " << round << ": " << ea;
          ASSERT_TRUE(eb.empty()) << "object B round " << round << ": " << eb;
        }
        cudaStreamDestroy(s1);
        cudaStreamDestroy(s2);
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
        useGpu(rank);
        Scenario s = base(2);
        s.hidden = 128;
        s.maxTokens = 16;
        s.ragged = false;  // m is part of the captured call; the token count varies through *boundM
        s.deviceBound = true;
        s.masked = true;
        auto a2a = createAllToAll(gputest::scenarioConfig(s, rank), bootstrap, "proxy");
        DeviceTensors dev;
        gputest::allocateDevice(s, rank, dev);
        cudaStream_t stream;
        ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
        {
          Round r0(s, 9000);
          r0.upload(rank, dev);
        }
        dev.dispatch.stream = dev.combine.stream = stream;
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        a2a->dispatch(dev.dispatch);
        a2a->combine(dev.combine);
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        std::vector<uint8_t> first;
        for (int replay = 0; replay < 100; ++replay) {
          // Replays 0 and 1 repeat the same inputs: their outputs must be bitwise equal.
          Round r(s, 10000 + (replay == 1 ? 0 : replay));
          r.upload(rank, dev);
          ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
          ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          a2a->synchronize();
          std::string err = r.check(rank, dev);
          ASSERT_TRUE(err.empty()) << "replay " << replay << ": " << err;
          if (replay == 0) first = Round::snapshot(dev);
          if (replay == 1) ASSERT_EQ(Round::snapshot(dev), first) << "replay 1 differs bitwise from replay 0";
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
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
        useGpu(rank);
        LoadedObject o(base(2), rank, bootstrap, 77);
        if (rank == 0) {
          const auto start = std::chrono::steady_clock::now();
          o.a2a->dispatch(o.dev.dispatch);
          bool threw = false;
          try {
            o.a2a->synchronize();
          } catch (const Error& e) {
            threw = true;
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
            EXPECT_NE(e.message().find("rank 1"), std::string::npos) << e.what();
            EXPECT_NE(e.message().find("dispatch"), std::string::npos) << e.what();
          }
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
          EXPECT_TRUE(threw) << "no error after a peer skipped dispatch";
          EXPECT_LT(ms, 1500 + 3000) << "the timeout took too long";
          EXPECT_THROW(o.a2a->dispatch(o.dev.dispatch), Error);
          void* p = nullptr;
          EXPECT_EQ(cudaMalloc(&p, 1024), cudaSuccess);
          cudaFree(p);
        }
        bootstrap.barrier();
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Rank 2 dies (SIGKILL) after its dispatch send half, mid-round: the survivors raise an error naming it (its silence,
// kTimeout, or the engine's failed transfer to it, kFabric) within a few timeouts, and stay usable for a clean
// shutdown.
TEST_P(ProxyGpu, PeerKilledMidRoundIsNamed) {
  ScopedEnv timeout({{"EPCOMM_TIMEOUT_MS", "2000"}});
  test::RunResult result = test::runRanks(
      3,
      [](int rank, Bootstrap& bootstrap) {
        useGpu(rank);
        Scenario s = base(3);
        LoadedObject o(s, rank, bootstrap, 5);
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
      },
      options());
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.summary();
  EXPECT_TRUE(result.ranks[1].ok()) << result.summary();
  EXPECT_EQ(result.ranks[2].signal, SIGKILL) << result.summary();
}

// Calls out of order are refused before anything is launched, and the object stays usable.
TEST_P(ProxyGpu, CallsOutOfOrderAreRefused) {
  test::RunResult result = test::runRanks(
      1,
      [](int rank, Bootstrap& bootstrap) {
        useGpu(rank);
        LoadedObject o(base(1), rank, bootstrap, 9);
        auto refused = [](const std::function<void()>& call, const char* text) {
          try {
            call();
            ADD_FAILURE() << "no error, expected: " << text;
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
            EXPECT_NE(e.message().find(text), std::string::npos) << e.what();
          }
        };
        refused([&] { o.a2a->combine(o.dev.combine); }, "combine send while the object is 'idle'");
        DispatchArgs recvOnly = o.dev.dispatch;
        recvOnly.doSend = false;
        refused([&] { o.a2a->dispatch(recvOnly); }, "dispatch receive while the object is 'idle'");
        o.a2a->dispatch(o.dev.dispatch);
        refused([&] { o.a2a->dispatch(o.dev.dispatch); }, "combine the last dispatch first");
        o.a2a->combine(o.dev.combine);
        o.a2a->synchronize();
        EXPECT_EQ(o.round.check(rank, o.dev), "");
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// An expert index outside [-1, E) is detected by the dispatch kernel (the entry is skipped, the round completes on
// every rank) and reported as kDeviceError naming the token and the index by the next call.
TEST_P(ProxyGpu, BadIndexIsDeviceError) {
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        useGpu(rank);
        Scenario s = base(2);
        s.ragged = false;
        LoadedObject o(s, rank, bootstrap, 5);
        const int32_t bad = static_cast<int32_t>(s.experts) + 3;
        ASSERT_EQ(
            cudaMemcpy(static_cast<int32_t*>(o.dev.indices.get()) + 2 * s.topK + 1, &bad, 4, cudaMemcpyHostToDevice),
            cudaSuccess);
        o.a2a->dispatch(o.dev.dispatch);
        try {
          o.a2a->synchronize();
          ADD_FAILURE() << "no error for index " << bad;
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kDeviceError) << e.what();
          EXPECT_NE(e.message().find("token 2"), std::string::npos) << e.what();
          EXPECT_NE(e.message().find(std::to_string(bad)), std::string::npos) << e.what();
        }
        EXPECT_THROW(o.a2a->combine(o.dev.combine), Error);
        bootstrap.barrier();
      },
      options());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Providers, ProxyGpu, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace epcomm
