// Churn on the nvlink backend: many objects created and destroyed in one set of processes, two in flight at a time
// (the older one's round runs after the newer one was created), each round checked against the CPU reference. With no
// object alive and every rank past its teardown, the processes' open file descriptors, threads, heap in use and the
// GPU's free memory after the last object are those after the first ten. W = 2, both ranks on one GPU when there is
// one. Each object's second round repeats the first one's arguments, so it also makes and frees cached launch graphs.
//
//   GPU_CHURN_OBJECTS  objects created (default 40; the full run is 2000)
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {
namespace {

struct Object {
  std::unique_ptr<AllToAll> a2a;
  DeviceTensors dev;
};

TEST(NvlinkChurn, ObjectsComeAndGoTwoInFlight) {
  const std::string why = whyNotRunnable("nvlink");
  if (!why.empty()) GTEST_SKIP() << why;
  const uint32_t n = static_cast<uint32_t>(test::envNumber("GPU_CHURN_OBJECTS", 40));
  ASSERT_GE(n, 12u) << "GPU_CHURN_OBJECTS must be at least 12 (the first ten are the baseline)";
  Scenario sc = scenarioFor("nvlink", 2);
  sc.experts = 8;
  sc.topK = 3;
  sc.maxTokens = 8;
  sc.hidden = 128;
  sc.masked = true;
  sc.ragged = false;  // equal arguments in an object's two rounds: the second launches through a cached graph
  test::RunOptions o;
  o.deadlineMs = 120000 + static_cast<int64_t>(n) * 500;
  const auto start = std::chrono::steady_clock::now();
  test::RunResult result = test::runRanks(
      2,
      [&](int r, Bootstrap& bootstrap) {
        // One malloc arena, before any thread starts: glibc otherwise gives threads arenas of their own, which
        // mallinfo2's in-use count would miss.
        mallopt(M_ARENA_MAX, 1);
        const uint32_t rank = static_cast<uint32_t>(r);
        useRankDevice(r);
        Stream stream;
        DeviceBuffer scratch(1 << 16);
        // Each object's tensors come and go with it, like its buffers: a leak of either shows.
        std::unique_ptr<Object> older;
        auto round = [&](Object& x, uint64_t seed) {
          return checkedRound(*x.a2a, sc, rank, x.dev, CallMode::kFused, stream.get(), scratch, seed);
        };
        // No object alive, every rank past its teardown (the barrier), and nobody allocating until the second one.
        auto quiescent = [&] {
          older.reset();
          bootstrap.barrier();
          const Usage u = usage();
          bootstrap.barrier();
          return u;
        };
        Usage early, mid;
        for (uint32_t i = 0; i < n; ++i) {
          auto newer = std::make_unique<Object>();
          newer->a2a = createAllToAll(scenarioConfig(sc, rank), bootstrap, "nvlink");
          allocateDevice(sc, rank, newer->dev);
          // Both in flight: the older one's round runs after the newer one was created.
          if (older) {
            const std::string err = round(*older, 2 * i);
            ASSERT_TRUE(err.empty()) << "object " << i - 1 << " (second round):\n" << err;
          }
          const std::string err = round(*newer, 2 * i + 1);
          ASSERT_TRUE(err.empty()) << "object " << i << " (first round):\n" << err;
          older = std::move(newer);  // the one before is destroyed here
          if (i == 9) early = quiescent();
          if (i == n / 2) mid = quiescent();
        }
        const Usage late = quiescent();
        test::expectNoGrowth(early, mid, late, n);
        EXPECT_EQ(late.gpuFreeBytes, early.gpuFreeBytes)
            << "free GPU memory after 10 objects vs after " << n << " (both ranks' objects, tensors and mappings)";
        if (rank == 0) {
          std::printf(
              "nvlink churn: %u objects, fds %d -> %d, threads %d -> %d, heap in use %lld -> %lld -> %lld B, GPU free "
              "%lld -> %lld -> %lld B\n",
              n, early.fds, late.fds, early.threads, late.threads, static_cast<long long>(early.heapBytes),
              static_cast<long long>(mid.heapBytes), static_cast<long long>(late.heapBytes),
              static_cast<long long>(early.gpuFreeBytes), static_cast<long long>(mid.gpuFreeBytes),
              static_cast<long long>(late.gpuFreeBytes));
        }
      },
      o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("nvlink churn: %u objects created and destroyed (two in flight) in %.1f s\n", n, s);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace gputest
}  // namespace epcomm
