// The TCP bootstrap between real processes over 127.0.0.1: collectives, and every failure a job can meet
// (a rank that dies, one that never starts, one that is late, misconfigured ranks, collectives out of order).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace {

using test::RunOptions;
using test::runProcesses;
using test::runRanks;
using test::RunResult;

constexpr int kWorld = 4;
// Generous: a loaded 2-core machine runs 4 ranks plus other builds; every expected error must still come from the
// bootstrap and not from the harness deadline.
constexpr int64_t kTimeoutMs = 4000;

int64_t msSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
}

uint8_t pattern(int rank, size_t i, size_t size) { return static_cast<uint8_t>(rank * 131 + i * 7 + size); }

// Runs `call`, which must throw epcomm::Error; checks the code and that the message contains `needle`.
template <typename F>
void expectError(F&& call, ErrorCode code, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected an epcomm::Error containing '" << needle << "', got none";
  } catch (const Error& e) {
    EXPECT_EQ(errorCodeName(e.code()), std::string(errorCodeName(code))) << e.what();
    EXPECT_NE(e.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
  }
}

TEST(TcpBootstrap, AllGatherOfSeveralSizes) {
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap& bs) {
        EXPECT_EQ(bs.rank(), rank);
        EXPECT_EQ(bs.worldSize(), kWorld);
        for (size_t size : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{1} << 20}) {
          std::vector<uint8_t> mine(size);
          for (size_t i = 0; i < size; ++i) mine[i] = pattern(rank, i, size);
          std::vector<uint8_t> all(size * kWorld, 0xEE);
          bs.allGather(mine.data(), all.data(), size);
          for (int r = 0; r < kWorld; ++r) {
            for (size_t i = 0; i < size; ++i) {
              if (all[r * size + i] != pattern(r, i, size)) {
                ADD_FAILURE() << "size " << size << ": rank " << rank << " sees byte " << i << " of rank " << r << " = "
                              << int(all[r * size + i]) << ", want " << int(pattern(r, i, size));
                return;
              }
            }
          }
          // In place: the send buffer is this rank's slot of the receive buffer.
          std::vector<uint8_t> inPlace(size * kWorld, 0);
          std::memcpy(inPlace.data() + rank * size, mine.data(), size);
          bs.allGather(inPlace.data() + rank * size, inPlace.data(), size);
          EXPECT_EQ(inPlace, all) << "in-place allGather of " << size << " bytes";
        }
      },
      RunOptions{kTimeoutMs, 120000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, AllGatherBlobsOfDifferentLengths) {
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap& bs) {
        // Rank r contributes r * 3 bytes (rank 0: an empty blob), each byte naming its rank and position.
        std::vector<uint8_t> mine(static_cast<size_t>(rank) * 3);
        for (size_t i = 0; i < mine.size(); ++i) mine[i] = pattern(rank, i, mine.size());
        const std::vector<std::vector<uint8_t>> all = allGatherBlobs(bs, mine);
        ASSERT_EQ(all.size(), static_cast<size_t>(kWorld));
        for (int r = 0; r < kWorld; ++r) {
          ASSERT_EQ(all[r].size(), static_cast<size_t>(r) * 3) << "blob of rank " << r;
          for (size_t i = 0; i < all[r].size(); ++i) EXPECT_EQ(all[r][i], pattern(r, i, all[r].size()));
        }
      },
      RunOptions{kTimeoutMs, 120000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, ManyRoundsOfBarrierBroadcastAllGather) {
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap& bs) {
        for (int round = 0; round < 40; ++round) {
          bs.barrier();
          for (int root = 0; root < kWorld; ++root) {
            size_t size = (round % 2 == 0) ? 8 : 3000 + root;
            std::vector<uint8_t> data(size, 0);
            if (rank == root) {
              for (size_t i = 0; i < size; ++i) data[i] = pattern(root, i, round);
            }
            bs.broadcast(data.data(), size, root);
            for (size_t i = 0; i < size; ++i) {
              if (data[i] != pattern(root, i, round)) {
                ADD_FAILURE() << "round " << round << ": broadcast from rank " << root << " arrived at rank " << rank
                              << " with byte " << i << " wrong";
                return;
              }
            }
          }
          int64_t mine = round * 1000 + rank;
          std::vector<int64_t> all(kWorld);
          bs.allGather(&mine, all.data(), sizeof(mine));
          for (int r = 0; r < kWorld; ++r) ASSERT_EQ(all[r], round * 1000 + r) << "round " << round;
        }
      },
      RunOptions{kTimeoutMs, 120000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, BarrierWaitsForTheLastRank) {
  static constexpr int kLateMs = 600;
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap& bs) {
        bs.barrier();  // Everyone starts the clock at about the same time.
        auto start = std::chrono::steady_clock::now();
        if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(kLateMs));
        bs.barrier();
        // Lower bound only: a barrier can never return before its last rank entered, however loaded the machine.
        EXPECT_GE(msSince(start), kLateMs - 50) << "rank " << rank << " left the barrier before rank 2 entered";
      },
      RunOptions{kTimeoutMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, RankThatDiesIsNamedByEveryOtherRank) {
  for (int dying : {3, 0}) {
    SCOPED_TRACE("dying rank " + std::to_string(dying));
    RunResult result = runRanks(
        kWorld,
        [dying](int rank, Bootstrap& bs) {
          bs.barrier();
          if (rank == dying) ::_exit(0);  // Crashes without any goodbye: the kernel closes its sockets.
          auto start = std::chrono::steady_clock::now();
          std::vector<int> all(kWorld);
          expectError([&] { bs.allGather(&rank, all.data(), sizeof(int)); }, ErrorCode::kBootstrap,
                      "rank " + std::to_string(dying) + " closed its connection during allGather #2");
          // The peer's death is detected at once, not by a timeout.
          EXPECT_LT(msSince(start), kTimeoutMs) << "rank " << rank;
          // Once broken, the bootstrap keeps reporting the first error instead of hanging or guessing.
          expectError([&] { bs.barrier(); }, ErrorCode::kBootstrap, "unusable after an earlier error");
        },
        RunOptions{kTimeoutMs, 60000});
    EXPECT_TRUE(result.allOk()) << result.summary();
  }
}

TEST(TcpBootstrap, RankThatNeverStartsIsNamedWithinTheTimeout) {
  std::string address = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  static constexpr int64_t kShortMs = 2500;
  RunResult result = runProcesses(
      kWorld,
      [&](int rank) {
        if (rank == 3) return;  // Never starts.
        auto start = std::chrono::steady_clock::now();
        expectError([&] { createTcpBootstrap(address, rank, kWorld, kShortMs); }, ErrorCode::kBootstrap,
                    "rank 0 waited 2500 ms for the rendezvous at " + address + ": rank 3 never joined");
        // Rank 0 gives up after one timeout; the others hear its diagnosis, all well before twice the timeout.
        EXPECT_LT(msSince(start), 2 * kShortMs) << "rank " << rank;
      },
      RunOptions{kShortMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, TwoMissingRanksAreBothNamed) {
  std::string address = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  RunResult result = runProcesses(
      kWorld,
      [&](int rank) {
        if (rank >= 2) return;
        expectError([&] { createTcpBootstrap(address, rank, kWorld, 2000); }, ErrorCode::kBootstrap,
                    "ranks 2, 3 never joined");
      },
      RunOptions{2000, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, MissingRootIsReportedByTheOthers) {
  std::string address = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  RunResult result = runProcesses(
      3,
      [&](int rank) {
        if (rank == 0) return;
        expectError([&] { createTcpBootstrap(address, rank, 3, 1500); }, ErrorCode::kBootstrap,
                    "rank " + std::to_string(rank) + " could not reach rank 0 at " + address + " within 1500 ms");
      },
      RunOptions{1500, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, LateRankTimesOutInACollective) {
  static constexpr int64_t kShortMs = 1500;
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap& bs) {
        int value = rank;
        std::vector<int> all(kWorld);
        if (rank == 1) {
          // Enters long after rank 0 gave up: hears rank 0's diagnosis instead of hanging.
          std::this_thread::sleep_for(std::chrono::milliseconds(kShortMs + 2500));
          expectError([&] { bs.allGather(&value, all.data(), sizeof(int)); }, ErrorCode::kTimeout,
                      "rank 1 never arrived");
          return;
        }
        auto start = std::chrono::steady_clock::now();
        expectError([&] { bs.allGather(&value, all.data(), sizeof(int)); }, ErrorCode::kTimeout,
                    "rank 0 waited 1500 ms in allGather #1 (4 bytes): rank 1 never arrived");
        EXPECT_LT(msSince(start), 2 * kShortMs + 2500) << "rank " << rank;
      },
      RunOptions{kShortMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, CollectivesOutOfOrderAreReported) {
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap& bs) {
        std::vector<int> all(kWorld);
        if (rank == 2) {
          expectError([&] { bs.barrier(); }, ErrorCode::kBootstrap,
                      "collective mismatch: rank 2 called barrier #1 while rank 0 called allGather #1 (4 bytes)");
        } else {
          expectError([&] { bs.allGather(&rank, all.data(), sizeof(int)); }, ErrorCode::kBootstrap,
                      "collective mismatch: rank 2 called barrier #1");
        }
      },
      RunOptions{kTimeoutMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, MismatchedSizesAreReported) {
  RunResult result = runRanks(
      3,
      [](int rank, Bootstrap& bs) {
        std::vector<char> buf(64);
        size_t bytes = rank == 1 ? 16 : 8;
        expectError([&] { bs.broadcast(buf.data(), bytes, 0); }, ErrorCode::kBootstrap,
                    "rank 1 called broadcast #1 (16 bytes from rank 0) while rank 0 called broadcast #1 (8 bytes");
      },
      RunOptions{kTimeoutMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, MismatchedWorldSizeIsReported) {
  std::string address = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  RunResult result = runProcesses(
      3,
      [&](int rank) {
        int world = rank == 2 ? 5 : 3;
        // Rank 1 may connect after rank 0 has already given up and closed its listener; then it can only say
        // that rank 0 is unreachable. Ranks 0 and 2 always know the cause.
        std::string needle = rank == 1 ? "" : "was started with world size 5 but rank 0 with world size 3";
        expectError([&] { createTcpBootstrap(address, rank, world, 2000); }, ErrorCode::kBootstrap, needle);
      },
      RunOptions{kTimeoutMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, DuplicateRankIsReported) {
  std::string address = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  RunResult result = runProcesses(
      3,
      [&](int process) {
        int rank = process == 2 ? 1 : process;  // Two processes claim rank 1; rank 2 never comes.
        expectError([&] { createTcpBootstrap(address, rank, 3, kTimeoutMs); }, ErrorCode::kBootstrap,
                    "rank 1 joined twice");
      },
      RunOptions{kTimeoutMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Connects a plain TCP socket to 127.0.0.1:port, retrying while nobody listens yet; returns the fd or -1.
int rawConnect(int port) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

TEST(TcpBootstrap, StrayConnectionsAreIgnored) {
  int port = test::freeTcpPort();
  std::string address = "127.0.0.1:" + std::to_string(port);
  RunResult result = runProcesses(
      3,
      [&](int rank) {
        if (rank == 1) {
          // Something that is not an epcomm rank: one peer sends garbage, another connects and stays silent.
          int noisy = rawConnect(port);
          int silent = rawConnect(port);
          ASSERT_GE(noisy, 0);
          ASSERT_GE(silent, 0);
          std::vector<char> garbage(64, 'x');
          ASSERT_EQ(::send(noisy, garbage.data(), garbage.size(), MSG_NOSIGNAL), 64);
        }
        std::unique_ptr<Bootstrap> bs = createTcpBootstrap(address, rank, 3, kTimeoutMs);
        int value = rank * 10;
        std::vector<int> all(3);
        bs->allGather(&value, all.data(), sizeof(int));
        EXPECT_EQ(all, (std::vector<int>{0, 10, 20}));
      },
      RunOptions{kTimeoutMs, 60000});
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(TcpBootstrap, HarnessReportsFailingRank) {
  // The harness itself must not hide failures: a throwing rank, a failed assertion, a crash, an overrun.
  RunResult result = runRanks(
      kWorld,
      [](int rank, Bootstrap&) {
        if (rank == 1) throw std::runtime_error("rank one gives up");
        if (rank == 2) ::_exit(7);
        if (rank == 3) std::this_thread::sleep_for(std::chrono::seconds(30));
      },
      RunOptions{kTimeoutMs, 5000});
  ASSERT_EQ(result.ranks.size(), 4u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.summary();
  EXPECT_FALSE(result.ranks[1].ok());
  EXPECT_NE(result.ranks[1].message.find("rank one gives up"), std::string::npos) << result.summary();
  EXPECT_EQ(result.ranks[2].exitCode, 7) << result.summary();
  EXPECT_TRUE(result.ranks[3].timedOut) << result.summary();
  EXPECT_FALSE(result.allOk());
}

TEST(TcpBootstrap, ArgumentsAreChecked) {
  expectError([] { createTcpBootstrap("127.0.0.1:1", 2, 2, 100); }, ErrorCode::kInvalidArgument,
              "bootstrap rank 2 is outside [0, 2)");
  expectError([] { createTcpBootstrap("127.0.0.1:1", 0, 0, 100); }, ErrorCode::kInvalidArgument,
              "world size must be at least 1");
  expectError([] { createTcpBootstrap("localhost", 0, 1, 100); }, ErrorCode::kInvalidArgument,
              "'localhost' is not host:port");
  expectError([] { createTcpBootstrap("localhost:99999", 0, 1, 100); }, ErrorCode::kInvalidArgument, "no valid port");
  // World size 1 needs no network at all.
  std::unique_ptr<Bootstrap> one = createTcpBootstrap("127.0.0.1:1", 0, 1, 100);
  int v = 42, out = 0;
  one->allGather(&v, &out, sizeof(int));
  EXPECT_EQ(out, 42);
  one->barrier();
  expectError([&] { one->broadcast(&v, sizeof(v), 1); }, ErrorCode::kInvalidArgument, "root 1 is outside [0, 1)");
}

TEST(SelfBootstrap, CopiesLocally) {
  std::unique_ptr<Bootstrap> bs = createSelfBootstrap();
  EXPECT_EQ(bs->rank(), 0);
  EXPECT_EQ(bs->worldSize(), 1);
  std::vector<char> in = {'a', 'b', 'c'}, out(3);
  bs->allGather(in.data(), out.data(), 3);
  EXPECT_EQ(in, out);
  bs->barrier();
  bs->broadcast(out.data(), 3, 0);
  EXPECT_EQ(in, out);
  expectError([&] { bs->broadcast(out.data(), 3, 1); }, ErrorCode::kInvalidArgument, "root 1");
}

}  // namespace
}  // namespace epcomm
