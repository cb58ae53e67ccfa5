// A rank killed (SIGKILL) in the middle of a round on the GPU backends, W = 3 (ranks on GPU r % devices, so all three
// share a one-GPU machine): before its dispatch while the survivors' dispatch kernels wait for it, between its dispatch
// and its combine while the survivors' combine kernels wait for it, or with its own dispatch kernel just launched.
// Every survivor must raise a timeout naming the dead rank within EPCOMM_TIMEOUT_MS + 1 s (proxy: or the failed write
// to it, kFabric, as its channel reports), the object must refuse further use, and the process must stay usable: the
// survivors destroy the object, build a new bootstrap among themselves (W = 2, new port) and new objects on it, whose
// rounds match the CPU reference. cudaMemGetInfo: the survivors' teardown gives back their share of the dead object's
// device memory, and the recovery objects leave the free memory where they found it.
//
// nvshmem: NVSHMEM is initialised once per process with the world it started with, so a new nvshmem object among the
// survivors is refused (kUnavailable, naming the PE and world it has); the survivors go on with an nvlink object in the
// same processes. The dead world's NVSHMEM heap and the dead object's symmetric buffers (whose collective free needs
// every PE) stay allocated until the process exits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <regex>
#include <string>
#include <tuple>

#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {
namespace {

constexpr int64_t kTimeoutMs = 2000;
constexpr int64_t kMiB = 1 << 20;

enum class Phase { kDispatch, kCombine, kDispatchInFlight };

const char* phaseName(Phase p) {
  return p == Phase::kDispatch ? "MidDispatch" : p == Phase::kCombine ? "MidCombine" : "WithItsDispatchInFlight";
}

// The dead world's object: every rank sends to every other one (no rank without tokens), tens of MiB of device
// buffers per rank on nvlink, so that their release shows in cudaMemGetInfo.
Scenario faultScenario(const std::string& backend) {
  Scenario s = scenarioFor(backend, 3);
  s.experts = 12;
  s.topK = 4;
  s.maxTokens = 512;
  s.hidden = 4096;
  s.ragged = false;
  return s;
}

Scenario recoveryScenario(const std::string& backend) {
  Scenario s = scenarioFor(backend, 2);
  s.experts = 8;
  s.topK = 3;
  s.maxTokens = 64;
  s.hidden = 512;
  s.masked = true;
  return s;
}

// Rank 0 reads the device's free memory while no rank of `b` allocates (a barrier on each side).
int64_t measureFree(Bootstrap& b) {
  b.barrier();
  const int64_t f = b.rank() == 0 ? settledGpuFreeBytes() : 0;
  b.barrier();
  return f;
}

class GpuFaults : public ::testing::TestWithParam<std::tuple<std::string, Phase>> {};

TEST_P(GpuFaults, SurvivorsNameTheDeadRankAndRebuildWithoutIt) {
  const std::string backend = std::get<0>(GetParam());
  const Phase phase = std::get<1>(GetParam());
  const std::string why = whyNotRunnable(backend);
  if (!why.empty()) GTEST_SKIP() << why;
  // The proxy backend over tcp, as the host backend's fault test (a dead peer's connection fails there).
  if (backend == "proxy" && !test::providerAvailable("tcp")) GTEST_SKIP() << "libfabric provider 'tcp' is not usable";
  const std::string recoveryBackend = backend == "nvshmem" ? "nvlink" : backend;
  if (recoveryBackend != backend && !whyNotRunnable(recoveryBackend).empty()) {
    GTEST_SKIP() << "the survivors go on with " << recoveryBackend << ": " << whyNotRunnable(recoveryBackend);
  }
  test::ScopedEnv timeout({{"EPCOMM_TIMEOUT_MS", "2000"}});  // read once per process, in the children
  BackendEnv env(backend, "tcp");
  const std::string survivorsAddress = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  test::RunOptions o;
  o.deadlineMs = 240000;
  test::RunResult result = test::runRanks(
      3,
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        useRankDevice(r);
        Stream stream;
        DeviceBuffer scratch(1 << 16);
        const Scenario s3 = faultScenario(backend), s2 = recoveryScenario(recoveryBackend);
        DeviceTensors d3, d2;  // every tensor of the test, before anything is measured
        allocateDevice(s3, rank, d3);
        if (rank < 2) allocateDevice(s2, rank, d2);
        {
          // First use costs (modules, the runtime's pools, NVSHMEM's heap) are paid here, once.
          auto warm = createAllToAll(scenarioConfig(s3, rank), bootstrap, backend);
          ASSERT_EQ(checkedRound(*warm, s3, rank, d3, CallMode::kFused, stream.get(), scratch, 1), "");
        }
        const int64_t beforeObject = measureFree(bootstrap);
        std::unique_ptr<AllToAll> a2a = createAllToAll(scenarioConfig(s3, rank), bootstrap, backend);
        const int64_t withObject = measureFree(bootstrap);
        ASSERT_EQ(checkedRound(*a2a, s3, rank, d3, CallMode::kFused, stream.get(), scratch, 2), "");

        // The round rank 2 does not finish.
        Round interrupted(s3, 3);
        interrupted.upload(rank, d3);
        d3.dispatch.stream = d3.combine.stream = stream.get();
        std::chrono::steady_clock::time_point start;
        if (phase == Phase::kDispatch) {
          if (rank != 2) a2a->dispatch(d3.dispatch);  // the survivors' kernels wait for rank 2's tokens
          bootstrap.barrier();
          if (rank == 2) raise(SIGKILL);
          start = std::chrono::steady_clock::now();
        } else if (phase == Phase::kCombine) {
          a2a->dispatch(d3.dispatch);
          finishRound(*a2a, stream.get());
          if (rank != 2) a2a->combine(d3.combine);  // ... for rank 2's weights and expert outputs
          bootstrap.barrier();
          if (rank == 2) raise(SIGKILL);
          start = std::chrono::steady_clock::now();
        } else {
          bootstrap.barrier();
          a2a->dispatch(d3.dispatch);
          if (rank == 2) {
            usleep(200);  // its kernel may have started, or not
            raise(SIGKILL);
          }
          start = std::chrono::steady_clock::now();
        }
        try {
          if (phase == Phase::kDispatch || phase == Phase::kDispatchInFlight) a2a->combine(d3.combine);
          finishRound(*a2a, stream.get());
          ADD_FAILURE() << "the round completed without rank 2";
        } catch (const Error& e) {
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          std::printf("%s %s: rank %u raised after %.0f ms: %s\n", backend.c_str(), phaseName(phase), rank, s * 1e3,
                      e.what());
          const bool proxyCodes = backend == "proxy" && e.code() == ErrorCode::kFabric;
          if (phase == Phase::kDispatchInFlight) {
            // Rank 2 may have sent some of its dispatch: a survivor may then fail later, in its combine, or name the
            // other survivor, which gave the round up.
            EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kFabric ||
                        e.code() == ErrorCode::kPeerFailure)
                << e.what();
            EXPECT_LT(s, 2 * kTimeoutMs / 1000.0 + 1.0) << e.what();
          } else {
            EXPECT_TRUE(e.code() == ErrorCode::kTimeout || proxyCodes) << e.what();
            EXPECT_TRUE(std::regex_search(e.message(), std::regex("ranks? ([0-9]+, )*2([^0-9]|$)"))) << e.what();
            EXPECT_NE(e.message().find(phase == Phase::kDispatch ? "dispatch" : "combine"), std::string::npos)
                << e.what();
            EXPECT_LT(s, kTimeoutMs / 1000.0 + 1.0) << e.what();
          }
        }
        EXPECT_THROW(a2a->synchronize(), Error) << "the object went on after a peer died";

        // A smaller world, a new bootstrap, the same processes.
        std::unique_ptr<Bootstrap> fresh = createTcpBootstrap(survivorsAddress, r, 2, 10000);
        const int64_t beforeTeardown = measureFree(*fresh);
        a2a.reset();
        const int64_t afterTeardown = measureFree(*fresh);
        if (backend == "nvshmem") {
          try {
            auto again = createAllToAll(scenarioConfig(s2, rank), *fresh, "nvshmem");
            ADD_FAILURE() << "a second NVSHMEM world in the process was accepted";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
            EXPECT_NE(e.message().find("once per process"), std::string::npos) << e.what();
          }
        }
        int64_t afterRecovery[2] = {0, 0};
        for (int cycle = 0; cycle < 2; ++cycle) {
          {
            auto next = createAllToAll(scenarioConfig(s2, rank), *fresh, recoveryBackend);
            for (int round = 0; round < (cycle == 0 ? 5 : 2); ++round) {
              const std::string err =
                  checkedRound(*next, s2, rank, d2, CallMode::kFused, stream.get(), scratch, 10 * cycle + round);
              ASSERT_TRUE(err.empty()) << recoveryBackend << " among the survivors, object " << cycle << " round "
                                       << round << ":\n"
                                       << err;
            }
          }
          afterRecovery[cycle] = measureFree(*fresh);
        }
        if (rank != 0) return;
        const int64_t objectBytes = beforeObject - withObject;  // the dead world's object, every rank's share
        const int64_t freed = afterTeardown - beforeTeardown;
        std::printf(
            "%s %s: GPU free %lld MiB before the object, %lld MiB with it (3 ranks); survivors' teardown gave back "
            "%lld MiB; after the recovery objects %lld and %lld MiB (teardown left %lld MiB)\n",
            backend.c_str(), phaseName(phase), static_cast<long long>(beforeObject / kMiB),
            static_cast<long long>(withObject / kMiB), static_cast<long long>(freed / kMiB),
            static_cast<long long>(afterRecovery[0] / kMiB), static_cast<long long>(afterRecovery[1] / kMiB),
            static_cast<long long>(afterTeardown / kMiB));
        if (objectBytes >= 16 * kMiB) {
          EXPECT_GE(freed, objectBytes * 2 / 3 * 9 / 10 - 4 * kMiB)
              << "the survivors' teardown gave back " << freed << " bytes of their ~" << objectBytes * 2 / 3;
        }
        // nvshmem's survivors go on with nvlink, whose first object pays that backend's first use once.
        if (recoveryBackend == backend) {
          EXPECT_EQ(afterRecovery[0], afterTeardown) << "the first recovery object kept device memory";
        }
        EXPECT_EQ(afterRecovery[1], afterRecovery[0]) << "the second recovery object kept device memory";
      },
      o);
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.summary();
  EXPECT_TRUE(result.ranks[1].ok()) << result.summary();
  EXPECT_EQ(result.ranks[2].signal, SIGKILL) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(
    Backends, GpuFaults,
    ::testing::Combine(::testing::Values("nvlink", "proxy", "nvshmem"),
                       ::testing::Values(Phase::kDispatch, Phase::kCombine, Phase::kDispatchInFlight)),
    [](const auto& info) { return std::get<0>(info.param) + std::string(phaseName(std::get<1>(info.param))); });

}  // namespace
}  // namespace gputest
}  // namespace epcomm
