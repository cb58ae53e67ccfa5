// Elastic ranks in the proxy channel (docs/failures.md, "Elastic ranks"): the active-ranks mask, how the ranks that
// are left agree on it, and the writes and waits that skip masked ranks.
//
// Agreement. A rank that loses a round to a peer (a wait for it timed out, a write to it failed, it left) or that is
// asked to change the mask proposes the next epoch: it writes a record (AgreeWire) with its view (the ranks it still
// believes alive) and the earliest round step it knows lost into the agreement slot of every rank of its view. A rank
// that sees such a record from an active peer while it waits in a round gives that wait up and proposes too. Every
// rank then folds in every member's record (the intersection of the views, the earliest lost step) and writes its
// record again whenever its own changed; it adopts the epoch once every member's record equals its own. A member that
// does not answer within the timeout is dropped from the view. Two ranks that each keep the other in their mask
// adopted the same mask: each saw the other's record equal to its own final one, and views only shrink. The heads of
// every round mark the masked ranks (kMaskedEntries), so ranks that somehow hold different masks fail that round
// instead of computing different offsets.
//
// After the agreement, the job that lost its round ends with an error for the caller (the object goes on), except a
// dispatch on a rank that had completed the combine that the others lost: that dispatch runs again with the agreed
// mask, so that every rank's next successful round is the same one. The epoch's first dispatch is its round 0 on every
// rank, and the epoch is in every immediate's object id, so that nothing of a lost round is ever consumed later.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/log.hpp"
#include "epcomm/error.hpp"
#include "proxy/channel_wait.hpp"
#include "proxy/proxy_channel.hpp"

namespace epcomm {
namespace proxy {

namespace {

// The agreement record's immediate: the connect phase with parity 1 (connection setup uses parity 0), under the
// object's own id: records cross epochs.
uint32_t recordImm(uint32_t objectId, uint32_t sender) { return encodeImm(objectId, Phase::kConnect, 1, sender); }

bool noneMasked(const std::vector<uint8_t>& mask) { return std::find(mask.begin(), mask.end(), 0) == mask.end(); }

}  // namespace

std::string ProxyChannel::peerError(uint32_t p) const {
  std::lock_guard<std::mutex> lock(peerWrites_->mu);
  return peerWrites_->error[p];
}

void ProxyChannel::postToPeer(uint32_t p, const fabric::MemoryRegion* src, uint64_t srcOffset,
                              const fabric::MemoryDesc* dst, uint64_t dstOffset, uint64_t length, uint32_t imm) {
  ++peerPosted_[p];
  fabric::Completion done = PeerWrites::completionFor(peerWrites_, p);
  if (length == 0) {
    engine_->immediate(peerIds_[p], imm, std::move(done));
  } else {
    engine_->write(peerIds_[p], *src, srcOffset, *dst, dstOffset, length, true, imm, std::move(done));
  }
}

void ProxyChannel::waitPeerCompletions(const char* what, uint32_t round) {
  const int64_t start = nowMs(), startUs = nowUs();
  const uint32_t kind = std::strcmp(what, "combine") == 0 ? 1 : 0;
  Backoff backoff;
  // Writes to a masked peer are not awaited: they may never complete, and nothing waits for what they carried.
  auto pending = [&] {
    std::vector<uint32_t> left;
    for (uint32_t p : peerRanks_) {
      if (peerWrites_->done[p].load(std::memory_order_acquire) < peerPosted_[p]) left.push_back(p);
    }
    return left;
  };
  auto allDone = [&] { return localDone_.load(std::memory_order_acquire) >= localPosted_ && pending().empty(); };
  while (!allDone()) {
    const std::vector<uint32_t> left = pending();
    checkTransfers(prefix(what, round) + ": a write of this rank to " + rankList(left.empty() ? peerRanks_ : left) +
                   " failed");
    EPCOMM_CHECK(!stop_.load(), kInternal, prefix(what, round) << ": abandoned (object destroyed)");
    checkNotices(kind, round, {}, currentJobSeq_);
    if (elastic_) checkRecords(what, round);
    if (nowMs() - start > timeoutMs_) {
      std::ostringstream oss;
      oss << prefix(what, round) << ": this rank's writes to " << rankList(left.empty() ? peerRanks_ : left)
          << " did not complete after " << timeoutMs_ << " ms";
      if (elastic_ && !left.empty()) throw PeerLoss{ErrorCode::kTimeout, oss.str(), left, kNoLostStep, {}};
      detail::throwError(ErrorCode::kTimeout, oss.str(), __FILE__, __LINE__);
    }
    if (nowUs() - startUs < kDriveAfterUs) {
      backoff.pause();
      continue;
    }
    driveFor([&] { return allDone() || noticePending() || (elastic_ && recordPending()); }, 20);
  }
}

void ProxyChannel::markMaskedRanks() {
  if (noneMasked(active_)) return;
  for (uint32_t p = 0; p < world_; ++p) {
    uint32_t* entries = headEntryCounts(sendSlot(p), sizes_.numExperts);
    for (uint32_t q = 0; q < world_; ++q) {
      if (!active_[q]) entries[q] = kMaskedEntries;
    }
  }
}

void ProxyChannel::sendRecord(uint32_t epoch, int32_t code, const std::string& text,
                              const std::vector<uint8_t>* alsoTo) {
  AgreeWire w{};
  w.seq = ++recordSeq_;
  w.epoch = epoch;
  w.lostStep = lostStep_;
  w.code = code;
  w.length = static_cast<uint16_t>(std::min<size_t>(text.size(), sizeof(w.text)));
  std::memcpy(w.text, text.data(), w.length);
  for (uint32_t r = 0; r < world_; ++r) {
    if (view_[r]) w.view[r / 64] |= 1ull << (r % 64);
  }
  w.seqEnd = w.seq;
  // One outgoing slot: a record still on its way to a peer while the next one is written here may land torn, which
  // seq / seqEnd tell, and the next record's write to that peer lands after it (one connection, in order).
  const uint64_t outgoing = 2ull * world_ * kAgreeBytes;
  std::memcpy(agreeBuf_.get() + outgoing, &w, sizeof(w));
  const uint64_t slot = (2ull * rank_ + epoch % 2) * kAgreeBytes;
  for (uint32_t p = 0; p < world_; ++p) {
    if (p == rank_ || !(view_[p] || (alsoTo != nullptr && (*alsoTo)[p]))) continue;
    postToPeer(p, agreeMr_.get(), outgoing, &agreeDescs_[p], slot, kAgreeBytes, recordImm(objectId_, rank_));
  }
}

void ProxyChannel::readRecords() {
  for (uint32_t s = 0; s < world_; ++s) {
    if (s == rank_) continue;
    const uint32_t imm = recordImm(objectId_, s);
    const uint64_t arrived = engine_->immCount(imm);
    if (arrived > 0) {
      engine_->waitImm(imm, arrived, "agreement record");  // consumes them; returns at once
      recordUnread_[s] = 1;
      lastHeard_[s] = nowMs();
    }
    if (!recordUnread_[s]) continue;
    bool whole = true;
    for (uint32_t parity = 0; parity < 2; ++parity) {
      AgreeWire w;
      std::memcpy(&w, agreeBuf_.get() + (2ull * s + parity) * kAgreeBytes, sizeof(w));
      if (w.seq == 0) continue;
      if (w.seq != w.seqEnd) {
        whole = false;  // a newer record is landing over it: read again at the next check
        continue;
      }
      PeerRecord& r = records_[2ull * s + parity];
      if (w.seq <= r.seq) continue;
      r.seq = w.seq;
      r.epoch = w.epoch;
      r.lostStep = w.lostStep;
      r.code = w.code;
      r.text.assign(w.text, std::min<size_t>(w.length, sizeof(w.text)));
      r.view.assign(world_, 0);
      for (uint32_t q = 0; q < world_; ++q) r.view[q] = (w.view[q / 64] >> (q % 64)) & 1u;
    }
    if (whole) recordUnread_[s] = 0;
  }
}

void ProxyChannel::heartbeat(int64_t waitStartMs, const std::vector<uint32_t>& awaited) {
  const int64_t now = nowMs(), quarter = std::max<int64_t>(timeoutMs_ / 4, 1);
  if (now - waitStartMs < quarter || now - lastBeatMs_ < quarter) return;
  lastBeatMs_ = now;
  // Not to the awaited peers: one of them may be dead, and a write to it may hold its endpoint.
  for (uint32_t p : peerRanks_) {
    if (std::find(awaited.begin(), awaited.end(), p) != awaited.end()) continue;
    postToPeer(p, nullptr, 0, nullptr, 0, 0, recordImm(objectId_, rank_));
  }
}

std::vector<uint32_t> ProxyChannel::silentPeers(const std::vector<uint32_t>& awaited) {
  readRecords();
  const int64_t recent = nowMs() - timeoutMs_ / 2;
  std::vector<uint32_t> silent;
  for (uint32_t s : awaited) {
    if (lastHeard_[s] < recent) silent.push_back(s);
  }
  return silent;
}

bool ProxyChannel::recordPending() const {
  for (uint32_t s : peerRanks_) {
    if (engine_->immCount(recordImm(objectId_, s)) > 0) return true;
  }
  return false;
}

const ProxyChannel::PeerRecord* ProxyChannel::recordOf(uint32_t s, uint32_t epoch) const {
  const PeerRecord& r = records_[2ull * s + epoch % 2];
  return r.seq != 0 && r.epoch == epoch ? &r : nullptr;
}

void ProxyChannel::checkRecords(const char* what, uint32_t round) {
  readRecords();
  for (uint32_t s : peerRanks_) {
    const PeerRecord* r = recordOf(s, epoch_ + 1);
    if (r == nullptr) continue;
    const bool maskChange = r->code == 0 && r->lostStep == kNoLostStep;
    // A caller's mask change (setActiveRanks) comes between rounds: the rank that sent it had completed this rank's
    // combine, so every owner's rows are on their way; the combine completes and this rank joins at its own call.
    if (maskChange && std::strcmp(what, "combine") == 0) continue;
    std::vector<uint32_t> lost;
    for (uint32_t q = 0; q < world_; ++q) {
      if (q != rank_ && active_[q] && !r->view[q]) lost.push_back(q);
    }
    const ErrorCode code = r->code == static_cast<int32_t>(ErrorCode::kTimeout) ||
                                   r->code == static_cast<int32_t>(ErrorCode::kFabric) ||
                                   r->code == static_cast<int32_t>(ErrorCode::kVerbs)
                               ? static_cast<ErrorCode>(r->code)
                               : ErrorCode::kPeerFailure;
    std::ostringstream oss;
    oss << prefix(what, round) << ": rank " << s;
    if (maskChange) {
      oss << " changed the active ranks (setActiveRanks) while this rank began another round; call setActiveRanks "
             "on every rank between rounds: "
          << r->text;
    } else {
      oss << " lost a round and proposes new active ranks: " << r->text;
    }
    throw PeerLoss{code, oss.str(), lost, r->lostStep, r->text};
  }
}

void ProxyChannel::runAgreement(int32_t code, const std::string& text, const std::vector<uint8_t>* alsoTo) {
  const uint32_t epoch = epoch_ + 1;
  std::ostringstream where;
  where << "host/proxy rank " << rank_ << ": agreement on the active ranks (object " << objectId_ << ", epoch " << epoch
        << ")";
  for (uint32_t r = 0; r < world_; ++r) {
    if (!active_[r]) view_[r] = 0;
  }
  view_[rank_] = 1;
  std::vector<uint8_t> sentView = view_;
  uint64_t sentLost = lostStep_;
  sendRecord(epoch, code, text, alsoTo);
  int64_t deadline = nowMs() + timeoutMs_;
  const int64_t startUs = nowUs();
  Backoff backoff;
  for (;;) {
    EPCOMM_CHECK(!stop_.load(), kInternal, where.str() << ": abandoned (object destroyed)");
    readRecords();
    // Fold in every member's proposal: the views intersect, the earliest lost step wins.
    for (uint32_t s = 0; s < world_; ++s) {
      if (s == rank_ || !view_[s]) continue;
      const PeerRecord* r = recordOf(s, epoch);
      if (r == nullptr) continue;
      if (!r->view[rank_]) {
        selfMasked_ = true;
        EPCOMM_THROW(kPeerFailure, where.str() << ": rank " << s << " masked this rank (" << r->text
                                               << "); this rank takes no part in the object any more");
      }
      for (uint32_t q = 0; q < world_; ++q) {
        if (!r->view[q]) view_[q] = 0;
      }
      lostStep_ = std::min(lostStep_, r->lostStep);
    }
    // A member this rank cannot write to cannot hear it.
    for (uint32_t s = 0; s < world_; ++s) {
      if (s == rank_ || !view_[s]) continue;
      const std::string error = peerError(s);
      if (error.empty()) continue;
      EPCOMM_CHECK(elastic_, kFabric, where.str() << ": a write to rank " << s << " failed: " << error);
      EPCOMM_LOG(kWarn, where.str() << ": a write to rank " << s << " failed (" << error << "); masking it");
      view_[s] = 0;
    }
    if (view_ != sentView || lostStep_ != sentLost) {
      sendRecord(epoch, code, text, alsoTo);
      sentView = view_;
      sentLost = lostStep_;
      deadline = nowMs() + timeoutMs_;
      continue;
    }
    std::vector<uint32_t> waiting;
    for (uint32_t s = 0; s < world_; ++s) {
      if (s == rank_ || !view_[s]) continue;
      const PeerRecord* r = recordOf(s, epoch);
      if (r == nullptr || r->view != view_ || r->lostStep != lostStep_) waiting.push_back(s);
    }
    if (waiting.empty()) break;
    if (nowMs() > deadline) {
      std::ostringstream oss;
      oss << where.str() << ": no matching proposal from " << rankList(waiting) << " after " << timeoutMs_ << " ms";
      if (!elastic_) detail::throwError(ErrorCode::kTimeout, oss.str(), __FILE__, __LINE__);
      EPCOMM_LOG(kWarn, oss.str() << "; masking them");
      for (uint32_t s : waiting) view_[s] = 0;
      continue;
    }
    if (nowUs() - startUs < kDriveAfterUs) {
      backoff.pause();
      continue;
    }
    try {
      driveFor([&] { return recordPending(); }, 20);
    } catch (const Error& e) {
      rethrowEngineError(e, where.str());  // not elastic (setActiveRanks on a plain channel): driveFor throws it
    }
  }
  agreedLost_ = lostStep_;
  adoptEpoch(epoch);
}

void ProxyChannel::adoptEpoch(uint32_t epoch) {
  std::vector<uint32_t> live;
  for (uint32_t p = 0; p < world_; ++p) {
    if (p != rank_ && view_[p]) live.push_back(p);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_ = view_;
  }
  {
    std::lock_guard<std::mutex> lock(noticeMu_);
    peerRanks_ = live;
  }
  epoch_ = epoch;
  tagId_ = (objectId_ + epoch) % kMaxObjectIds;
  lostStep_ = kNoLostStep;
  epochFresh_ = true;
  EPCOMM_LOG(kInfo, "proxy channel: object " << objectId_ << " rank " << rank_ << ": epoch " << epoch
                                             << ", active ranks " << maskText(active_));
}

std::exception_ptr ProxyChannel::runJob(const Job& job) {
  for (;;) {
    try {
      switch (job.kind) {
        case JobKind::kAgree: {
          if (!job.mask[rank_]) {
            leave(job.mask);
            return nullptr;
          }
          // The ranks the mask drops answer too before they leave: they hear from this rank.
          std::vector<uint8_t> leaving(world_, 0);
          for (uint32_t r = 0; r < world_; ++r) {
            leaving[r] = active_[r] && !job.mask[r];
            if (!job.mask[r]) view_[r] = 0;
          }
          runAgreement(0, "rank " + std::to_string(rank_) + " set the active ranks to " + maskText(job.mask), &leaving);
          return nullptr;
        }
        case JobKind::kDispatch: {
          // The epoch's first dispatch is its round 0 on every rank, and needs no barrier: the agreement was one.
          const bool first = epochFresh_.exchange(false);
          if (first) epochBase_ = job.round;
          if (job.barrierFirst && !first) runBarrier(job);
          runDispatch(job);
          return nullptr;
        }
        case JobKind::kCombine:
          runCombine(job);
          return nullptr;
      }
      return nullptr;
    } catch (const PeerLoss& loss) {
      std::exception_ptr error;
      if (recoverFromLoss(job, loss, &error)) continue;
      return error;
    }
  }
}

bool ProxyChannel::recoverFromLoss(const Job& job, const PeerLoss& loss, std::exception_ptr* error) {
  const uint64_t step = 2ull * roundOf(job) + (job.kind == JobKind::kCombine ? 1 : 0);
  const std::vector<uint8_t> before = active_;
  for (uint32_t r : loss.ranks) {
    if (r != rank_) view_[r] = 0;
  }
  lostStep_ = std::min({lostStep_, loss.lostStep, step});
  EPCOMM_LOG(kWarn, loss.message << "; agreeing on the active ranks");
  runAgreement(static_cast<int32_t>(loss.code), loss.reason.empty() ? loss.message : loss.reason);
  // A rank that completed the combine the others lost is one step ahead: its dispatch is the others' next one.
  const uint64_t lost = agreedLost_;
  if (job.kind == JobKind::kDispatch && lost != kNoLostStep && lost % 2 == 1 && lost + 1 == step) {
    EPCOMM_LOG(kInfo, prefix("dispatch", 0) << ": the others lost the combine before it; the dispatch runs again");
    return true;
  }
  std::vector<uint32_t> masked;
  for (uint32_t r = 0; r < world_; ++r) {
    if (before[r] && !active_[r]) masked.push_back(r);
  }
  std::ostringstream oss;
  oss << loss.message << "; the ranks agreed to go on";
  if (!masked.empty()) oss << " without " << rankList(masked);
  oss << " (active: " << maskText(active_)
      << "): this call failed and its round is lost, the object goes on (the next call is a dispatch)";
  try {
    detail::throwError(loss.code, oss.str(), __FILE__, __LINE__);
  } catch (...) {
    *error = std::current_exception();
  }
  return false;
}

void ProxyChannel::leave(const std::vector<uint8_t>& mask) {
  const uint32_t epoch = epoch_ + 1;
  for (uint32_t r = 0; r < world_; ++r) view_[r] = active_[r] && mask[r];
  sendRecord(epoch, 0, "rank " + std::to_string(rank_) + " leaves (setActiveRanks)");
  const int64_t deadline = nowMs() + timeoutMs_;
  Backoff backoff;
  for (;;) {
    readRecords();
    std::vector<uint32_t> waiting;
    for (uint32_t s = 0; s < world_; ++s) {
      if (s != rank_ && view_[s] && recordOf(s, epoch) == nullptr && peerError(s).empty()) waiting.push_back(s);
    }
    if (waiting.empty() || stop_.load()) break;
    if (nowMs() > deadline) {
      EPCOMM_LOG(kWarn, "host/proxy rank " << rank_ << ": leaving, no answer from " << rankList(waiting) << " after "
                                           << timeoutMs_ << " ms");
      break;
    }
    backoff.pause();
  }
  std::lock_guard<std::mutex> lock(mu_);
  active_ = view_;
  selfMasked_ = true;
}

std::string ProxyChannel::maskText(const std::vector<uint8_t>& mask) const {
  std::vector<uint32_t> ranks;
  for (uint32_t r = 0; r < mask.size(); ++r) {
    if (mask[r]) ranks.push_back(r);
  }
  return ranks.empty() ? std::string("no rank") : rankList(ranks);
}

std::vector<uint8_t> ProxyChannel::activeRanks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return active_;
}

bool ProxyChannel::takeLostRound() {
  const bool lost = lostRoundTaken_;
  lostRoundTaken_ = false;
  return lost;
}

void ProxyChannel::setActiveRanks(const std::vector<uint8_t>& mask) {
  rethrowIfBroken();
  const std::vector<uint8_t> current = activeRanks();
  EPCOMM_CHECK(mask.size() == world_, kInvalidArgument,
               "setActiveRanks: the mask has " << mask.size() << " entries for " << world_ << " ranks");
  bool any = false;
  for (uint32_t r = 0; r < world_; ++r) {
    EPCOMM_CHECK(mask[r] <= 1, kInvalidArgument,
                 "setActiveRanks: entry " << r << " is " << static_cast<int>(mask[r]) << " (1 = active, 0 = masked)");
    EPCOMM_CHECK(!mask[r] || current[r], kInvalidArgument,
                 "setActiveRanks: rank " << r
                                         << " is masked already and cannot be made active again (a rank that comes "
                                            "back needs a new object with every rank)");
    any = any || mask[r];
  }
  EPCOMM_CHECK(any, kInvalidArgument, "setActiveRanks: the mask leaves no rank active");
  Job job{JobKind::kAgree, ++postedSeq_, round_, false, DType::kInvalid, mask};
  if (thread_.joinable()) {
    post(job);
    waitJob(job.seq, "setActiveRanks");
  } else {
    runExternal(job);  // the caller's thread is the exchanging one (no exchange runs meanwhile)
  }
  if (selfMasked_.load()) {
    // It left: every later call says so.
    std::lock_guard<std::mutex> lock(mu_);
    try {
      EPCOMM_THROW(kInvalidArgument, "host/proxy rank " << rank_
                                                        << ": this rank left the object (setActiveRanks masked it) "
                                                           "and takes no part in its rounds");
    } catch (...) {
      if (!error_) error_ = std::current_exception();
    }
  }
}

}  // namespace proxy
}  // namespace epcomm
