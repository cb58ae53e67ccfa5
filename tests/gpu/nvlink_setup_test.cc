// The nvlink backend's setup gives back everything it took when it fails after its allocations. Its own test binary,
// RUN_SERIAL under ctest (tests/gpu/CMakeLists.txt): it compares the device's free memory, which any other test running
// at the same time would change.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/backends.hpp"
#include "epcomm/error.hpp"
#include "gpu_cases.hpp"
#include "gpu_harness.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// Setup that fails after its allocations: rank 1 joins the rendezvous but never creates its object, so rank 0's
// constructor, past its device and pinned allocations and its IPC handle, waits in the exchange of handles until the
// bootstrap's timeout and throws. (backends::createNvlink is what the factory calls once every rank said it can run
// nvlink: through createAllToAll the factory's own exchange would be the one to time out, before any allocation.)
// Every attempt must give back what it took. Rank 0's free device memory is measured after a first failed attempt,
// which also pays what the first use costs once (the runtime's pools, module loading), and must be the same after
// three more: the object's buffers (~300 MB here, the region most of it) would show, were any of them kept.
TEST(NvlinkGpu, W2SetupFailureFreesEverything) {
  if (gputest::gpuCount() == 0) GTEST_SKIP() << "no CUDA device";  // one is enough: rank 1 never touches a GPU
  test::RunOptions o;
  o.deadlineMs = 240000;
  o.bootstrapTimeoutMs = 1500;
  test::RunResult result = test::runRanks(
      2,
      [](int rank, Bootstrap& bootstrap) {
        if (rank == 1) {
          // Connected, silent: rank 0 times out waiting for its handle (well within this sleep).
          std::this_thread::sleep_for(std::chrono::seconds(6));
          return;
        }
        CUDA_OK(cudaSetDevice(0));
        CUDA_OK(cudaFree(nullptr));  // the context
        gputest::Scenario base;
        base.world = 2;
        gputest::Scenario s = gputest::decodeShape(base);
        s.maxTokens = 4096;
        const Config config = gputest::scenarioConfig(s, 0);
        uint64_t planned = 0;
        for (const PlannedBuffer& b : backends::planNvlink(config)) planned += b.bytes;
        ASSERT_GT(planned, 256ull << 20);
        auto freeBytes = [] {
          size_t freeB = 0, totalB = 0;
          EXPECT_EQ(cudaMemGetInfo(&freeB, &totalB), cudaSuccess);
          return freeB;
        };
        const size_t before = freeBytes();
        std::vector<size_t> after;
        for (int attempt = 0; attempt < 4; ++attempt) {
          try {
            std::unique_ptr<AllToAll> a2a = backends::createNvlink(config, bootstrap);
            ADD_FAILURE() << "attempt " << attempt << ": setup succeeded although rank 1 never joined";
          } catch (const Error& e) {
            // The first attempt times out in the exchange; the later ones meet the failed bootstrap at once.
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
            EXPECT_NE(e.message().find("rank 1"), std::string::npos) << e.what();
          }
          after.push_back(freeBytes());
        }
        for (int attempt = 1; attempt < 4; ++attempt) {
          EXPECT_EQ(after[attempt], after[0])
              << "attempt " << attempt << " kept " << static_cast<int64_t>(after[0] - after[attempt])
              << " bytes of device memory (" << planned << " bytes planned per object; the first attempt took "
              << static_cast<int64_t>(before - after[0]) << " bytes once)";
        }
      },
      o);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace epcomm
