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
      EPCOMM_CHECK(state_ == State::kIdle || (dispatchMayRepeat_ && state_ == State::kDispatched), kInvalidArgument,
                   backend_ << " backend rank " << rank_ << ": dispatch send while the object is '" << name(state_)
                            << "' (dispatch and combine alternate"
                            << (state_ == State::kDispatched ? ": combine the last dispatch first)"
                                                             : "; finish the receive half first)"));
    } else if (doRecv) {
      EPCOMM_CHECK(state_ == State::kDispatchSent, kInvalidArgument,
                   backend_ << " backend rank " << rank_ << ": dispatch receive while the object is '" << name(state_)
                            << "' (call dispatch with doSend first)");
    }
  }
  void dispatched(bool doSend, bool doRecv) {
    if (doRecv) {
      state_ = State::kDispatched;
    } else if (doSend) {
      state_ = State::kDispatchSent;
    }
  }

  void checkCombine(bool doSend, bool doRecv) const {
    if (doSend) {
      EPCOMM_CHECK(state_ == State::kDispatched, kInvalidArgument,
                   backend_ << " backend rank " << rank_ << ": combine send while the object is '" << name(state_)
                            << "' (combine follows a completed dispatch)");
    } else if (doRecv) {
      EPCOMM_CHECK(state_ == State::kCombineSent, kInvalidArgument,
                   backend_ << " backend rank " << rank_ << ": combine receive while the object is '" << name(state_)
                            << "' (call combine with doSend first)");
    }
  }
  void combined(bool doSend, bool doRecv) {
    if (doRecv) {
      state_ = State::kIdle;
    } else if (doSend) {
      state_ = State::kCombineSent;
    }
  }

  State state() const { return state_; }

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
  const char* backend_;
  uint32_t rank_;
  bool dispatchMayRepeat_;
  State state_ = State::kIdle;
};

}  // namespace epcomm
