#include "proxy/proxy_channel.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/agreement.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "epcomm/error.hpp"
#include "fabric/engine_base.hpp"
#include "proxy/channel_wait.hpp"

namespace epcomm {
namespace proxy {

namespace {

std::atomic<uint32_t> gNextObjectId{0};

}  // namespace

void ProxyChannel::FreeBytes::operator()(uint8_t* p) const { std::free(p); }

ProxyChannel::ProxyChannel(const Config& config, Bootstrap& bootstrap, const ChannelOptions& options)
    : config_(config),
      onPosted_(options.onPosted),
      onPosting_(options.onPosting),
      bulkOverFabric_(options.bulkOverFabric) {
  EPCOMM_CHECK(bulkOverFabric_.empty() || bulkOverFabric_.size() == config.worldSize, kInvalidArgument,
               "host/proxy channel: bulkOverFabric has " << bulkOverFabric_.size() << " marks for " << config.worldSize
                                                         << " ranks");
  sizes_ = computeSizes(config, options.privateTokens);
  timeoutMs_ = options.timeoutMs > 0 ? options.timeoutMs : env().timeoutMs;
  rank_ = config.rank;
  world_ = config.worldSize;
  elastic_ = options.elastic > 0;
  skipWrite_ = options.skipWrite;
  active_.assign(world_, 1);
  view_ = active_;

  // Rank 0 names the object; every rank uses its tags. Ids only need to differ between objects sharing an engine.
  uint32_t id = gNextObjectId.fetch_add(1) % kMaxObjectIds;
  bootstrap.broadcast(&id, sizeof(id), 0);
  objectId_ = id;
  tagId_ = objectId_;

  sendBuf_ = allocBytes(sizes_.sendBytes);
  recvBuf_ = allocBytes(sizes_.recvBytes);
  const uint64_t combineSendBytes = options.fixedCombineSend ? sizes_.combineSendBytesMax : sizes_.combineSendBytes;
  combineSendCapacity_ = roundUpPow2(std::max<uint64_t>(combineSendBytes, 1), 4096);
  combineSendBuf_ = allocBytes(combineSendCapacity_);
  combineRecvBuf_ = allocBytes(sizes_.combineRecvBytes);
  if (options.onBuffer) {
    auto pages = [](uint64_t bytes) { return roundUpPow2(std::max<uint64_t>(bytes, 1), 4096); };
    options.onBuffer(sendBuf_.get(), pages(sizes_.sendBytes));
    options.onBuffer(recvBuf_.get(), pages(sizes_.recvBytes));
    options.onBuffer(combineSendBuf_.get(), combineSendCapacity_);
    options.onBuffer(combineRecvBuf_.get(), pages(sizes_.combineRecvBytes));
  }

  fabric::EngineOptions eo;
  eo.provider = !options.provider.empty() ? options.provider : env().fabricProvider;
  // Elastic ranks: one endpoint per peer where the engine has enough (it sends to peer p through endpoint p % numNics).
  // The engine queues a refused post (FI_EAGAIN) per peer, but shm completes an endpoint's writes above its inject size
  // in order, so one to a dead peer would hold a live peer's behind it until its deadline: that peer would look dead.
  eo.numNics = elastic_ ? static_cast<int>(std::min<uint32_t>(fabric::kMaxNics, std::max<uint32_t>(1, world_ - 1))) : 1;
  eo.progressCpu = env().proxyCpu;
  eo.timeoutMs = timeoutMs_;
  engine_ = fabric::TransferEngine::create(eo);
  // Peers write into each other's private areas at offsets sized by privateTokens: it must agree, like the provider.
  checkSettingsAgree(bootstrap, "host/proxy channel",
                     {{"private_tokens (EPCOMM_PRIVATE_TOKENS)", std::to_string(sizes_.privateTokens)},
                      {"fabric provider (EPCOMM_FABRIC_PROVIDER)", engine_->providerName()},
                      {"elastic (EPCOMM_ELASTIC)", elastic_ ? "1" : "0"}});
  sendMr_ = engine_->registerMemory(sendBuf_.get(), roundUpPow2(std::max<uint64_t>(sizes_.sendBytes, 1), 4096));
  recvMr_ = engine_->registerMemory(recvBuf_.get(), roundUpPow2(std::max<uint64_t>(sizes_.recvBytes, 1), 4096));
  combineSendMr_ = engine_->registerMemory(combineSendBuf_.get(), combineSendCapacity_);
  combineRecvMr_ =
      engine_->registerMemory(combineRecvBuf_.get(), roundUpPow2(std::max<uint64_t>(sizes_.combineRecvBytes, 1), 4096));

  const auto addresses = allGatherBlobs(bootstrap, engine_->address());
  const auto recvDescs = allGatherBlobs(bootstrap, recvMr_->desc().serialize());
  const auto combineDescs = allGatherBlobs(bootstrap, combineRecvMr_->desc().serialize());
  peerIds_.assign(world_, 0);
  recvDescs_.resize(world_);
  combineRecvDescs_.resize(world_);
  std::vector<fabric::PeerId> members;
  std::vector<fabric::MemoryDesc> headDsts, combineDsts;
  for (uint32_t r = 0; r < world_; ++r) {
    recvDescs_[r] = fabric::MemoryDesc::deserialize(recvDescs[r].data(), recvDescs[r].size());
    combineRecvDescs_[r] = fabric::MemoryDesc::deserialize(combineDescs[r].data(), combineDescs[r].size());
    if (r == rank_) continue;
    peerIds_[r] = engine_->addPeer(addresses[r]);
    peerRanks_.push_back(r);
    members.push_back(peerIds_[r]);
    headDsts.push_back(recvDescs_[r]);
    combineDsts.push_back(combineRecvDescs_[r]);
  }
  if (!members.empty()) {
    headGroup_ = engine_->createGroup(members, headDsts);
    combineGroup_ = engine_->createGroup(members, combineDsts);
  }
  // Notice slots: one per sender, written by a peer that refuses a call or gives a round up (see NoticeWire).
  const uint64_t noticeBytes = roundUpPow2(static_cast<uint64_t>(world_ + 1) * kNoticeBytes, 4096);
  noticeBuf_ = allocBytes(noticeBytes);
  noticeMr_ = engine_->registerMemory(noticeBuf_.get(), noticeBytes);
  const auto noticeDescs = allGatherBlobs(bootstrap, noticeMr_->desc().serialize());
  noticeDescs_.resize(world_);
  for (uint32_t r = 0; r < world_; ++r) {
    noticeDescs_[r] = fabric::MemoryDesc::deserialize(noticeDescs[r].data(), noticeDescs[r].size());
  }
  notices_.assign(world_, Notice{});
  // Agreement slots (elastic ranks): two per sender, then the outgoing record (see AgreeWire).
  const uint64_t agreeBytes = roundUpPow2((2ull * world_ + 1) * kAgreeBytes, 4096);
  agreeBuf_ = allocBytes(agreeBytes);
  agreeMr_ = engine_->registerMemory(agreeBuf_.get(), agreeBytes);
  const auto agreeDescs = allGatherBlobs(bootstrap, agreeMr_->desc().serialize());
  agreeDescs_.resize(world_);
  for (uint32_t r = 0; r < world_; ++r) {
    agreeDescs_[r] = fabric::MemoryDesc::deserialize(agreeDescs[r].data(), agreeDescs[r].size());
  }
  records_.assign(2ull * world_, PeerRecord{});
  recordUnread_.assign(world_, 0);
  lastHeard_.assign(world_, 0);
  peerPosted_.assign(world_, 0);
  peerWrites_ = std::make_shared<PeerWrites>(world_);
  noticePosted_.assign(world_, 0);
  noticeWrites_ = std::make_shared<PeerWrites>(world_);
  driver_ = dynamic_cast<fabric::EngineBase*>(engine_.get());
  stats_.peers.assign(world_, PeerOps{});
  // Nobody writes before every peer has registered its buffers and added its peers.
  bootstrap.barrier();
  try {
    connectInRankOrder();
  } catch (const PeerLoss& loss) {
    // No agreement at creation: a peer lost before the first round fails the creation.
    detail::throwError(loss.code, loss.message, __FILE__, __LINE__);
  }
  // Every pair's connection is up before anyone's first round.
  bootstrap.barrier();
  EPCOMM_LOG(kInfo, "proxy channel: object " << objectId_ << " provider " << engine_->providerName() << " private "
                                             << sizes_.privateTokens << " tokens, entry " << sizes_.entryBytes
                                             << " bytes, " << bufferBytes() << " bytes registered");
  if (!options.externalDriver) thread_ = std::thread([this] { proxyLoop(); });
}

ProxyChannel::~ProxyChannel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Operations this rank posted finish (or fail) before their buffers are deregistered. The notices first: a live
  // peer may wait for one to end its exchange at once, even when a write to a dead peer left an error in the engine.
  const int64_t deadline = nowMs() + std::min<int64_t>(timeoutMs_, 2000);
  std::lock_guard<std::mutex> lock(noticeMu_);
  awaitNotices(deadline);
  Backoff backoff;
  while (localDone_.load() < localPosted_ && nowMs() < deadline) backoff.pause();
  for (uint32_t p : peerRanks_) {
    while (peerWrites_->done[p].load() < peerPosted_[p] && nowMs() < deadline) backoff.pause();
  }
  if (world_ > 1) {  // the groups of every peer exist
    engine_->destroyGroup(headGroup_);
    engine_->destroyGroup(combineGroup_);
  }
}

std::string ProxyChannel::providerName() const { return engine_->providerName(); }

void ProxyChannel::rethrowEngineError(const Error& e, const std::string& context,
                                      const std::vector<uint32_t>& writtenTo) const {
  // The engine's code is kept (its kTimeout stays kTimeout, a dead peer's kFabric stays kFabric): callers branch on it.
  // The engine knows PeerIds, not ranks ("scatter to peer 1 ... failed"): the message names the rank written to.
  std::vector<uint32_t> ranks = ranksCitedBy(e.message(), peerIds_, peerRanks_);
  if (ranks.empty()) ranks = writtenTo;
  const std::string to = ranks.empty() ? "" : ": a write of this rank to " + rankList(ranks) + " failed";
  detail::throwError(e.code(), context + to + ": " + e.message(), e.file(), e.line());
}

uint64_t ProxyChannel::bufferBytes() const {
  return sizes_.sendBytes + sizes_.recvBytes + combineSendCapacity_ + sizes_.combineRecvBytes;
}

std::unique_ptr<uint8_t, ProxyChannel::FreeBytes> ProxyChannel::allocBytes(uint64_t bytes) {
  const uint64_t rounded = roundUpPow2(std::max<uint64_t>(bytes, 1), 4096);
  uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
  EPCOMM_CHECK(p != nullptr, kSystem, "cannot allocate " << rounded << " bytes of host/proxy buffers");
  std::memset(p, 0, rounded);
  return std::unique_ptr<uint8_t, FreeBytes>(p);
}

uint8_t* ProxyChannel::combineSendBufferFor(uint64_t rowBytes) {
  rethrowIfBroken();
  uint64_t rows = 0;
  for (uint32_t g = 0; g < sizes_.numDpGroups(); ++g) rows += layout_.combineRows(rank_, g);
  const uint64_t needed = rows * rowBytes;
  if (needed <= combineSendCapacity_) return combineSendBuf_.get();
  // A quarter more than this round needs, so that routing that drifts upwards does not regrow every round; never
  // beyond the worst case at this row size.
  const uint64_t worst = sizes_.combineSendRows * rowBytes;
  const uint64_t capacity = roundUpPow2(std::max(needed, std::min(needed + needed / 4, worst)), 4096);
  EPCOMM_LOG(kInfo, "proxy channel: object " << objectId_ << " rank " << rank_ << " grows the combine send buffer from "
                                             << combineSendCapacity_ << " to " << capacity << " bytes (" << rows
                                             << " rows of " << rowBytes << " bytes)");
  // The old registration goes first: nothing reads it (see the header) and both need not be pinned at once.
  combineSendMr_.reset();
  combineSendBuf_.reset();
  combineSendCapacity_ = 0;
  combineSendBuf_ = allocBytes(capacity);
  combineSendMr_ = engine_->registerMemory(combineSendBuf_.get(), capacity);
  combineSendCapacity_ = capacity;
  return combineSendBuf_.get();
}

const uint8_t* ProxyChannel::entry(uint32_t s, uint32_t j) const {
  // This rank's own tokens are read straight from its send slot: no loopback copy.
  if (s == rank_) return sendBuf_.get() + sizes_.sendSlotOffset(rank_) + sizes_.headBytes + j * sizes_.entryBytes;
  return recvBuf_.get() + layout_.recvEntryOffset(sizes_, s, j);
}

uint8_t* ProxyChannel::combineSendRows(uint32_t g, uint64_t rowBytes) {
  return combineSendBuf_.get() + layout_.combineSendStart(g) * rowBytes;
}

const uint8_t* ProxyChannel::combineRows(uint32_t p, uint64_t rowBytes) const {
  if (p == rank_) return combineSendBuf_.get() + layout_.combineSendStart(rank_ / sizes_.dpSize) * rowBytes;
  return combineRecvBuf_.get() + layout_.combineRecvStart(p) * rowBytes;
}

std::string ProxyChannel::prefix(const char* phase, uint32_t round) const {
  std::ostringstream oss;
  oss << "host/proxy rank " << rank_ << ": " << phase << " (object " << objectId_;
  if (epoch_ > 0) oss << ", epoch " << epoch_;
  oss << ", round " << round << ")";
  return oss.str();
}

void ProxyChannel::rethrowIfBroken() const {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = error_;
  }
  if (!error) return;
  // Every call after a lost round says what to do, with the error that lost it.
  constexpr const char* kHint = "this object cannot continue: destroy it and create a new one";
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    if (e.message().find(kHint) != std::string::npos) throw;
    detail::throwError(e.code(), e.message() + "; " + kHint, e.file(), e.line());
  }
}

ChannelStats ProxyChannel::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void ProxyChannel::post(const Job& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
    jobs_.push_back(job);
  }
  cv_.notify_all();
}

void ProxyChannel::postDispatch() {
  Job job{JobKind::kDispatch, ++postedSeq_, round_++, dispatchedSinceCombine_, DType::kInvalid, {}};
  dispatchedSinceCombine_ = true;
  post(job);
}

void ProxyChannel::postCombine(DType yDtype) {
  (void)combinePhase(yDtype);
  EPCOMM_CHECK(round_ > 0, kInvalidArgument, "combine before any dispatch");
  rowBytes_ = static_cast<uint64_t>(config_.hiddenDim) * dtypeSize(yDtype);
  Job job{JobKind::kCombine, ++postedSeq_, round_ - 1, false, yDtype, {}};
  dispatchedSinceCombine_ = false;
  post(job);
}

void ProxyChannel::exchangeDispatch() {
  EPCOMM_CHECK(!thread_.joinable(), kInternal, "exchangeDispatch on a channel with its own proxy thread");
  Job job{JobKind::kDispatch, 0, round_++, dispatchedSinceCombine_, DType::kInvalid, {}};
  dispatchedSinceCombine_ = true;
  runExternal(job);
}

void ProxyChannel::exchangeCombine(DType yDtype) {
  EPCOMM_CHECK(!thread_.joinable(), kInternal, "exchangeCombine on a channel with its own proxy thread");
  (void)combinePhase(yDtype);
  EPCOMM_CHECK(round_ > 0, kInvalidArgument, "combine before any dispatch");
  rowBytes_ = static_cast<uint64_t>(config_.hiddenDim) * dtypeSize(yDtype);
  Job job{JobKind::kCombine, 0, round_ - 1, false, yDtype, {}};
  dispatchedSinceCombine_ = false;
  runExternal(job);
}

void ProxyChannel::runExternal(const Job& job) {
  rethrowIfBroken();
  std::exception_ptr lost;
  try {
    lost = runJob(job);
  } catch (...) {
    const std::exception_ptr failure = std::current_exception();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = failure;
    }
    // As the internal proxy thread does: the peers waiting for this rank learn at once that the round is lost.
    if (!failedByNotice_.load()) {
      const uint32_t kind = job.kind == JobKind::kCombine ? 1 : 0;
      try {
        std::rethrow_exception(failure);
      } catch (const Error& e) {
        sendNotice(kind, roundOf(job), true, e.code(), e.message());
      } catch (const std::exception& e) {
        sendNotice(kind, roundOf(job), true, ErrorCode::kInternal, e.what());
      } catch (...) {
        sendNotice(kind, roundOf(job), true, ErrorCode::kInternal, "unknown error");
      }
    }
    throw;
  }
  if (lost) {
    // Elastic: the round was lost to a peer's loss and the ranks agreed to go on (takeLostRound says so once).
    lostRoundTaken_ = true;
    std::rethrow_exception(lost);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (job.kind == JobKind::kDispatch) {
    ++stats_.dispatchRounds;
  } else if (job.kind == JobKind::kCombine) {
    ++stats_.combineRounds;
  }
}

void ProxyChannel::waitDispatch() { waitJob(postedSeq_, "dispatch receive"); }
void ProxyChannel::waitCombine() { waitJob(postedSeq_, "combine receive"); }

void ProxyChannel::waitJob(uint64_t seq, const char* what) {
  std::unique_lock<std::mutex> lock(mu_);
  // The job's own waits are each bounded by the timeout; this bound only guards against a proxy bug. An elastic job
  // may add an agreement (each member dropped costs a timeout) and its dispatch once more.
  const int64_t boundMs = (elastic_ ? 6 + 2 * static_cast<int64_t>(world_) : 4) * timeoutMs_ + 1000;
  const bool finished = cv_.wait_for(lock, std::chrono::milliseconds(boundMs), [&] {
    return doneSeq_ >= seq || error_ != nullptr || (userNoticeSeq_ == seq && !userNotice_.empty());
  });
  if (lostSeq_ == seq && lostError_) {
    // The round was lost to a peer's loss; the channel goes on with the ranks that agreed.
    std::exception_ptr lost = nullptr;
    lost.swap(lostError_);
    lostRoundTaken_ = true;
    std::rethrow_exception(lost);
  }
  if (doneSeq_ >= seq) return;
  if (error_) std::rethrow_exception(error_);
  if (userNoticeSeq_ == seq && !userNotice_.empty()) {
    // A peer refused its call: this call fails now, the exchange itself waits on (bounded by the timeout).
    std::string message;
    message.swap(userNotice_);
    detail::throwError(ErrorCode::kPeerFailure, message, __FILE__, __LINE__);
  }
  EPCOMM_CHECK(finished, kTimeout,
               "host/proxy rank " << rank_ << ": " << what << " (object " << objectId_
                                  << "): the proxy thread did not finish within " << boundMs << " ms");
}

void ProxyChannel::proxyLoop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_.load() || !jobs_.empty(); });
      if (stop_) return;
      job = jobs_.front();
      jobs_.pop_front();
    }
    currentJobSeq_ = job.seq;
    try {
      const std::exception_ptr lost = runJob(job);
      std::lock_guard<std::mutex> lock(mu_);
      doneSeq_ = job.seq;
      userNotice_.clear();
      if (lost) {
        lostSeq_ = job.seq;
        lostError_ = lost;
        jobs_.clear();
      } else if (job.kind == JobKind::kDispatch) {
        ++stats_.dispatchRounds;
      } else if (job.kind == JobKind::kCombine) {
        ++stats_.combineRounds;
      }
    } catch (...) {
      // Never let an exception escape the thread: the next call on the object rethrows it.
      std::exception_ptr failure = std::current_exception();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = failure;
        jobs_.clear();
      }
      // The peers waiting for this rank learn at once that the round is lost (unless a peer's notice ended it:
      // every rank got that one).
      if (!failedByNotice_.load()) {
        try {
          std::rethrow_exception(failure);
        } catch (const Error& e) {
          sendNotice(job.kind == JobKind::kCombine ? 1 : 0, roundOf(job), true, e.code(), e.message());
        } catch (const std::exception& e) {
          sendNotice(job.kind == JobKind::kCombine ? 1 : 0, roundOf(job), true, ErrorCode::kInternal, e.what());
        } catch (...) {
          sendNotice(job.kind == JobKind::kCombine ? 1 : 0, roundOf(job), true, ErrorCode::kInternal, "unknown error");
        }
      }
    }
    cv_.notify_all();
  }
}

void ProxyChannel::waitFromPeers(Phase phase, uint32_t round, std::vector<uint32_t> senders, const char* what) {
  const int64_t start = nowMs(), startUs = nowUs();
  const uint32_t noticeKind = phase < Phase::kCombineBf16 ? 0 : 1;  // the step a peer's notice must be about
  Backoff backoff;
  // A sender listed n times owes n immediates; messages and losses name it once.
  auto named = [&] {
    std::vector<uint32_t> ranks = senders;
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    return ranks;
  };
  // A peer that combined another dtype would otherwise look like a late one.
  auto checkDtypes = [&] {
    if (phase < Phase::kCombineBf16 || phase > Phase::kCombineF32) return;
    for (Phase other : {Phase::kCombineBf16, Phase::kCombineF16, Phase::kCombineF32}) {
      if (other == phase) continue;
      for (uint32_t s : senders) {
        EPCOMM_CHECK(
            engine_->immCount(encodeImm(tagId_, other, round, s)) == 0, kInvalidArgument,
            prefix(what, round) << ": rank " << s << " sent combine rows of another expertY dtype than this rank's");
      }
    }
  };
  while (!senders.empty()) {
    bool progressed = false;
    for (size_t i = 0; i < senders.size();) {
      const uint32_t imm = encodeImm(tagId_, phase, round, senders[i]);
      if (engine_->immCount(imm) >= 1) {
        engine_->waitImm(imm, 1, what);  // consumes the arrival; returns at once
        senders[i] = senders.back();
        senders.pop_back();
        progressed = true;
      } else {
        ++i;
      }
    }
    if (senders.empty()) break;
    std::sort(senders.begin(), senders.end());
    checkDtypes();
    checkNotices(noticeKind, round, senders, currentJobSeq_);
    if (elastic_) checkRecords(what, round);
    try {
      checkTransfers(prefix(what, round) + ": transfer failed while waiting for " + phaseName(phase) + " from " +
                     rankList(named()));
    } catch (const Error&) {
      // Most often a peer closed its connection. One that closed it after saying why (it refused its call, gave the
      // round up, left) sent that first, and the notice may still be queued behind the failure in the provider: a
      // moment's wait for it lets the caller hear the reason instead of the broken connection.
      awaitNoticeAfterFailure(noticeKind, round, senders);
      throw;
    }
    EPCOMM_CHECK(!stop_.load(), kInternal, prefix(what, round) << ": abandoned (object destroyed)");
    if (elastic_) heartbeat(start, senders);
    if (nowMs() - start > timeoutMs_) {
      // Elastic: a peer heard from lately is alive, and waits itself (for a dead rank, whose loss it reports): wait on
      // for it, up to three timeouts in all.
      const std::vector<uint32_t> awaited = named();
      const std::vector<uint32_t> silent = elastic_ ? silentPeers(awaited) : awaited;
      if (!silent.empty() || nowMs() - start > 3 * timeoutMs_) {
        const std::vector<uint32_t>& lost = silent.empty() ? awaited : silent;
        std::ostringstream oss;
        oss << prefix(what, round) << ": no " << phaseName(phase) << " from " << rankList(lost) << " after "
            << nowMs() - start << " ms (peer dead or stalled?)";
        if (elastic_) throw PeerLoss{ErrorCode::kTimeout, oss.str(), lost, kNoLostStep, {}};
        if (lost.size() > 1) awaitNoticeBeforeTimeout(noticeKind, round, senders);  // a peer's may name the lost one
        detail::throwError(ErrorCode::kTimeout, oss.str(), __FILE__, __LINE__);
      }
    }
    if (!progressed && nowUs() - startUs < kDriveAfterUs) {
      backoff.pause();
    } else if (!progressed) {
      // A long wait (large rounds): this thread drives the engine itself, so the peers' writes progress without a
      // hand-off to the progress thread (which polls on meanwhile: whichever holds the completion queue reads it).
      const uint32_t s0 = senders.front();
      if (driver_ != nullptr) {
        // In slices, so that a peer's notice is seen within milliseconds; the loop above consumes the arrival.
        const uint32_t imm = encodeImm(tagId_, phase, round, s0);
        try {
          driveFor([&] { return engine_->immCount(imm) >= 1 || noticePending() || recordPending(); }, 20);
        } catch (const Error& e) {
          checkDtypes();
          awaitNoticeAfterFailure(noticeKind, round, senders);
          rethrowEngineError(
              e, prefix(what, round) + ": while waiting for " + phaseName(phase) + " from " + rankList(named()));
        }
        continue;
      }
      std::ostringstream oss;
      oss << prefix(what, round) << ": no " << phaseName(phase) << " from rank " << s0;
      try {
        engine_->waitImm(encodeImm(tagId_, phase, round, s0), 1, oss.str());
      } catch (const Error& e) {
        checkDtypes();  // a wrong-dtype peer is named as such, not as late
        awaitNoticeAfterFailure(noticeKind, round, senders);
        rethrowEngineError(
            e, prefix(what, round) + ": while waiting for " + phaseName(phase) + " from " + rankList(named()));
      }
      senders.erase(senders.begin());
    }
  }
}

void ProxyChannel::waitLocalCompletions(const char* what, uint32_t round) {
  if (perPeer()) {
    waitPeerCompletions(what, round);
    return;
  }
  const uint32_t kind = std::strcmp(what, "combine") == 0 ? 1 : 0;
  // Every engine call below throws the engine's error as the engine words it ("scatter to peer 1 ... failed": no rank,
  // no phase, and a PeerId that is not a rank). A peer that closed its connection after saying why (its notice) is
  // heard first, as in waitFromPeers; else the error gains this rank, the phase and the rank written to.
  auto failed = [&](const Error& e) {
    awaitNoticeAfterFailure(kind, round, {});
    rethrowEngineError(e, prefix(what, round), peerRanks_);
  };
  const int64_t startUs = nowUs();
  Backoff backoff;
  while (localDone_.load(std::memory_order_acquire) < localPosted_) {
    try {
      engine_->checkErrors();
    } catch (const Error& e) {
      failed(e);
    }
    EPCOMM_CHECK(!stop_.load(), kInternal, prefix(what, round) << ": abandoned (object destroyed)");
    checkNotices(kind, round, {}, currentJobSeq_);
    if (nowUs() - startUs < kDriveAfterUs) {
      backoff.pause();
      continue;
    }
    try {
      if (driver_ != nullptr) {
        // In slices, as in waitFromPeers; the engine fails an operation that outlives its deadline.
        driveFor([&] { return localDone_.load(std::memory_order_acquire) >= localPosted_ || noticePending(); }, 20);
      } else {
        // As in waitFromPeers: a long wait drives the engine from this thread (bounded by the engine's timeout).
        engine_->waitCounter(
            localDone_, localPosted_,
            prefix(what, round) + ": this rank's writes to " + rankList(peerRanks_) + " did not complete");
      }
    } catch (const Error& e) {
      failed(e);
    }
  }
}

void ProxyChannel::checkTransfers(const std::string& context) {
  if (!perPeer()) {
    try {
      engine_->checkErrors();
    } catch (const Error& e) {
      rethrowEngineError(e, context);
    }
    return;
  }
  // Per peer: the engine keeps the first failed write for good, whichever peer it went to; the completions say which
  // peer, and a failed write to a peer that is masked already (a rank that left, a dead one) is no news.
  for (uint32_t p : peerRanks_) {
    const std::string error = peerError(p);
    if (error.empty()) continue;
    const ErrorCode code = error.find("timed out") != std::string::npos ? ErrorCode::kTimeout : ErrorCode::kFabric;
    const std::string message = context + ": a write to rank " + std::to_string(p) + " failed: " + error;
    if (elastic_) throw PeerLoss{code, message, {p}, kNoLostStep, {}};
    detail::throwError(code, message, __FILE__, __LINE__);
  }
}

bool ProxyChannel::driveFor(const std::function<bool()>& done, int64_t budgetMs) {
  if (driver_ != nullptr && !engineTainted_) {
    if (!perPeer()) return driver_->driveUntil(done, budgetMs);
    try {
      return driver_->driveUntil(done, budgetMs);
    } catch (const Error&) {
      // A write failed (to a peer that is gone, or masked), and the engine keeps that error for good: from now on the
      // engine's progress thread moves the data and this thread only polls (failed writes are reported per peer).
      engineTainted_ = true;
    }
  }
  const int64_t deadline = nowMs() + budgetMs;
  Backoff backoff;
  while (!done() && nowMs() < deadline) backoff.pause();
  return done();
}

// NOTE: connection-oriented providers (tcp;ofi_rxm, verbs;ofi_rxm) open a pair's connection lazily, on its first
// transfer. Left alone, every pair's first transfers start from both ends at once (each rank's first dispatch writes to
// every peer) and rxm has to resolve simultaneous connection requests: its log (FI_LOG_LEVEL=info) showed 16 such
// resolutions in 3 fresh W = 4 objects over tcp ('simultaneous, reject peer', 'simultaneous, accept peer', 'rejected,
// already connected', 'Connection refused'). The resolution closes one of the two connections, and a transfer that
// the other side already started on it is lost or fails ('Transport endpoint is not connected'). Measured without
// this step: 1 of 400 fresh W = 4 objects over tcp (Python API, fresh processes) lost round 0 (one rank's head reached
// no peer and no peer's head reached it; all waited out the timeout). So each pair is opened by its lower rank alone:
// rank r says hello to every higher rank and waits for the hello of every lower one, and the creator's barrier that
// follows puts every pair's connection up before any round. The log then shows one connection request per pair, no
// collision; 0 of 1,000 fresh objects through the Python API and 0 of 2,000 in C++ (ctest -L stress) failed.
void ProxyChannel::connectInRankOrder() {
  std::vector<uint32_t> lower;
  fabric::Completion done;
  done.counter = &localDone_;
  for (uint32_t p : peerRanks_) {
    if (p < rank_) {
      lower.push_back(p);
      continue;
    }
    ++localPosted_;
    engine_->immediate(peerIds_[p], encodeImm(objectId_, Phase::kConnect, 0, rank_), done);
  }
  waitFromPeers(Phase::kConnect, 0, lower, "connection setup");
  waitLocalCompletions("connection setup", 0);
}

void ProxyChannel::runBarrier(const Job& job) {
  if (peerRanks_.empty()) return;
  const uint32_t round = roundOf(job);
  const uint32_t imm = encodeImm(tagId_, Phase::kBarrier, round, rank_);
  if (perPeer()) {
    for (uint32_t p : peerRanks_) postToPeer(p, nullptr, 0, nullptr, 0, 0, imm);
  } else {
    fabric::Completion done;
    done.counter = &localDone_;
    ++localPosted_;
    engine_->barrier(headGroup_, imm, done);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t r : peerRanks_) ++stats_.peers[r].barrierImms;
  }
  waitFromPeers(Phase::kBarrier, round, peerRanks_, "dispatch barrier");
}

void ProxyChannel::runDispatch(const Job& job) {
  const ProtocolSizes& s = sizes_;
  const uint32_t round = roundOf(job);
  uint8_t* ownHead = sendSlot(rank_);
  const uint32_t* ownEntries = headEntryCounts(ownHead, s.numExperts);
  fabric::Completion done;
  done.counter = &localDone_;
  markMaskedRanks();

  // 1. The head alone to every peer first: a small write, so the first post returns at once on every provider (tcp
  //    sends a write inline: head and private tokens together took ~180 us to post at decode T = 128).
  const uint32_t headImm = encodeImm(tagId_, Phase::kHead, round, rank_);
  const uint32_t bulkImm = encodeImm(tagId_, Phase::kBulk, round, rank_);
  if (!peerRanks_.empty()) {
    std::vector<std::vector<fabric::ScatterSlice>> slices(peerRanks_.size());
    for (size_t i = 0; i < peerRanks_.size(); ++i) {
      slices[i].push_back(
          fabric::ScatterSlice{s.sendSlotOffset(peerRanks_[i]), s.privateSlotOffset(rank_), s.headBytes});
    }
    if (onPosting_) onPosting_(Phase::kHead);
    if (perPeer()) {
      for (size_t i = 0; i < peerRanks_.size(); ++i) {
        const fabric::ScatterSlice& sl = slices[i][0];
        if (skipWrite_ && skipWrite_(Phase::kHead, peerRanks_[i])) continue;
        postToPeer(peerRanks_[i], sendMr_.get(), sl.srcOffset, &recvDescs_[peerRanks_[i]], sl.dstOffset, sl.length,
                   headImm);
      }
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      ++localPosted_;
      engine_->scatter(headGroup_, *sendMr_, slices, true, headImm, done);
    }
  }
  if (onPosted_) onPosted_(Phase::kHead);
  // 2. Right behind it, the first tokens: to every peer whose bulk goes over the fabric, the entries that fit its
  //    private area, after the head, immediate bulk(sender). Nobody waits for the count exchange to move data.
  for (uint32_t p : peerRanks_) {
    const uint64_t n = fabricBulk(p) ? std::min(ownEntries[p], s.privateTokens) : 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.peers[p].headWrites;  // one head message per round: the counts, and its private tokens when any
      stats_.peers[p].bytes += s.headBytes + n * s.entryBytes;
    }
    if (n == 0) continue;
    const uint64_t srcOffset = s.sendSlotOffset(p) + s.headBytes;
    const uint64_t dstOffset = s.privateSlotOffset(rank_) + s.headBytes;
    if (perPeer()) {
      if (!(skipWrite_ && skipWrite_(Phase::kBulk, p))) {
        postToPeer(p, sendMr_.get(), srcOffset, &recvDescs_[p], dstOffset, n * s.entryBytes, bulkImm);
      }
    } else {
      ++localPosted_;
      engine_->write(peerIds_[p], *sendMr_, srcOffset, recvDescs_[p], dstOffset, n * s.entryBytes, true, bulkImm, done);
    }
  }

  // 3. Every peer's head; then everybody knows every count and computes the same offsets.
  waitFromPeers(Phase::kHead, round, peerRanks_, "dispatch");
  const size_t stride = static_cast<size_t>(s.numExperts) + s.worldSize;
  std::vector<uint32_t> counts(stride * s.worldSize);
  for (uint32_t r = 0; r < s.worldSize; ++r) {
    const uint8_t* head = r == rank_ ? ownHead : recvBuf_.get() + s.privateSlotOffset(r);
    std::memcpy(counts.data() + r * stride, head, stride * 4);
  }
  RoundLayout layout;
  layout.build(s, std::move(counts), active_);

  // 4. The rest as one contiguous write per peer, into that peer's overflow region. A sender whose bulk comes over
  //    the fabric announces up to two writes with bulk(sender): its private tokens (any) and its overflow (any), each
  //    known from its head; waitFromPeers counts a rank listed twice twice.
  std::vector<uint32_t> expectBulk;
  for (uint32_t p : peerRanks_) {
    if (!fabricBulk(p)) continue;  // its entries go another way; its overflow share stays unused
    const uint64_t n = layout.overflowEntries(rank_, p);
    if (n > 0) {
      const uint64_t length = n * s.entryBytes;
      const uint64_t srcOffset = s.sendSlotOffset(p) + s.headBytes + s.privateTokens * s.entryBytes;
      const uint64_t dstOffset = s.overflowOffset() + layout.overflowStart(rank_, p) * s.entryBytes;
      if (perPeer()) {
        if (!(skipWrite_ && skipWrite_(Phase::kBulk, p))) {
          postToPeer(p, sendMr_.get(), srcOffset, &recvDescs_[p], dstOffset, length, bulkImm);
        }
      } else {
        ++localPosted_;
        engine_->write(peerIds_[p], *sendMr_, srcOffset, recvDescs_[p], dstOffset, length, true, bulkImm, done);
      }
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.peers[p].bulkWrites;
      stats_.peers[p].bytes += length;
    }
    if (std::min(layout.entries(p, rank_), s.privateTokens) > 0) expectBulk.push_back(p);
    if (layout.overflowEntries(p, rank_) > 0) expectBulk.push_back(p);
  }
  waitFromPeers(Phase::kBulk, round, expectBulk, "dispatch");
  // The send slots are repacked by the next round: this round's writes must have left them.
  waitLocalCompletions("dispatch", round);
  layout_ = std::move(layout);
}

void ProxyChannel::runCombine(const Job& job) {
  const Phase phase = combinePhase(job.yDtype);
  const uint32_t round = roundOf(job);
  const uint32_t D = sizes_.dpSize;
  fabric::Completion done;
  done.counter = &localDone_;
  const uint32_t imm = encodeImm(tagId_, phase, round, rank_);
  if (!peerRanks_.empty()) {
    // One write per peer: the rows of the peer's DP group (the same source range for every rank of a group).
    std::vector<std::vector<fabric::ScatterSlice>> slices(peerRanks_.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < peerRanks_.size(); ++i) {
        const uint32_t q = peerRanks_[i];
        const uint32_t g = q / D;
        const uint64_t length = fabricBulk(q) ? layout_.combineRows(rank_, g) * rowBytes_ : 0;
        if (length > 0) {
          slices[i].push_back(fabric::ScatterSlice{layout_.combineSendStart(g) * rowBytes_,
                                                   layout_.combineRecvStartIn(g, rank_) * rowBytes_, length});
        }
        ++stats_.peers[q].combineWrites;
        stats_.peers[q].bytes += length;
      }
    }
    if (onPosting_) onPosting_(phase);
    if (perPeer()) {
      for (size_t i = 0; i < peerRanks_.size(); ++i) {
        const uint32_t q = peerRanks_[i];
        if (skipWrite_ && skipWrite_(phase, q)) continue;
        if (slices[i].empty()) {
          postToPeer(q, nullptr, 0, nullptr, 0, 0, imm);
        } else {
          const fabric::ScatterSlice& sl = slices[i][0];
          postToPeer(q, combineSendMr_.get(), sl.srcOffset, &combineRecvDescs_[q], sl.dstOffset, sl.length, imm);
        }
      }
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      ++localPosted_;
      engine_->scatter(combineGroup_, *combineSendMr_, slices, true, imm, done);
    }
  }
  if (onPosted_) onPosted_(phase);
  waitFromPeers(phase, round, peerRanks_, "combine");
  waitLocalCompletions("combine", round);
}

}  // namespace proxy
}  // namespace epcomm
