// Several objects in one set of processes, one after the other and side by side: each is created, used eagerly (the
// same arguments every round, so nvlink launches its kernels through its cached graphs from the second call), captured
// into a CUDA graph and replayed with new inputs, then destroyed: some before the graph that captured them, some after
// it, and the next object is created while the last one's graph or the last object itself still exists (which then
// runs one more round). Objects differ in shape, layout, dtypes and experts: on nvlink one of 512 experts (kernels
// above 48 KiB of shared memory) is followed by one of 384 while it lives. Every round is checked against the CPU
// reference. Backends nvlink, proxy and nvshmem; W = 1 and W = 2 (both ranks on one GPU when there is one). Without
// a GPU (or the backend, or proxy's libfabric provider) every case reports skipped.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>

#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace gputest {
namespace {

constexpr int kObjects = 6;

// Object k's scenario. Not ragged: m is part of a captured call, and equal arguments every round are what an engine
// passes (the token count varies through the device boundM).
Scenario variant(const std::string& backend, uint32_t world, int k) {
  Scenario s = scenarioFor(backend, world);
  s.ragged = false;
  s.deviceBound = true;
  s.seed = 100 + k;
  switch (k) {
    case 1:
      s.layout = Layout::kPacked;
      s.padding = 8;
      s.masked = true;
      s.hidden = 512;
      break;
    case 2:
    case 3:
      if (backend == "nvlink") {
        // More than 256 tokens: 512-thread blocks, whose routing tables take 132 B per expert: 66 KiB, then 49.5 KiB.
        // Packed: the batched outputs would hold maxTokens rows for each of the hundreds of local experts.
        s.experts = k == 2 ? 512 : 384;
        s.topK = 8;
        s.maxTokens = 300;
        s.hidden = 128;
        s.layout = Layout::kPacked;
      } else {
        s.experts = 8 * world;
        s.topK = 6;
        s.maxTokens = 64;
      }
      s.masked = true;
      break;
    case 4:
      s.xType = DType::kFp8E4M3;
      s.scales = true;
      s.accumulate = true;
      s.hidden = 1024;
      break;
    case 5:
      s.yType = DType::kF32;
      s.outType = DType::kF16;
      s.indexType = DType::kI64;
      s.dp = world;
      s.masked = true;
      break;
    default:
      break;
  }
  return s;
}

CallMode modeOf(int k) { return k % 3 == 0 ? CallMode::kFused : k % 3 == 1 ? CallMode::kSplit : CallMode::kMixed; }

struct Live {
  Scenario s;
  CallMode mode = CallMode::kFused;
  std::unique_ptr<AllToAll> a2a;
  DeviceTensors dev;
};

// One eager round of `o` with inputs `seed`, checked. "" or what failed.
std::string eagerRound(Live& o, uint32_t rank, cudaStream_t stream, DeviceBuffer& scratch, uint64_t seed) {
  return checkedRound(*o.a2a, o.s, rank, o.dev, o.mode, stream, scratch, seed);
}

class GpuLifetime : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(GpuLifetime, ObjectsCreatedCapturedReplayedAndDestroyedInOneProcess) {
  const std::string backend = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  const std::string why = whyNotRunnable(backend);
  if (!why.empty()) GTEST_SKIP() << why;
  BackendEnv env(backend);
  test::RunOptions o;
  o.deadlineMs = 300000;
  test::RunResult result = test::runRanks(
      world,
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        useRankDevice(r);
        Stream stream;
        DeviceBuffer scratch(1 << 16);
        std::unique_ptr<Live> previous;              // alive while the next object is made and used
        std::unique_ptr<CapturedRound> orphanGraph;  // outlived its object; destroyed after the next one exists
        for (int k = 0; k < kObjects; ++k) {
          auto cur = std::make_unique<Live>();
          cur->s = variant(backend, static_cast<uint32_t>(world), k);
          cur->mode = modeOf(k);
          cur->a2a = createAllToAll(scenarioConfig(cur->s, rank), bootstrap, backend);
          allocateDevice(cur->s, rank, cur->dev);
          orphanGraph.reset();
          const std::string what = backend + " object " + std::to_string(k);
          for (int round = 0; round < 3; ++round) {
            const std::string err = eagerRound(*cur, rank, stream.get(), scratch, 1000 * k + round);
            ASSERT_TRUE(err.empty()) << what << " eager round " << round << ":\n" << err;
          }
          if (previous) {
            // Created before this one, still alive: its calls still work (nvlink: its kernels' shared-memory limit).
            const std::string err = eagerRound(*previous, rank, stream.get(), scratch, 1000 * k + 500);
            ASSERT_TRUE(err.empty()) << backend << " object " << k - 1 << " after object " << k << " was created:\n"
                                     << err;
            previous.reset();
          }
          auto graph = std::make_unique<CapturedRound>(*cur->a2a, cur->dev, cur->mode, rank, stream.get(), scratch);
          for (int replay = 0; replay < 4; ++replay) {
            Round rd(cur->s, 1000 * k + 100 + replay);
            rd.upload(rank, cur->dev);
            graph->replay(stream.get());
            finishRound(*cur->a2a, stream.get());
            const std::string err = rd.check(rank, cur->dev);
            ASSERT_TRUE(err.empty()) << what << " graph replay " << replay << ":\n" << err;
          }
          if (k % 2 == 1) {
            orphanGraph = std::move(graph);  // the object goes first, its graph after the next object was made
            cur.reset();
          } else {
            graph.reset();
            previous = std::move(cur);
          }
        }
        previous.reset();
        orphanGraph.reset();
      },
      o);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Backends, GpuLifetime,
                         ::testing::Combine(::testing::Values("nvlink", "proxy", "nvshmem"), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "W" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace gputest
}  // namespace epcomm
