// The proxy half of the protocol (SPEC 1.2): one per AllToAll object. Owns the TransferEngine, the registered
// buffers and a proxy thread that posts the writes and counts the immediates, so that the "device side" (CPU loops
// in the host backend, kernels in the GPU proxy backend) only packs and unpacks buffers.
//
// Round of dispatch:  device side packs the send slots -> postDispatch() (returns at once) -> the proxy thread
//   scatters head + private tokens to every peer, waits for every peer's head, computes the RoundLayout, posts the
//   bulk (one write per peer with overflow), waits for the peers' bulks -> waitDispatch() -> device side unpacks.
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
  /// Per peer (indexed by rank): whether the channel moves that peer's bulk, its entries and combine rows, over the
  /// fabric. Empty: every peer's. A peer marked false, one the caller reaches another way (the GPU proxy backend's
  /// same-node peers, over NVLink), still gets every control message, so the RoundLayout and the waits are the same:
  /// its head (without private tokens), the combine immediate (without rows), barriers and notices. The marks must be
  /// symmetric across ranks (both ends of a pair agree), else a rank waits for bytes that never come.
  std::vector<bool> bulkOverFabric;
};

/// Fabric operations this rank issued to one peer (cumulative). Each write carries its immediate.
struct PeerOps {
  uint64_t headWrites = 0;     ///< Dispatch: routing counts + private tokens (one per round).
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
  /// and records it (every later call rethrows).
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
  /// waits for it end at once with `message`, and their objects are unusable from then on. Never throws.
  void noticeAbandoned(const std::string& message);

  /// A copy of the counters.
  ChannelStats stats() const;
  /// Rethrows the error that broke the channel, if any.
  void rethrowIfBroken() const;

 private:
  enum class JobKind { kDispatch, kCombine };
  struct Job {
    JobKind kind;
    uint64_t seq;
    uint32_t round;
    bool barrierFirst;
    DType yDtype;
  };

  void proxyLoop();
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
  // Waits until done() or budgetMs, driving the engine from this thread when it can.
  bool driveFor(const std::function<bool()>& done, int64_t budgetMs);
  bool noticePending() const;

  Config config_;
  ProtocolSizes sizes_;
  std::function<void(Phase)> onPosted_;
  std::vector<bool> bulkOverFabric_;  // ChannelOptions::bulkOverFabric
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
  fabric::GroupId headGroup_ = 0, combineGroup_ = 0;

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
  std::mutex noticeMu_;                      // serialises sendNotice
  uint32_t noticeSeq_ = 0;
  std::atomic<uint64_t> noticeDone_{0};
  uint64_t noticePosted_ = 0;

  std::thread thread_;
};

}  // namespace proxy
}  // namespace epcomm
