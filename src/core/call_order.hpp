// The order of calls on one AllToAll: dispatch (send half, then receive half, or both in one call) and combine
// (the same) alternate. Backends check a call before launching anything and record it after it was issued; a call
// out of order is kInvalidArgument naming the rank, the call and the object's state.
#pragma once

#include <cstdint>

#include "epcomm/error.hpp"

namespace epcomm {

class CallOrder {
 public:
  enum class State { kIdle, kDispatchSent, kDispatched, kCombineSent };

  /// `dispatchMayRepeat`: a dispatch may follow a completed dispatch without a combine in between (a backend whose
  /// receive buffers are not overwritten by the next dispatch while a peer may still read them).
  CallOrder(const char* backend, uint32_t rank, bool dispatchMayRepeat)
      : backend_(backend), rank_(rank), dispatchMayRepeat_(dispatchMayRepeat) {}

  void checkDispatch(bool doSend, bool doRecv) const {
    if (doSend) {
      require(state_ == State::kIdle || (dispatchMayRepeat_ && state_ == State::kDispatched), "dispatch send",
              state_ == State::kDispatched ? "dispatch and combine alternate: combine the last dispatch first"
                                           : "dispatch and combine alternate; finish the receive half first");
    } else if (doRecv) {
      require(state_ == State::kDispatchSent, "dispatch receive", "call dispatch with doSend first");
    }
  }
  void dispatched(bool doSend, bool doRecv) { advance(doSend, doRecv, State::kDispatchSent, State::kDispatched); }

  void checkCombine(bool doSend, bool doRecv) const {
    if (doSend) {
      require(state_ == State::kDispatched, "combine send", "combine follows a completed dispatch");
    } else if (doRecv) {
      require(state_ == State::kCombineSent, "combine receive", "call combine with doSend first");
    }
  }
  void combined(bool doSend, bool doRecv) { advance(doSend, doRecv, State::kCombineSent, State::kIdle); }

  State state() const { return state_; }
  /// Back to idle: the step in progress is over without completing (a round lost to a peer, elastic ranks).
  void reset() { state_ = State::kIdle; }

  static const char* name(State state) {
    switch (state) {
      case State::kIdle:
        return "idle";
      case State::kDispatchSent:
        return "dispatch sent, not received";
      case State::kDispatched:
        return "dispatched";
      case State::kCombineSent:
        return "combine sent, not received";
    }
    return "?";
  }

 private:
  void require(bool ok, const char* call, const char* hint) const {
    EPCOMM_CHECK(ok, kInvalidArgument,
                 backend_ << " backend rank " << rank_ << ": " << call << " while the object is '" << name(state_)
                          << "' (" << hint << ")");
  }
  // A call that had its receive half completes the step; a send half alone leaves it half done.
  void advance(bool doSend, bool doRecv, State sent, State done) {
    if (doRecv) {
      state_ = done;
    } else if (doSend) {
      state_ = sent;
    }
  }

  const char* backend_;
  uint32_t rank_;
  bool dispatchMayRepeat_;
  State state_ = State::kIdle;
};

}  // namespace epcomm
