// Notices of the proxy channel (NoticeWire): a rank that refuses a call of a round, or gives a round up, writes its
// notice into every peer's slot for it, so that their waits for it end at once instead of at the timeout.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "epcomm/error.hpp"
#include "proxy/channel_wait.hpp"
#include "proxy/proxy_channel.hpp"

namespace epcomm {
namespace proxy {

bool ProxyChannel::noticePending() const {
  for (uint32_t s : peerRanks_) {
    if (engine_->immCount(encodeImm(tagId_, Phase::kNotice, 0, s)) > 0) return true;
  }
  return false;
}

void ProxyChannel::throwNoticeIfAny(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited) {
  checkNotices(kind, round, awaited, currentJobSeq_);  // a peer's fatal notice throws here, and wins
  std::lock_guard<std::mutex> lock(mu_);
  if (userNoticeSeq_ == currentJobSeq_ && !userNotice_.empty()) {
    // A peer refused this step: its message is this exchange's error (the caller's call fails with it).
    std::string message;
    message.swap(userNotice_);
    detail::throwError(ErrorCode::kPeerFailure, message, __FILE__, __LINE__);
  }
}

void ProxyChannel::awaitNoticeAfterFailure(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited) {
  const int64_t start = nowMs();
  const int64_t graceMs = std::min<int64_t>(200, timeoutMs_ / 4);
  while (nowMs() - start <= graceMs) {
    throwNoticeIfAny(kind, round, awaited);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ProxyChannel::awaitNoticeBeforeTimeout(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited) {
  const int64_t start = nowMs();
  const int64_t graceMs = std::min<int64_t>(500, timeoutMs_ / 4);
  while (nowMs() - start <= graceMs) {
    throwNoticeIfAny(kind, round, awaited);
    try {
      driveFor([&] { return noticePending(); }, 5);  // the engine moves on meanwhile (a notice is a write)
    } catch (const Error&) {
      return;  // the engine failed: the caller's timeout stands
    }
  }
}

void ProxyChannel::sendNotice(uint32_t kind, uint32_t round, bool fatal, ErrorCode code, const std::string& text) {
  if (peerRanks_.empty() || noticeMr_ == nullptr) return;
  try {
    std::lock_guard<std::mutex> lock(noticeMu_);
    // The outgoing slot is the source of the previous notice's writes: let those to live peers leave first (bounded:
    // a write to a dead peer that has not failed yet may never complete, and a notice is best effort).
    awaitNotices(nowMs() + 1000);
    NoticeWire w{};
    w.seq = ++noticeSeq_;
    w.round = round;
    w.kind = static_cast<uint8_t>(kind);
    w.fatal = fatal ? 1 : 0;
    w.code = static_cast<int32_t>(code);
    w.length = static_cast<uint16_t>(std::min<size_t>(text.size(), sizeof(w.text)));
    std::memcpy(w.text, text.data(), w.length);
    w.seqEnd = w.seq;
    const uint64_t outgoing = static_cast<uint64_t>(world_) * kNoticeBytes;
    std::memcpy(noticeBuf_.get() + outgoing, &w, sizeof(w));
    for (uint32_t p : peerRanks_) {
      ++noticePosted_[p];
      engine_->write(peerIds_[p], *noticeMr_, outgoing, noticeDescs_[p], static_cast<uint64_t>(rank_) * kNoticeBytes,
                     kNoticeBytes, true, encodeImm(tagId_, Phase::kNotice, 0, rank_),
                     PeerWrites::completionFor(noticeWrites_, p));
    }
  } catch (...) {
    // Best effort: without the notice the peers still end their waits at the timeout.
  }
}

void ProxyChannel::awaitNotices(int64_t deadlineMs) {
  std::vector<uint8_t> lost(world_, 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t p = 0; p < world_; ++p) lost[p] = active_[p] ? 0 : 1;
  }
  bool engineChecked = false;
  Backoff backoff;
  for (;;) {
    bool pending = false;
    for (uint32_t p : peerRanks_) {
      if (lost[p] || noticeWrites_->done[p].load(std::memory_order_acquire) >= noticePosted_[p]) continue;
      {
        std::lock_guard<std::mutex> lock(noticeWrites_->mu);
        if (!noticeWrites_->error[p].empty()) lost[p] = 1;
      }
      if (!peerError(p).empty()) lost[p] = 1;
      pending = pending || !lost[p];
    }
    if (!pending || nowMs() >= deadlineMs) return;
    if (!engineChecked) {
      // The engine keeps its first error only, and for good: the peer its failed write went to, once.
      try {
        engine_->checkErrors();
      } catch (const Error& e) {
        engineChecked = true;
        for (uint32_t p : ranksCitedBy(e.message(), peerIds_, peerRanks_)) lost[p] = 1;
      }
    }
    backoff.pause();
  }
}

void ProxyChannel::noticeRefused(bool combine, const std::string& message) {
  // The round the call belonged to: the next dispatch, or the combine of the last one (counted in the epoch; the first
  // dispatch of an epoch is its round 0).
  const uint32_t base = epochBase_.load();
  const uint32_t round = combine ? (round_ > base ? round_ - 1 - base : 0) : (epochFresh_ ? 0 : round_ - base);
  sendNotice(combine ? 1 : 0, round, false, ErrorCode::kInvalidArgument, message);
}

void ProxyChannel::noticeAbandoned(const std::string& message) {
  {
    // A broken channel told its peers already (its own error), or was told (a peer's notice reached every rank).
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) return;
  }
  sendNotice(2, round_ - epochBase_.load(), true, ErrorCode::kPeerFailure, message);
}

void ProxyChannel::checkNotices(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited, uint64_t jobSeq) {
  const uint64_t here = 2ull * round + kind;  // rounds in call order: dispatch r, combine r, dispatch r + 1, ...
  for (uint32_t s : peerRanks_) {
    Notice& n = notices_[s];
    const uint32_t imm = encodeImm(tagId_, Phase::kNotice, 0, s);
    const uint64_t arrived = engine_->immCount(imm);
    if (arrived > 0) {
      engine_->waitImm(imm, arrived, "notice");  // consumes them; returns at once
      n.unread = true;
    }
    if (n.unread) {
      NoticeWire w;
      std::memcpy(&w, noticeBuf_.get() + static_cast<uint64_t>(s) * kNoticeBytes, sizeof(w));
      // A newer notice may be landing over it: read again at the next check.
      if (w.seq != 0 && w.seq == w.seqEnd && w.seq > n.seq) {
        n.seq = w.seq;
        n.round = w.round;
        n.kind = w.kind;
        n.fatal = w.fatal != 0;
        n.code = w.code;
        n.text.assign(w.text, std::min<size_t>(w.length, sizeof(w.text)));
        n.unread = false;
        n.handled = false;
      }
    }
    if (n.seq == 0 || n.handled) continue;
    const char* call = n.kind == 1 ? "combine" : "dispatch";
    if (n.fatal && n.kind == 2 && elastic_) {
      // A rank that left is lost like a dead one: the others mask it and go on.
      n.handled = true;
      std::ostringstream oss;
      oss << prefix(kind == 1 ? "combine" : "dispatch", round) << ": rank " << s << " left: " << n.text;
      throw PeerLoss{ErrorCode::kPeerFailure, oss.str(), {s}, kNoLostStep, {}};
    }
    if (n.fatal) {
      const std::string what = n.kind == 2 ? std::string(" left") : std::string(" aborted ") + call;
      n.handled = true;
      failedByNotice_ = true;
      // Argument errors were the peer's; here they are a peer failure. A timeout or a transfer error keeps its code.
      const ErrorCode code = n.code == static_cast<int32_t>(ErrorCode::kInvalidArgument) ||
                                     n.code == static_cast<int32_t>(ErrorCode::kInvalidConfig)
                                 ? ErrorCode::kPeerFailure
                                 : static_cast<ErrorCode>(n.code);
      std::ostringstream oss;
      oss << prefix(kind == 1 ? "combine" : "dispatch", round) << ": rank " << s << what << ": " << n.text
          << "; this object cannot continue: destroy it and create a new one";
      detail::throwError(code, oss.str(), __FILE__, __LINE__);
    }
    const uint64_t theirs = 2ull * n.round + n.kind;
    if (theirs < here) {
      n.handled = true;  // about a step this rank finished
    } else if (theirs == here) {
      n.handled = true;
      if (std::find(awaited.begin(), awaited.end(), s) == awaited.end()) continue;  // its data came after all
      std::ostringstream oss;
      if (!thread_.joinable()) {
        // An external driver (the GPU proxy backend): its kernels wait for this exchange and cannot wait on for a
        // repeat of the peer's call, so the exchange ends here and the object with it.
        failedByNotice_ = true;
        oss << prefix(call, round) << ": rank " << s << " aborted " << call << ": " << n.text
            << "; this rank's kernels gave their round up: this object cannot continue: destroy it and create a new "
               "one";
        detail::throwError(ErrorCode::kPeerFailure, oss.str(), __FILE__, __LINE__);
      }
      oss << prefix(call, round) << ": rank " << s << " aborted " << call << ": " << n.text
          << " (nothing was sent: this call failed, the object is usable; call " << call
          << " with doSend = false to wait on if rank " << s << " calls again, or destroy the object)";
      {
        std::lock_guard<std::mutex> lock(mu_);
        userNotice_ = oss.str();
        userNoticeSeq_ = jobSeq;
      }
      cv_.notify_all();
    }
  }
}

}  // namespace proxy
}  // namespace epcomm
