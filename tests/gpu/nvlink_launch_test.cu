// The nvlink backend's launch cache (EPCOMM_NVLINK_GRAPH_LAUNCH): repeated arguments run as cached one-node graphs,
// new ones and calls on a capturing stream launch plainly, and every launch does its work exactly once.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "backends/nvlink/nvlink_launch.hpp"

namespace epcomm {
namespace nvlink {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

struct AddArgs {
  int* out;
  int value;
};

__global__ void addKernel(const AddArgs a) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.out += a.value;
}

class LaunchCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
    CUDA_OK(cudaMalloc(&out_, sizeof(int)));
    CUDA_OK(cudaMemset(out_, 0, sizeof(int)));
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (out_ != nullptr) cudaFree(out_);
  }
  int result() {
    int v = -1;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(&v, out_, sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  KernelLaunch add() const { return KernelLaunch{reinterpret_cast<const void*>(addKernel), 2, 64, 0}; }

  int* out_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

TEST_F(LaunchCacheTest, RepeatedArgumentsRunAsGraphsNewOnesPlainly) {
  GraphLaunchCache cache(true);
  const AddArgs one{out_, 1};
  // First sighting: plain; the second makes the graph; the rest reuse it.
  for (int i = 0; i < 5; ++i) ASSERT_EQ(cache.launch(add(), &one, sizeof one, stream_), 0);
  EXPECT_EQ(cache.graphLaunches(), 4u);
  const AddArgs hundred{out_, 100};
  ASSERT_EQ(cache.launch(add(), &hundred, sizeof hundred, stream_), 0);
  EXPECT_EQ(cache.graphLaunches(), 4u);
  EXPECT_EQ(result(), 105);
}

TEST_F(LaunchCacheTest, CapturingStreamGetsAPlainKernelNode) {
  GraphLaunchCache cache(true);
  const AddArgs one{out_, 1};
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cache.launch(add(), &one, sizeof one, stream_), 0);
  const uint64_t before = cache.graphLaunches();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  ASSERT_EQ(cache.launch(add(), &one, sizeof one, stream_), 0);
  CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  EXPECT_EQ(cache.graphLaunches(), before);
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 1u);
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream_));
  CUDA_OK(cudaGraphLaunch(exec, stream_));
  EXPECT_EQ(result(), 5);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(LaunchCacheTest, DisabledCacheLaunchesPlainly) {
  GraphLaunchCache cache(false);
  const AddArgs one{out_, 1};
  for (int i = 0; i < 4; ++i) ASSERT_EQ(cache.launch(add(), &one, sizeof one, stream_), 0);
  EXPECT_EQ(cache.graphLaunches(), 0u);
  EXPECT_EQ(result(), 4);
}

TEST_F(LaunchCacheTest, ManyDistinctArgumentsEvictTheLeastRecentlyUsed) {
  GraphLaunchCache cache(true);
  // 40 argument sets, each launched three times (plain, instantiate, hit): more than the 32 graphs kept.
  uint64_t expectGraphs = 0;
  for (int v = 1; v <= 40; ++v) {
    const AddArgs a{out_, v};
    for (int i = 0; i < 3; ++i) ASSERT_EQ(cache.launch(add(), &a, sizeof a, stream_), 0);
    expectGraphs += 2;
  }
  EXPECT_EQ(cache.graphLaunches(), expectGraphs);
  EXPECT_EQ(result(), 3 * (40 * 41 / 2));
}

// Calls that alternate between a few argument sets (an engine's dispatch and combine) are found among the recent
// entries; across evictions, which move the entries, each launch still runs its own arguments.
TEST_F(LaunchCacheTest, AlternatingArgumentsAcrossEvictionsRunTheirOwnWork) {
  GraphLaunchCache cache(true);
  const AddArgs one{out_, 1}, ten{out_, 10};
  int expect = 0;
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(cache.launch(add(), &one, sizeof one, stream_), 0);
    ASSERT_EQ(cache.launch(add(), &ten, sizeof ten, stream_), 0);
    expect += 11;
  }
  EXPECT_EQ(cache.graphLaunches(), 10u);  // each set: plain, then a graph from the second sighting on
  // 40 more sets, two launches each (the second instantiates), between repeats of `one` and `ten`: evictions.
  for (int v = 100; v < 140; ++v) {
    const AddArgs a{out_, v};
    ASSERT_EQ(cache.launch(add(), &a, sizeof a, stream_), 0);
    ASSERT_EQ(cache.launch(add(), &one, sizeof one, stream_), 0);
    ASSERT_EQ(cache.launch(add(), &a, sizeof a, stream_), 0);
    ASSERT_EQ(cache.launch(add(), &ten, sizeof ten, stream_), 0);
    expect += 2 * v + 11;
  }
  EXPECT_EQ(result(), expect);
}

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
