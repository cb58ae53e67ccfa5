// The proxy half of the protocol (SPEC 1.2): one per AllToAll object. Owns the TransferEngine, the registered
// buffers and a proxy thread that posts the writes and counts the immediates, so that the "device side" (CPU loops
// in the host backend, kernels in the GPU proxy backend) only packs and unpacks buffers.
//
// Round of dispatch:  device side packs the send slots -> postDispatch() (returns at once) -> the proxy thread
//   scatters the head to every peer, then writes each peer its private tokens, waits for every peer's head, computes
//   the RoundLayout, posts the overflow (one write per peer with overflow), waits for the peers' tokens ->
//   waitDispatch() -> device side unpacks.
// Round of combine:   device side packs rows per DP group -> postCombine() -> one write per peer -> waitCombine()
//   -> device side forms the weighted sums.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/config.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "proxy/protocol.hpp"

namespace epcomm {
namespace fabric {
class EngineBase;
}  // namespace fabric
}  // namespace epcomm

namespace epcomm {
namespace proxy {

/// Knobs of a channel (and of the backends built on it).
struct ChannelOptions {
  std::string provider;        ///< libfabric provider ("tcp", "shm", ...); "" = EPCOMM_FABRIC_PROVIDER, else probe.
  int64_t privateTokens = -1;  ///< Entries per sender's private area; < 0 = EPCOMM_PRIVATE_TOKENS / derived.
  int64_t timeoutMs = 0;       ///< Bound of every wait; 0 = EPCOMM_TIMEOUT_MS.
  /// The caller runs the exchanges itself (exchangeDispatch / exchangeCombine, from one thread of its own: the GPU
  /// proxy backend's thread, which follows flags written by kernels); no internal proxy thread is started.
  bool externalDriver = false;
  /// Size the combine send buffer for the worst case (every row fp32) at creation and never grow it, so that its
  /// address stays fixed (kernels write it through a mapping made once).
  bool fixedCombineSend = false;
  /// Called once for each of the four buffers right after it is allocated (page-aligned, `bytes` a multiple of the
  /// page), before it is registered with the engine and before any peer can write into it: e.g. to pin and map it
  /// for a GPU. May throw (the constructor then throws).
  std::function<void(uint8_t* data, uint64_t bytes)> onBuffer;
  /// Called on the exchanging thread right after a round's first fabric operation was posted (the head scatter of a
  /// dispatch, the row scatter of a combine): for phase traces.
  std::function<void(Phase phase)> onPosted;
  /// Called on the exchanging thread right before that first operation is posted: with onPosted, it splits the
  /// channel's own work after the caller's start from the provider's post call.
  std::function<void(Phase phase)> onPosting;
  /// Per peer (indexed by rank): whether the channel moves that peer's bulk, its entries and combine rows, over the
  /// fabric. Empty: every peer's. A peer marked false, one the caller reaches another way (the GPU proxy backend's
  /// same-node peers, over NVLink), still gets every control message, so the RoundLayout and the waits are the same:
  /// its head (without private tokens), the combine immediate (without rows), barriers and notices. The marks must be
  /// symmetric across ranks (both ends of a pair agree), else a rank waits for bytes that never come.
  std::vector<bool> bulkOverFabric;
  /// Elastic ranks (docs/failures.md): 1 = a peer that times out, whose writes fail or that leaves is masked once the
  /// other ranks agree, and the channel goes on without it (the round that lost it fails, the next ones run); 0 = such
  /// a failure breaks the channel; -1 = 0 here (the host backend reads EPCOMM_ELASTIC). Every rank must agree.
  int elastic = -1;
  /// Tests of elastic ranks: called before each write of a round's data to one peer (head, bulk, combine rows) when
  /// the channel writes per peer (elastic); true skips that write, as a rank that dies between two of its writes does.
  std::function<bool(Phase phase, uint32_t peer)> skipWrite;
};

/// Fabric operations this rank issued to one peer (cumulative). Each write carries its immediate.
struct PeerOps {
  uint64_t headWrites = 0;     ///< Dispatch: routing counts + private tokens (one per round, posted as the head,
                               ///< then the private tokens when there are any).
  uint64_t bulkWrites = 0;     ///< Dispatch: remaining tokens (one per round when the private area overflowed).
  uint64_t combineWrites = 0;  ///< Combine: expert outputs (one per round; zero bytes = immediate only).
  uint64_t barrierImms = 0;    ///< Immediates of the reuse barrier (dispatch followed by dispatch).
  uint64_t bytes = 0;          ///< Payload bytes of all of the above.
  uint64_t ops() const { return headWrites + bulkWrites + combineWrites + barrierImms; }
};

/// Counters of a channel.
struct ChannelStats {
  uint64_t dispatchRounds = 0;  ///< Dispatch exchanges completed.
  uint64_t combineRounds = 0;   ///< Combine exchanges completed.
  std::vector<PeerOps> peers;   ///< Indexed by rank; this rank's own entry stays zero (local copies).
};

/// See the file comment. Not thread-safe: one caller thread (the object's user) plus the internal proxy thread.
class ProxyChannel {
 public:
  /// Collective over `bootstrap`: creates the engine, allocates and registers the buffers, exchanges addresses and
  /// descriptors. Throws kFabric / kUnavailable from the engine, kBootstrap from the rendezvous.
  ProxyChannel(const Config& config, Bootstrap& bootstrap, const ChannelOptions& options);
  /// Stops the proxy thread (an exchange in progress is abandoned) and releases the buffers.
  ~ProxyChannel();
  ProxyChannel(const ProxyChannel&) = delete;
  ProxyChannel& operator=(const ProxyChannel&) = delete;

  const ProtocolSizes& sizes() const { return sizes_; }
  uint32_t objectId() const { return objectId_; }
  std::string providerName() const;
  int64_t timeoutMs() const { return timeoutMs_; }
  /// Bytes of registered host memory (all four buffers; the combine send buffer at its current capacity).
  uint64_t bufferBytes() const;

  /// Send slot for destination p (sizes().sendSlotBytes): head, then entries. Written by the device side before
  /// postDispatch(); not touched again until the next round.
  uint8_t* sendSlot(uint32_t p) { return sendBuf_.get() + sizes_.sendSlotOffset(p); }
  /// Entry j from sender s of the last completed dispatch (after waitDispatch()).
  const uint8_t* entry(uint32_t s, uint32_t j) const;
  /// Raw buffers for the device side (layouts in ProtocolSizes / RoundLayout).
  const uint8_t* recvBuffer() const { return recvBuf_.get(); }
  uint8_t* combineSendBuffer() { return combineSendBuf_.get(); }
  /// The combine send buffer, grown first (reallocated and re-registered, contents dropped) when the last
  /// dispatch's rows at rowBytes each do not fit. Call between waitDispatch() and postCombine() only: then no
  /// operation reads the buffer (the previous combine waited for its writes).
  uint8_t* combineSendBufferFor(uint64_t rowBytes);
  const uint8_t* combineRecvBuffer() const { return combineRecvBuf_.get(); }
  /// The layout of the last completed dispatch (after waitDispatch()).
  const RoundLayout& layout() const { return layout_; }

  /// Starts the exchange of the packed send slots; returns without waiting. If the previous dispatch was not
  /// followed by a combine, the proxy first runs a barrier so that no peer overwrites a buffer still being read.
  void postDispatch();
  /// Waits (bounded) until every peer's tokens have landed; rethrows the exchange's error.
  void waitDispatch();

  /// Combine rows for DP group g (rowBytes each), packed by the device side before postCombine().
  uint8_t* combineSendRows(uint32_t g, uint64_t rowBytes);
  /// Rows received from owner p for this rank's group (p == this rank: its own send rows), after waitCombine().
  const uint8_t* combineRows(uint32_t p, uint64_t rowBytes) const;
  /// Starts the combine exchange of rows of dtype yDtype (bf16/fp16/fp32); returns without waiting.
  void postCombine(DType yDtype);
  /// Waits (bounded) until every owner's rows have landed; rethrows the exchange's error.
  void waitCombine();

  /// externalDriver only: one dispatch exchange (what the proxy thread runs after postDispatch) on the calling
  /// thread; returns when the peers' tokens have landed and layout() is this round's. Throws what waitDispatch would
  /// and records it (every later call rethrows), except a round lost to a peer while the ranks agreed to go on
  /// (elastic): then takeLostRound() is true once and the channel goes on (the next exchange is a dispatch).
  void exchangeDispatch();
  /// externalDriver only: one combine exchange of rows of dtype yDtype (packed with combineSendRows), on the calling
  /// thread; returns when every owner's rows have landed. Errors as exchangeDispatch.
  void exchangeCombine(DType yDtype);
  /// Makes the waits of an exchange in progress give up (kInternal, "abandoned") at their next check: for a driver
  /// thread that is being stopped.
  void requestStop() { stop_ = true; }
  /// The engine the channel writes with (e.g. to ask whether its provider registers GPU memory).
  fabric::TransferEngine& engine() { return *engine_; }

  /// Tells every peer that this rank refused its call of a round before sending anything (an argument check
  /// failed): a peer waiting for this rank's data raises kPeerFailure with `message` at once instead of running
  /// into the timeout, and may wait on (the round goes on if this rank calls again). `combine`: the combine of the
  /// last dispatch; else the next dispatch. Best effort: never throws.
  void noticeRefused(bool combine, const std::string& message);
  /// Tells every peer that this rank gives the object up mid-round (e.g. destroys it after a failed call): their
  /// waits for it end at once with `message`, and their objects are unusable from then on (elastic: they mask this
  /// rank). Never throws.
  void noticeAbandoned(const std::string& message);

  // ---- Elastic ranks (proxy_elastic.cc; docs/failures.md "Elastic ranks") ----

  /// Whether a peer's loss masks it (ChannelOptions::elastic) instead of breaking the channel.
  bool elastic() const { return elastic_; }
  /// The active-ranks mask the ranks last agreed on (W entries, 1 = active). Thread-safe.
  std::vector<uint8_t> activeRanks() const;
  /// Collective over the active ranks (`mask`: W entries of 0 / 1, no rank made active again): the ranks active in
  /// `mask` agree on a new mask, the intersection of every participant's `mask` and of the ranks each one still hears
  /// from, and the next round runs with it; a rank whose own entry is 0 answers them and leaves (later calls on it
  /// throw). Call between rounds; with externalDriver, while no exchange runs: the agreement runs on the calling
  /// thread. Blocks, each wait for a peer's answer bounded by the timeout (elastic: a peer that does not answer is
  /// masked; else kTimeout and the channel is broken). Throws kInvalidArgument for a bad mask, before anything is
  /// sent.
  void setActiveRanks(const std::vector<uint8_t>& mask);
  /// True once after waitDispatch / waitCombine (or exchangeDispatch / exchangeCombine) threw because the round was
  /// lost to a peer's loss while the channel goes on with the ranks that agreed (the round is over: the next call is a
  /// dispatch).
  bool takeLostRound();
  /// A copy of the counters.
  ChannelStats stats() const;
  /// Rethrows the error that broke the channel, if any.
  void rethrowIfBroken() const;

 private:
  enum class JobKind { kDispatch, kCombine, kAgree };
  struct Job {
    JobKind kind;
    uint64_t seq;
    uint32_t round;
    bool barrierFirst;
    DType yDtype;
    std::vector<uint8_t> mask;  // kAgree: the caller's mask
  };

  // A round lost to peers that are gone (elastic ranks): thrown inside an exchange and caught by runJob, which then
  // runs the agreement. Not an Error, so that the sites that add context to an Error let it pass.
  struct PeerLoss {
    ErrorCode code;
    std::string message;
    std::vector<uint32_t> ranks;  // ranks this rank now takes for lost
    uint64_t lostStep;            // a peer's record: the step it lost; kNoLostStep: this rank's own detection
    std::string reason;           // what this rank's record says: the first detection's message ("": message)
  };
  // One peer's agreement record as read (AgreeWire).
  struct PeerRecord {
    uint32_t seq = 0;
    uint32_t epoch = 0;
    uint64_t lostStep = kNoLostStep;
    int32_t code = 0;
    std::string text;
    std::vector<uint8_t> view;
  };

  void proxyLoop();
  // Runs one job. Elastic: a round lost to peers runs the agreement, then either runs the dispatch again with the
  // ranks that agreed or ends the job; returns the error for the caller then (the channel goes on), else nullptr.
  std::exception_ptr runJob(const Job& job);
  void runDispatch(const Job& job);
  void runCombine(const Job& job);
  void runBarrier(const Job& job);
  // Waits until every sender in `senders` delivered one immediate of `phase` for `round`, consuming them.
  void waitFromPeers(Phase phase, uint32_t round, std::vector<uint32_t> senders, const char* what);
  void waitLocalCompletions(const char* what, uint32_t round);
  // Opens every pair's connection from its lower rank only, before the first round (see the NOTE in the .cc).
  void connectInRankOrder();
  void post(const Job& job);
  // Runs `job` on the calling thread (externalDriver), counting it or recording its error.
  void runExternal(const Job& job);
  void waitJob(uint64_t seq, const char* what);
  std::string prefix(const char* phase, uint32_t round) const;
  // The job's round counted from the start of the current epoch (what tags and notices carry).
  uint32_t roundOf(const Job& job) const { return job.round - epochBase_.load(); }
  // Throws the first transfer error: the engine's (non-elastic), or a failed write to an active peer (per peer).
  void checkTransfers(const std::string& context);
  // Rethrows an engine error, keeping its code, with `context` (rank, phase, peers awaited) and the rank that a failed
  // write went to in front of the engine's message; `writtenTo` when the message cites no PeerId of a peer.
  [[noreturn]] void rethrowEngineError(const Error& e, const std::string& context,
                                       const std::vector<uint32_t>& writtenTo = {}) const;

  // ---- Elastic ranks (proxy_elastic.cc) ----
  // Writes one at a time with a completion per peer: elastic (a failed write names its peer), or once a rank is
  // masked (the groups include it).
  bool perPeer() const { return elastic_ || epoch_ > 0; }
  void postToPeer(uint32_t p, const fabric::MemoryRegion* src, uint64_t srcOffset, const fabric::MemoryDesc* dst,
                  uint64_t dstOffset, uint64_t length, uint32_t imm);
  // waitLocalCompletions for the writes of postToPeer: those to active peers only.
  void waitPeerCompletions(const char* what, uint32_t round);
  // Marks the masked ranks in the head of every send slot (kMaskedEntries).
  void markMaskedRanks();
  // Agreement records (AgreeWire).
  // Writes this rank's record for `epoch` to the ranks of view_ and, if given, of `alsoTo` (ranks a caller's mask
  // drops, which answer before they leave).
  void sendRecord(uint32_t epoch, int32_t code, const std::string& text, const std::vector<uint8_t>* alsoTo = nullptr);
  void readRecords();
  bool recordPending() const;
  const PeerRecord* recordOf(uint32_t s, uint32_t epoch) const;
  // Elastic: throws PeerLoss when an active peer proposes the next epoch (it lost a round); `what`, `round`: the wait.
  void checkRecords(const char* what, uint32_t round);
  // Elastic: during a long wait (since waitStartMs), tells the active peers that are not awaited that this rank is
  // alive (an immediate every quarter of the timeout), so that a peer waiting for this rank, which itself waits for a
  // dead one, does not take it for dead.
  void heartbeat(int64_t waitStartMs, const std::vector<uint32_t>& awaited);
  // Elastic: of `awaited` (a wait that timed out), the ranks not heard from (data, record or heartbeat) in the last
  // half timeout: the ones to take for lost.
  std::vector<uint32_t> silentPeers(const std::vector<uint32_t>& awaited);
  // Runs the agreement on the next epoch from view_ and adopts it (epoch_, active_, tags, peers). Throws Error when
  // this rank is masked by its peers, or (non-elastic) when a peer does not answer.
  void runAgreement(int32_t code, const std::string& text, const std::vector<uint8_t>* alsoTo = nullptr);
  // setActiveRanks on a rank that masks itself: it tells the ranks that stay and waits until each answered (so each
  // has finished the rounds before, and has this rank's writes of them), then takes no part any more.
  void leave(const std::vector<uint8_t>& mask);
  // Elastic: what runJob does with a lost round; returns true when the dispatch runs again.
  bool recoverFromLoss(const Job& job, const PeerLoss& loss, std::exception_ptr* error);
  // Makes the mask of a new epoch effective: tags, peers, the next dispatch's round 0.
  void adoptEpoch(uint32_t epoch);
  std::string maskText(const std::vector<uint8_t>& mask) const;
  // Notices (NoticeWire): a peer that refused a call or gave a round up, so that waits for it end at once.
  struct Notice {
    uint32_t seq = 0;  // 0: none yet
    uint32_t round = 0;
    uint8_t kind = 0;
    bool fatal = false;
    int32_t code = 0;
    std::string text;
    bool unread = false;   // an immediate arrived whose notice was not read yet
    bool handled = false;  // raised (or found stale) already
  };
  void sendNotice(uint32_t kind, uint32_t round, bool fatal, ErrorCode code, const std::string& text);
  // Reads the notices that arrived (exchanging thread only). Raises a peer's fatal notice; hands a refusal by a
  // peer in `awaited` for this job (kind, round) to the caller waiting in waitJob (jobSeq).
  void checkNotices(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited, uint64_t jobSeq);
  // After a failed transfer (exchanging thread only): reads the notices for a short while, so that a peer that said
  // why before closing its connection is heard: throws its fatal notice, or its refusal of this step as kPeerFailure;
  // returns when none came.
  void awaitNoticeAfterFailure(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited);
  // Before a timeout that names several peers (exchanging thread only): one of them may wait itself for another one,
  // and its own timeout, due about now, names the rank that is gone. Reads the notices for up to min(500 ms, a quarter
  // of the timeout), driving the engine: throws a peer's fatal notice as above; returns when none came.
  void awaitNoticeBeforeTimeout(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited);
  // Throws a peer's fatal notice, or its refusal of this step as kPeerFailure, if one has come.
  void throwNoticeIfAny(uint32_t kind, uint32_t round, const std::vector<uint32_t>& awaited);
  // Waits until done() or budgetMs, driving the engine from this thread when it can.
  bool driveFor(const std::function<bool()>& done, int64_t budgetMs);
  bool noticePending() const;

  Config config_;
  ProtocolSizes sizes_;
  std::function<void(Phase)> onPosted_, onPosting_;
  std::vector<bool> bulkOverFabric_;                // ChannelOptions::bulkOverFabric
  std::function<bool(Phase, uint32_t)> skipWrite_;  // ChannelOptions::skipWrite
  bool fabricBulk(uint32_t p) const { return bulkOverFabric_.empty() || bulkOverFabric_[p]; }
  int64_t timeoutMs_ = 0;
  uint32_t objectId_ = 0;
  uint32_t rank_ = 0, world_ = 0;

  struct FreeBytes {
    void operator()(uint8_t* p) const;
  };
  // Page-aligned, zeroed, at least one page.
  static std::unique_ptr<uint8_t, FreeBytes> allocBytes(uint64_t bytes);
  std::unique_ptr<uint8_t, FreeBytes> sendBuf_, recvBuf_, combineSendBuf_, combineRecvBuf_;
  uint64_t combineSendCapacity_ = 0;  // bytes of combineSendBuf_ (registered); grows, never shrinks
  // Notice slots (NoticeWire): W incoming, then this rank's outgoing one. Outlives the engine, like the buffers above.
  std::unique_ptr<uint8_t, FreeBytes> noticeBuf_;
  std::unique_ptr<fabric::TransferEngine> engine_;
  std::unique_ptr<fabric::MemoryRegion> sendMr_, recvMr_, combineSendMr_, combineRecvMr_;
  std::vector<fabric::PeerId> peerIds_;                           // by rank (self: unused)
  std::vector<uint32_t> peerRanks_;                               // group member index -> rank
  std::vector<fabric::MemoryDesc> recvDescs_, combineRecvDescs_;  // by rank
  fabric::GroupId headGroup_ = 0, combineGroup_ = 0;              // W > 1 only; destroyed with the channel

  RoundLayout layout_;
  uint32_t round_ = 0;
  bool dispatchedSinceCombine_ = false;
  uint64_t rowBytes_ = 0;

  std::atomic<uint64_t> localDone_{0};  // completions of this rank's posted operations
  uint64_t localPosted_ = 0;            // touched by the proxy thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  uint64_t postedSeq_ = 0, doneSeq_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> stop_{false};
  ChannelStats stats_;

  std::unique_ptr<fabric::MemoryRegion> noticeMr_;
  std::vector<fabric::MemoryDesc> noticeDescs_;  // by rank
  fabric::EngineBase* driver_ = nullptr;         // the engine, when it can be driven in slices (driveUntil)
  std::vector<Notice> notices_;                  // by sender; the exchanging thread's
  uint64_t currentJobSeq_ = 0;                   // job the exchanging thread runs (for notices to waitJob)
  std::string userNotice_;                       // a peer's refusal for the caller waiting on userNoticeSeq_
  uint64_t userNoticeSeq_ = 0;
  std::atomic<bool> failedByNotice_{false};  // the exchange failed because of a peer's notice: do not echo it
  std::mutex noticeMu_;                      // serialises sendNotice, and guards noticePosted_
  uint32_t noticeSeq_ = 0;

  // Elastic ranks. active_ is the agreed mask (written by the exchanging thread, under mu_ for readers elsewhere),
  // view_ this rank's proposal (active_ less the ranks it takes for lost), epoch_ the number of agreements so far;
  // tagId_ = objectId_ + epoch_ goes into every immediate of the epoch, so a round never consumes an immediate of an
  // earlier epoch. epochBase_: the caller's round number of the epoch's first dispatch (its round 0).
  bool elastic_ = false;
  std::vector<uint8_t> active_, view_;
  uint32_t epoch_ = 0;
  uint32_t tagId_ = 0;
  std::atomic<uint32_t> epochBase_{0};
  std::atomic<bool> epochFresh_{false};  // the next dispatch job is the epoch's round 0
  uint64_t lostStep_ = kNoLostStep;      // earliest step known lost in the current epoch (this rank's or a record's)
  uint64_t agreedLost_ = kNoLostStep;    // the lost step the last agreement settled on
  bool engineTainted_ = false;           // the engine recorded an error (a write to a lost peer): poll, do not drive
  std::atomic<bool> selfMasked_{false};  // this rank left (setActiveRanks) or its peers masked it
  // Writes of postToPeer: posted per peer (exchanging thread), and what their completions report, shared with the
  // completion callbacks (which may run after the channel is gone).
  struct PeerWrites {
    explicit PeerWrites(uint32_t world) : done(new std::atomic<uint64_t>[world]), error(world) {
      for (uint32_t r = 0; r < world; ++r) done[r].store(0);
    }
    std::unique_ptr<std::atomic<uint64_t>[]> done;  // completions (success or failure) per peer
    std::mutex mu;
    std::vector<std::string> error;  // first failure per peer
    // The completion of a write to peer p: counts it in `writes` (kept alive by the callback) and keeps its error.
    static fabric::Completion completionFor(const std::shared_ptr<PeerWrites>& writes, uint32_t p) {
      fabric::Completion c;
      c.callback = [writes, p](const std::string& e) {
        if (!e.empty()) {
          std::lock_guard<std::mutex> lock(writes->mu);
          if (writes->error[p].empty()) writes->error[p] = e;
        }
        writes->done[p].fetch_add(1, std::memory_order_acq_rel);
      };
      return c;
    }
  };
  std::vector<uint64_t> peerPosted_;
  std::shared_ptr<PeerWrites> peerWrites_;
  // Writes of sendNotice, the same way: posted per peer (under noticeMu_), and what their completions report.
  std::vector<uint64_t> noticePosted_;
  std::shared_ptr<PeerWrites> noticeWrites_;
  // With noticeMu_ held: waits until every notice this rank posted to a peer not known lost has completed, or until
  // deadlineMs (absolute). A peer is known lost when a write of this rank to it failed (a notice, a postToPeer write,
  // or the one the engine's recorded error cites), or the agreed mask leaves it out: a write to it may never complete.
  void awaitNotices(int64_t deadlineMs);
  // The first failed write to peer p since the channel was created ("" if none).
  std::string peerError(uint32_t p) const;
  // Agreement slots: 2 per sender (by epoch parity), then this rank's outgoing record.
  std::unique_ptr<uint8_t, FreeBytes> agreeBuf_;
  std::unique_ptr<fabric::MemoryRegion> agreeMr_;
  std::vector<fabric::MemoryDesc> agreeDescs_;  // by rank
  std::vector<PeerRecord> records_;             // [sender * 2 + epoch parity]
  std::vector<uint8_t> recordUnread_;           // by sender
  uint32_t recordSeq_ = 0;
  std::vector<int64_t> lastHeard_;  // by sender: when its last record or heartbeat arrived (ms)
  int64_t lastBeatMs_ = 0;          // when this rank last sent a heartbeat
  // A job whose round was lost (elastic): waitJob throws its error once; takeLostRound reports it once.
  uint64_t lostSeq_ = 0;
  std::exception_ptr lostError_;
  bool lostRoundTaken_ = false;

  std::thread thread_;
};

}  // namespace proxy
}  // namespace epcomm
