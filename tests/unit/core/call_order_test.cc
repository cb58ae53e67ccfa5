// The dispatch -> combine alternation every backend enforces (core/call_order.hpp): legal sequences, fused and
// split, and an error naming the rank, the call and the state for each illegal one, with the state unchanged.
#include "core/call_order.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace epcomm {
namespace {

using State = CallOrder::State;

void expectRefused(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error, expected: " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(CallOrder, FusedAndSplitRoundsAlternate) {
  CallOrder o("nvlink", 3, false);
  for (int round = 0; round < 2; ++round) {
    o.checkDispatch(true, true);
    o.dispatched(true, true);
    EXPECT_EQ(o.state(), State::kDispatched);
    o.checkCombine(true, true);
    o.combined(true, true);
    EXPECT_EQ(o.state(), State::kIdle);
  }
  // Split halves, with the other calls' checks in between.
  o.checkDispatch(true, false);
  o.dispatched(true, false);
  EXPECT_EQ(o.state(), State::kDispatchSent);
  o.checkDispatch(false, true);
  o.dispatched(false, true);
  o.checkCombine(true, false);
  o.combined(true, false);
  EXPECT_EQ(o.state(), State::kCombineSent);
  o.checkCombine(false, true);
  o.combined(false, true);
  EXPECT_EQ(o.state(), State::kIdle);
}

TEST(CallOrder, OutOfOrderCallsAreRefusedWithTheState) {
  CallOrder o("nvlink", 1, false);
  expectRefused([&] { o.checkCombine(true, true); }, "nvlink backend rank 1: combine send while the object is 'idle'");
  expectRefused([&] { o.checkCombine(false, true); }, "combine receive while the object is 'idle'");
  expectRefused([&] { o.checkDispatch(false, true); }, "dispatch receive while the object is 'idle'");
  EXPECT_EQ(o.state(), State::kIdle);
  o.dispatched(true, false);
  expectRefused([&] { o.checkDispatch(true, true); }, "finish the receive half first");
  expectRefused([&] { o.checkCombine(true, true); }, "'dispatch sent, not received'");
  o.dispatched(false, true);
  // nvlink: a second dispatch before the combine would overwrite what the peers may still read.
  expectRefused([&] { o.checkDispatch(true, true); }, "combine the last dispatch first");
  o.combined(true, false);
  expectRefused([&] { o.checkDispatch(true, true); }, "'combine sent, not received'");
  expectRefused([&] { o.checkCombine(true, false); }, "combine send while the object is 'combine sent, not received'");
  EXPECT_EQ(o.state(), State::kCombineSent);
}

TEST(CallOrder, HostMayRepeatADispatch) {
  CallOrder o("host", 0, true);
  o.dispatched(true, true);
  o.checkDispatch(true, true);  // no throw
  o.dispatched(true, true);
  o.checkCombine(true, true);
  o.combined(true, true);
  EXPECT_EQ(o.state(), State::kIdle);
}

}  // namespace
}  // namespace epcomm
