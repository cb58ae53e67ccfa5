// The MPI adapter under mpiexec (4 ranks): every rank runs the same tests; the exit status is non-zero on every
// rank if any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/error.hpp"
#include "epcomm/mpi_bootstrap.hpp"

namespace epcomm {
namespace {

uint8_t pattern(int rank, size_t i, size_t size) { return static_cast<uint8_t>(rank * 131 + i * 7 + size); }

TEST(MpiBootstrap, AllGatherOfSeveralSizes) {
  std::unique_ptr<Bootstrap> bs = createMpiBootstrap(MPI_COMM_WORLD, 20000);
  const int rank = bs->rank(), world = bs->worldSize();
  ASSERT_GE(world, 2) << "run under mpiexec -n 4";
  for (size_t size : {size_t{0}, size_t{1}, size_t{7}, size_t{1} << 20}) {
    std::vector<uint8_t> mine(size);
    for (size_t i = 0; i < size; ++i) mine[i] = pattern(rank, i, size);
    std::vector<uint8_t> all(size * world, 0xEE);
    bs->allGather(mine.data(), all.data(), size);
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < size; ++i) {
        ASSERT_EQ(all[r * size + i], pattern(r, i, size)) << "size " << size << " rank " << r << " byte " << i;
      }
    }
    std::vector<uint8_t> inPlace(size * world, 0);
    if (size > 0) std::memcpy(inPlace.data() + rank * size, mine.data(), size);
    bs->allGather(inPlace.data() + rank * size, inPlace.data(), size);
    EXPECT_EQ(inPlace, all) << "in-place allGather of " << size << " bytes";
  }
}

TEST(MpiBootstrap, BroadcastFromEveryRootAndBarrier) {
  std::unique_ptr<Bootstrap> bs = createMpiBootstrap(MPI_COMM_WORLD, 20000);
  for (int round = 0; round < 20; ++round) {
    for (int root = 0; root < bs->worldSize(); ++root) {
      std::vector<uint8_t> data(100 + root, 0);
      if (bs->rank() == root) {
        for (size_t i = 0; i < data.size(); ++i) data[i] = pattern(root, i, round);
      }
      bs->broadcast(data.data(), data.size(), root);
      for (size_t i = 0; i < data.size(); ++i) ASSERT_EQ(data[i], pattern(root, i, round)) << "root " << root;
    }
    bs->barrier();
  }
  try {
    bs->broadcast(nullptr, 0, bs->worldSize());
    ADD_FAILURE() << "a root outside the world was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  }
}

TEST(MpiBootstrap, BarrierWaitsForTheLastRank) {
  std::unique_ptr<Bootstrap> bs = createMpiBootstrap(MPI_COMM_WORLD, 20000);
  bs->barrier();
  auto start = std::chrono::steady_clock::now();
  if (bs->rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  bs->barrier();
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(ms, 450) << "rank " << bs->rank() << " left the barrier before rank 1 entered";
}

TEST(MpiBootstrap, LateRankGivesTimeoutNotHang) {
  std::unique_ptr<Bootstrap> bs = createMpiBootstrap(MPI_COMM_WORLD, 2000);
  int value = bs->rank();
  std::vector<int> all(bs->worldSize());
  if (bs->rank() == 1) {
    // Enters long after the others gave up; it completes the collective they left posted.
    std::this_thread::sleep_for(std::chrono::milliseconds(5000));
    bs->allGather(&value, all.data(), sizeof(int));
    return;
  }
  try {
    bs->allGather(&value, all.data(), sizeof(int));
    ADD_FAILURE() << "rank " << bs->rank() << ": no timeout although rank 1 was 5 s late";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("waited 2000 ms in MPI allGather #1 (4 bytes)"), std::string::npos) << e.what();
  }
  try {
    bs->barrier();
    ADD_FAILURE() << "a bootstrap that timed out was used again";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("unusable after an earlier error"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epcomm

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  // Tests end out of step (LateRankGivesTimeoutNotHang); meet again before agreeing on the outcome.
  MPI_Barrier(MPI_COMM_WORLD);
  int anyFailed = 0;
  MPI_Allreduce(&failed, &anyFailed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return anyFailed;
}
