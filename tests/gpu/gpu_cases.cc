#include "gpu_cases.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "epcomm/error.hpp"
#include "gpu_rounds.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {

LoadedObject::LoadedObject(const Scenario& s, int rank, Bootstrap& bootstrap, uint64_t seed, const std::string& backend)
    : a2a(createAllToAll(scenarioConfig(s, rank), bootstrap, backend)), round(s, seed) {
  allocateDevice(s, rank, dev);
  round.upload(rank, dev);
}

void runScenarios(const std::vector<Scenario>& list, uint32_t rank, Bootstrap& bootstrap, const std::string& backend,
                  const std::string& what) {
  for (size_t i = 0; i < list.size(); ++i) {
    std::string err = runScenario(list[i], rank, bootstrap, backend);
    ASSERT_TRUE(err.empty()) << (what.empty() ? "" : what + ", ") << "scenario " << i << ": " << err;
  }
}

void runScenariosOnRanks(int world, const std::vector<Scenario>& list, const std::string& backend,
                         const test::RunOptions& options, const std::string& what) {
  test::RunResult result = test::runRanks(
      world,
      [&](int rank, Bootstrap& bootstrap) {
        runScenarios(list, static_cast<uint32_t>(rank), bootstrap, backend, what);
      },
      options);
  EXPECT_TRUE(result.allOk()) << (what.empty() ? "" : what + ": ") << result.summary();
}

std::vector<Scenario> maskedBoundLayouts(const Scenario& base) {
  Scenario s = base;
  s.masked = true;
  s.deviceBound = true;
  s.layout = Layout::kPacked;
  s.padding = 8;
  Scenario b = s;
  b.layout = Layout::kBatched;
  b.padding = 4;
  b.indexType = DType::kU32;
  Scenario c = s;
  c.indexType = DType::kI64;
  c.split = true;
  c.accumulate = true;
  return {s, b, c};
}

std::vector<Scenario> dpGroupsOfTwo(const Scenario& base) {
  Scenario s = base;
  s.dp = 2;
  s.masked = true;
  s.deviceBound = true;
  Scenario p = s;
  p.layout = Layout::kPacked;
  p.padding = 4;
  p.split = true;
  return {s, p};
}

std::vector<Scenario> dtypeMatrix(const Scenario& base) {
  std::vector<Scenario> list;
  const DType payloads[] = {DType::kFp8E4M3, DType::kBf16, DType::kF16, DType::kF32};
  const DType combine[] = {DType::kBf16, DType::kF16, DType::kF32};
  uint64_t seed = 100;
  for (DType p : payloads) {
    for (DType y : combine) {
      for (DType o : combine) {
        Scenario s = base;
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
  return list;
}

Scenario decodeShape(Scenario s) {
  s.experts = 256;
  s.topK = 8;
  s.hidden = 7168;
  s.maxTokens = 128;
  s.xType = DType::kFp8E4M3;
  s.scales = true;
  s.rounds = 2;
  return s;
}

Scenario secondObject(Scenario s) {
  s.layout = Layout::kPacked;
  s.hidden = 512;
  s.masked = true;
  return s;
}

void twoObjectsInFlight(const Scenario& sa, const Scenario& sb, int rank, Bootstrap& bootstrap,
                        const std::string& backend, bool splitB) {
  useRankDevice(rank);
  auto a = createAllToAll(scenarioConfig(sa, rank), bootstrap, backend);
  auto b = createAllToAll(scenarioConfig(sb, rank), bootstrap, backend);
  DeviceTensors da, db;
  allocateDevice(sa, rank, da);
  allocateDevice(sb, rank, db);
  cudaStream_t s1, s2;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    Round ra(sa, 500 + round), rb(sb, 600 + round);
    ra.upload(rank, da);
    rb.upload(rank, db);
    da.dispatch.stream = da.combine.stream = s1;
    db.dispatch.stream = db.combine.stream = s2;
    const auto [bSend, bRecv] = halves(db.dispatch);
    const auto [cSend, cRecv] = halves(db.combine);
    a->dispatch(da.dispatch);
    b->dispatch(splitB ? bSend : db.dispatch);
    if (splitB) b->dispatch(bRecv);
    a->combine(da.combine);
    b->combine(splitB ? cSend : db.combine);
    if (splitB) b->combine(cRecv);
    a->synchronize();
    b->synchronize();
    std::string ea = ra.check(rank, da), eb = rb.check(rank, db);
    ASSERT_TRUE(ea.empty()) << "object A round " << round << ": " << ea;
    ASSERT_TRUE(eb.empty()) << "object B round " << round << ": " << eb;
  }
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

void graphReplay(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend, const Replays& r) {
  s.hidden = 128;
  s.maxTokens = 16;
  s.ragged = false;  // m is part of the captured call; the token count varies through *boundM
  s.deviceBound = true;
  s.masked = true;
  useRankDevice(rank);
  auto a2a = createAllToAll(scenarioConfig(s, rank), bootstrap, backend);
  DeviceTensors dev;
  allocateDevice(s, rank, dev);
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
  if (r.splitHalves) {
    const auto [dSend, dRecv] = halves(dev.dispatch);
    const auto [cSend, cRecv] = halves(dev.combine);
    a2a->dispatch(dSend);
    a2a->dispatch(dRecv);
    a2a->combine(cSend);
    a2a->combine(cRecv);
  } else {
    a2a->dispatch(dev.dispatch);
    a2a->combine(dev.combine);
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  std::vector<uint8_t> first;
  for (int replay = 0; replay < r.count; ++replay) {
    // repeatFirst: replays 0 and 1 repeat the same inputs, so their outputs must be bitwise equal.
    Round rd(s, 10000 + (r.repeatFirst && replay == 1 ? 0 : replay));
    rd.upload(rank, dev);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    a2a->synchronize();
    std::string err = rd.check(rank, dev);
    ASSERT_TRUE(err.empty()) << (r.what.empty() ? "" : r.what + " ") << "replay " << replay << ": " << err;
    if (r.repeatFirst) {
      if (replay == 0) first = Round::snapshot(dev);
      if (replay == 1) ASSERT_EQ(Round::snapshot(dev), first) << "replay 1 differs bitwise from replay 0";
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

void peerNeverEnters(const Scenario& s, int rank, Bootstrap& bootstrap, const std::string& backend, const Silence& x) {
  useRankDevice(rank);
  LoadedObject o(s, rank, bootstrap, 77, backend);
  auto& a2a = o.a2a;
  DeviceTensors& dev = o.dev;
  const int missing = static_cast<int>(s.world) - 1;
  const bool skipDispatch = x.phase == "dispatch";
  if (!skipDispatch) {
    a2a->dispatch(dev.dispatch);
    a2a->synchronize();
  }
  if (rank != missing) {
    const auto start = std::chrono::steady_clock::now();
    if (skipDispatch) {
      a2a->dispatch(dev.dispatch);
    } else {
      a2a->combine(dev.combine);
    }
    bool threw = false;
    try {
      a2a->synchronize();
    } catch (const Error& e) {
      threw = true;
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_NE(e.message().find(x.names + std::to_string(missing)), std::string::npos) << e.what();
      EXPECT_NE(e.message().find(x.phase), std::string::npos) << e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(threw) << "no error after " << x.who << " skipped " << x.phase;
    EXPECT_LT(ms, x.withinMs) << "the timeout took too long";
    // The object refuses further use with the same error; the context stays usable.
    EXPECT_THROW(a2a->dispatch(dev.dispatch), Error);
    if (x.contextUsable) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, 1024), cudaSuccess);
      cudaFree(p);
    }
  }
  bootstrap.barrier();
}

void callsOutOfOrderAreRefused(const Scenario& s, int rank, Bootstrap& bootstrap, const std::string& backend,
                               bool weightRows) {
  useRankDevice(rank);
  LoadedObject o(s, rank, bootstrap, 9, backend);
  auto& a2a = o.a2a;
  DeviceTensors& dev = o.dev;
  auto refused = [](const std::function<void()>& call, const char* text) {
    try {
      call();
      ADD_FAILURE() << "no error, expected: " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find(text), std::string::npos) << e.what();
    }
  };
  refused([&] { a2a->combine(dev.combine); }, "combine send while the object is 'idle'");
  DispatchArgs recvOnly = dev.dispatch;
  recvOnly.doSend = false;
  refused([&] { a2a->dispatch(recvOnly); }, "dispatch receive while the object is 'idle'");
  a2a->dispatch(dev.dispatch);
  refused([&] { a2a->dispatch(dev.dispatch); }, "combine the last dispatch first");
  if (weightRows) {
    // The peers wait for the weights of every dispatched token: fewer rows than m are refused.
    CombineArgs fewWeights = dev.combine;
    fewWeights.doRecv = false;
    ASSERT_GT(fewWeights.weights.shape[0], 0);
    fewWeights.weights.shape[0] -= 1;
    refused([&] { a2a->combine(fewWeights); }, "fewer than the m");
  }
  a2a->combine(dev.combine);
  a2a->synchronize();
  EXPECT_EQ(o.round.check(rank, dev), "");
}

namespace {
constexpr int64_t kOtherStreamHoldMs = 2000;
}  // namespace

void synchronizeWaitsForItsOwnWork(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend) {
  useRankDevice(rank);
  LoadedObject o(s, rank, bootstrap, 21, backend);
  Stream mine, other;
  o.dev.dispatch.stream = o.dev.combine.stream = mine.get();
  // A first round on this stream: the first launch of a kernel loads its module (CUDA's lazy loading), and a load may
  // synchronise the whole context, which would wait for the held stream below whatever synchronize() does.
  o.a2a->dispatch(o.dev.dispatch);
  o.a2a->combine(o.dev.combine);
  o.a2a->synchronize();
  ASSERT_EQ(o.round.check(static_cast<uint32_t>(rank), o.dev), "") << "first round";
  o.round.upload(static_cast<uint32_t>(rank), o.dev);  // outputs cleared: the check below sees this round's writes
  o.dev.dispatch.stream = o.dev.combine.stream = mine.get();
  // The other stream is held by a host function: a wait for the whole device would wait for it too.
  ASSERT_EQ(cudaLaunchHostFunc(
                other.get(), [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(kOtherStreamHoldMs)); },
                nullptr),
            cudaSuccess);
  using Clock = std::chrono::steady_clock;
  auto since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  const auto start = Clock::now();
  o.a2a->dispatch(o.dev.dispatch);
  const double dispatchMs = since(start);
  o.a2a->combine(o.dev.combine);
  const double callsMs = since(start);
  o.a2a->synchronize();
  const double ms = since(start);
  const std::string times = "dispatch call " + std::to_string(dispatchMs) + " ms, dispatch + combine calls " +
                            std::to_string(callsMs) + " ms, with synchronize() " + std::to_string(ms) + " ms";
  EXPECT_EQ(cudaStreamQuery(other.get()), cudaErrorNotReady) << times;
  cudaGetLastError();
  EXPECT_LT(ms, kOtherStreamHoldMs / 2.0) << "the round waited for another stream's work: " << times;
  EXPECT_EQ(o.round.check(static_cast<uint32_t>(rank), o.dev), "") << "synchronize() returned before the round ended";
  ASSERT_EQ(cudaStreamSynchronize(other.get()), cudaSuccess);
}

void badIndexIsDeviceError(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend) {
  s.ragged = false;
  useRankDevice(rank);
  LoadedObject o(s, rank, bootstrap, 5, backend);
  auto& a2a = o.a2a;
  DeviceTensors& dev = o.dev;
  const int32_t bad = static_cast<int32_t>(s.experts) + 3;
  ASSERT_EQ(cudaMemcpy(static_cast<int32_t*>(dev.indices.get()) + 2 * s.topK + 1, &bad, 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  a2a->dispatch(dev.dispatch);
  try {
    a2a->synchronize();
    ADD_FAILURE() << "no error for index " << bad;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDeviceError) << e.what();
    EXPECT_NE(e.message().find("token 2"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find(std::to_string(bad)), std::string::npos) << e.what();
  }
  EXPECT_THROW(a2a->combine(dev.combine), Error);
}

void peerRefuses(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend, Refusal what,
                 int64_t withinMs) {
  ASSERT_GE(s.world, 2u);
  s.ragged = false;  // every rank has T tokens: every rank's data is awaited by every other one
  useRankDevice(rank);
  LoadedObject o(s, rank, bootstrap, 31, backend);
  auto& a2a = o.a2a;
  DeviceTensors& dev = o.dev;
  a2a->dispatch(dev.dispatch);
  a2a->combine(dev.combine);
  a2a->synchronize();
  ASSERT_EQ(o.round.check(static_cast<uint32_t>(rank), dev), "") << "round 0";
  Round r1(s, 32);
  r1.upload(static_cast<uint32_t>(rank), dev);
  constexpr int kRefusing = 1;
  const int32_t badIndex = static_cast<int32_t>(s.experts) + 7;
  std::string text;  // what the refusing check says
  switch (what) {
    case Refusal::kDispatch:
      text = "more than maxNumTokens";
      break;
    case Refusal::kCombine:
      text = "expertY must be bf16, fp16 or fp32";
      break;
    case Refusal::kDeviceIndex:
      text = "expert index " + std::to_string(badIndex);
      break;
  }
  if (what == Refusal::kCombine) {
    a2a->dispatch(dev.dispatch);
    a2a->synchronize();
  }
  if (what == Refusal::kDeviceIndex && rank == kRefusing) {
    ASSERT_EQ(
        cudaMemcpy(static_cast<int32_t*>(dev.indices.get()) + 2 * s.topK + 1, &badIndex, 4, cudaMemcpyHostToDevice),
        cudaSuccess);
    a2a->dispatch(dev.dispatch);
  }
  if (rank == kRefusing) {
    try {
      if (what == Refusal::kDispatch) {
        DispatchArgs bad = dev.dispatch;
        bad.x.shape[0] = s.maxTokens + 1;
        a2a->dispatch(bad);
      } else if (what == Refusal::kCombine) {
        CombineArgs bad = dev.combine;
        bad.expertY.dtype = DType::kI32;
        a2a->combine(bad);
      } else {
        a2a->synchronize();
      }
      ADD_FAILURE() << "rank 1: the bad call was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), what == Refusal::kDeviceIndex ? ErrorCode::kDeviceError : ErrorCode::kInvalidArgument)
          << e.what();
      EXPECT_NE(e.message().find(text), std::string::npos) << e.what();
    }
  } else {
    const auto start = std::chrono::steady_clock::now();
    bool threw = false;
    try {
      if (what == Refusal::kDispatch) {
        a2a->dispatch(dev.dispatch);
      } else if (what == Refusal::kCombine) {
        a2a->combine(dev.combine);
      } else {
        // The bad entry is skipped and rank 1's kernels stop at their next wait: the error may come in the dispatch
        // already, else in the combine.
        a2a->dispatch(dev.dispatch);
        a2a->synchronize();
        a2a->combine(dev.combine);
      }
      a2a->synchronize();
    } catch (const Error& e) {
      threw = true;
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      std::printf("[ timing ] %s rank %d: error %.1f ms after its call (rank 1 failed): %s\n", backend.c_str(), rank,
                  ms, e.what());
      std::fflush(stdout);
      EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
      EXPECT_NE(e.message().find("rank 1 "), std::string::npos) << e.what();
      EXPECT_NE(e.message().find(text), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("destroy it and create a new one"), std::string::npos) << e.what();
      EXPECT_LT(ms, static_cast<double>(withinMs)) << "the error came too late: " << e.what();
    }
    EXPECT_TRUE(threw) << "no error on rank " << rank << " after rank 1's call was refused";
    // The object is lost (its kernels gave the round up): every later call says so.
    EXPECT_THROW(a2a->synchronize(), Error);
  }
  bootstrap.barrier();
}

void peerRefusesOnRanks(int world, Scenario s, const std::string& backend, Refusal what,
                        const test::RunOptions& options) {
  test::ScopedEnv timeout({{"EPCOMM_TIMEOUT_MS", "10000"}});  // read once per process, in the children
  s.experts = 8 * static_cast<uint32_t>(world);
  test::RunResult result = test::runRanks(
      world, [&](int rank, Bootstrap& bootstrap) { peerRefuses(s, rank, bootstrap, backend, what); }, options);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace gputest
}  // namespace epcomm
