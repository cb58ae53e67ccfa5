// The abort board of the GPU backends (core/abort_board.hpp) on the CPU: ranks forked on one host share its page, a
// rank's raise() sets every peer's abort word and its note reads back on the peers, withdraw() clears the words.
#include "core/abort_board.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "support/multiprocess.hpp"

namespace epcomm {
namespace {

uint32_t abortWord(const AbortBoard& b, uint32_t r) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(b.slot(r) + kAbortWordOffset), __ATOMIC_ACQUIRE);
}

// Rank 1 refuses a dispatch: ranks 0 and 2 see its abort word and its note; after withdraw() the words are clear. Then
// rank 2's object fails (a timeout): the words name rank 2 and its code is kept.
TEST(AbortBoard, RaiseDescribeWithdraw) {
  test::RunResult result = test::runRanks(3, [](int rank, Bootstrap& bootstrap) {
    AbortBoard board;
    board.open(bootstrap);
    ASSERT_NE(board.page(), nullptr);
    EXPECT_EQ(board.bytes() % 4096, 0u);
    const uint32_t me = static_cast<uint32_t>(rank);
    EXPECT_EQ(abortWord(board, me), 0u);
    bootstrap.barrier();
    if (rank == 1) board.raise(kAbortDispatch, 3, ErrorCode::kInvalidArgument, "x has 25 tokens, more than 24");
    bootstrap.barrier();
    if (rank != 1) {
      EXPECT_EQ(abortWord(board, me), 2u) << "rank 1's abort word (1 + 1) at rank " << rank;
      ErrorCode code = ErrorCode::kInternal;
      const std::string text = board.describe(1, &code);
      EXPECT_EQ(text, "rank 1 aborted dispatch (its round 3): x has 25 tokens, more than 24");
      EXPECT_EQ(code, ErrorCode::kPeerFailure);
    } else {
      EXPECT_EQ(abortWord(board, me), 0u) << "a rank does not abort itself";
    }
    bootstrap.barrier();
    if (rank == 1) board.withdraw();
    bootstrap.barrier();
    EXPECT_EQ(abortWord(board, me), 0u) << "after withdraw";
    bootstrap.barrier();
    if (rank == 2) board.raise(kAbortFailed, 4, ErrorCode::kTimeout, std::string(1000, 'y'));
    bootstrap.barrier();
    if (rank != 2) {
      EXPECT_EQ(abortWord(board, me), 3u);
      ErrorCode code = ErrorCode::kInternal;
      const std::string text = board.describe(2, &code);
      EXPECT_EQ(code, ErrorCode::kTimeout);
      EXPECT_EQ(text, "rank 2 failed (its round 4): " + std::string(kAbortTextBytes, 'y')) << "the text is cut";
    }
    bootstrap.barrier();
  });
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// One rank: a private page, nothing to tell.
TEST(AbortBoard, OneRank) {
  test::RunResult result = test::runRanks(1, [](int, Bootstrap& bootstrap) {
    AbortBoard board;
    board.open(bootstrap);
    ASSERT_NE(board.page(), nullptr);
    board.raise(kAbortCombine, 0, ErrorCode::kInvalidArgument, "bad");
    EXPECT_EQ(abortWord(board, 0), 0u);
    board.withdraw();
  });
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace epcomm
