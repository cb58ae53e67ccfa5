// Parts shared by the libfabric and libibverbs engines: receive-side immediate counters, error recording,
// bounded waits that drive progress, control-message queues, and the planning of one-sided operations
// (sharding over NICs, groups, paged writes) down to per-NIC chunk lists that each engine posts.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"

namespace epcomm {
namespace fabric {

/// Milliseconds on the steady clock.
int64_t nowMs();

/// 64-bit FNV-1a of a byte string (peer identity of control messages, address fingerprints).
uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed = 1469598103934665603ull);

/// Throws kInvalidArgument unless [data, data + bytes) is non-empty and mapped in this process. Providers that
/// register lazily (tcp, shm) would accept an unmapped range and fail later, far from the cause.
void checkHostRange(const void* data, size_t bytes);

/// registerMemory's argument checks shared by the engines: host ranges go through checkHostRange; CUDA ranges
/// (which mincore cannot vet) must at least be non-null and non-empty. Throws kInvalidArgument.
void checkRegisterRange(const void* data, size_t bytes, MemoryKind kind);

/// The peers an engine added, indexed by PeerId. Entry is the transport's per-peer state and carries
/// `uint64_t hash` (fingerprint of the peer's address). Every access holds the table's mutex.
template <typename Entry>
class PeerTable {
 public:
  /// Number of peers added so far.
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.size();
  }
  /// Address fingerprint of a peer; std::out_of_range for an unknown one (callers check size() first).
  uint64_t hash(PeerId peer) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.at(peer).hash;
  }
  /// Appends a peer and returns its PeerId.
  PeerId add(Entry entry) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.push_back(std::move(entry));
    return static_cast<PeerId>(entries_.size() - 1);
  }
  /// Runs fn(entries) with the mutex held and returns its result; fn must not use the table itself.
  template <typename Fn>
  auto locked(Fn&& fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    return fn(static_cast<const std::vector<Entry>&>(entries_));
  }
  template <typename Fn>
  auto locked(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mu_);
    return fn(entries_);
  }

 private:
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
};

/// State of one user-visible operation (write, one scatter member, ...). Shared by its pieces; finished once.
struct OpState {
  Completion done;
  PeerId peer = 0;
  const char* what = "";        ///< "write", "immediate", "send", ... (a literal) for messages.
  int64_t deadlineMs = 0;       ///< Absolute; pieces not completed by then fail the op with kTimeout.
  std::atomic<int> pending{0};  ///< Pieces not yet completed.
  std::atomic<bool> reported{false};
  std::mutex mu;
  std::string error;  ///< First error of any piece (guarded by mu).

  /// Records an error (first one wins).
  void fail(const std::string& message);
  std::string errorText();
};

/// Common implementation of TransferEngine. Engines implement addressing, registration, posting and progress.
class EngineBase : public TransferEngine {
 public:
  explicit EngineBase(const EngineOptions& options);
  ~EngineBase() override;

  int numNics() const override { return numNics_; }

  void write(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, const MemoryDesc& dst, uint64_t dstOffset,
             uint64_t length, bool withImm, uint32_t imm, Completion done) override;
  void immediate(PeerId peer, uint32_t imm, Completion done) override;
  GroupId createGroup(const std::vector<PeerId>& members, const std::vector<MemoryDesc>& dsts) override;
  void destroyGroup(GroupId group) override;
  void scatter(GroupId group, const MemoryRegion& src, const std::vector<std::vector<ScatterSlice>>& slices,
               bool withImm, uint32_t imm, Completion done) override;
  void barrier(GroupId group, uint32_t imm, Completion done) override;
  void pagedWrite(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, uint64_t srcStride,
                  const std::vector<uint32_t>& srcPages, const MemoryDesc& dst, uint64_t dstOffset, uint64_t dstStride,
                  const std::vector<uint32_t>& dstPages, uint64_t pageBytes, bool withImm, uint32_t imm,
                  Completion done) override;
  size_t recv(PeerId peer, void* data, size_t capacity) override;

  uint64_t immCount(uint32_t imm) const override;
  void waitImm(uint32_t imm, uint64_t count, const std::string& what) override;
  void waitCounter(const std::atomic<uint64_t>& counter, uint64_t target, const std::string& what) override;
  void checkErrors() override;

  /// Immediates each imm-carrying operation delivers to the receiver (numNics when sharding by bytes, else 1).
  uint32_t piecesPerImm() const { return piecesPerImm_; }

  /// Drives progress on the calling thread (the progress thread polls on meanwhile, as in waitImm) until done()
  /// holds or budgetMs passed; returns done(). Throws the engine's recorded error. For a caller that waits for one of
  /// several events (an immediate, or a peer's notice that it gave up) and so cannot block in waitImm for the whole
  /// timeout.
  bool driveUntil(const std::function<bool()>& done, int64_t budgetMs);

 protected:
  /// Where one peer's region lives, resolved once (group templates keep these).
  struct Target {
    PeerId peer = 0;
    uint64_t size = 0;
    uint64_t remoteBase[kMaxNics] = {0, 0, 0, 0};  ///< Address the provider expects for offset 0.
    uint64_t key[kMaxNics] = {0, 0, 0, 0};
  };
  /// A contiguous piece of a transfer.
  struct Chunk {
    uint64_t srcOffset = 0;
    uint64_t dstOffset = 0;
    uint64_t length = 0;
  };
  /// What one NIC carries for an operation: data chunks, then (if imm) an immediate once they have landed.
  struct NicPlan {
    std::vector<Chunk> chunks;
    bool imm = false;
  };

  /// Operations whose last piece completed under a NIC lock; reported through finishOp once the lock is dropped.
  using Finished = std::vector<std::shared_ptr<OpState>>;

  /// Control messages travel as a 16-byte header (uint64 sender hash, uint32 length, uint32 reserved) followed by
  /// at most kMaxMessage bytes of payload.
  static constexpr size_t kMsgHeader = 16;
  static constexpr size_t kMaxMessage = 4096;

  /// Resolves desc for peer (checks the NIC count and that the peer exists).
  virtual Target makeTarget(PeerId peer, const MemoryDesc& desc) = 0;
  /// Posts plan[nic] for every NIC (plan.size() == numNics). `src` may be null when no chunk has data.
  /// The engine sets op->pending and finishes the op through finishOp. Never blocks on completions.
  virtual void postPlan(const Target& target, const MemoryRegion* src, std::vector<NicPlan>& plan, uint32_t imm,
                        const std::shared_ptr<OpState>& op) = 0;
  /// Polls every NIC once (non-blocking; safe from any thread). Returns true if anything happened.
  virtual bool progressOnce() = 0;
  /// Number of peers added so far.
  virtual size_t numPeers() const = 0;
  /// Fingerprint of a peer's address (used to match control messages to PeerIds).
  virtual uint64_t peerHash(PeerId peer) const = 0;

  std::shared_ptr<OpState> newOp(PeerId peer, const char* what, Completion done);
  /// Reports the op (once): counter/callback, and records a failure in the engine.
  void finishOp(const std::shared_ptr<OpState>& op);
  /// Sets op's piece count before any piece is posted (so no completion can finish it early). An op with no pieces
  /// is finished here; returns false then, as there is nothing to post.
  bool armOp(const std::shared_ptr<OpState>& op, int pieces);
  /// Receive side: one immediate piece with value imm arrived.
  void countImm(uint32_t imm);
  /// Receive side: a control message from the peer whose address hash is srcHash.
  void deliverMessage(uint64_t srcHash, const uint8_t* data, size_t bytes);
  /// Send side: header (selfHash_, bytes) and payload of a control message, ready to post.
  std::vector<uint8_t> frameMessage(const void* data, size_t bytes) const;
  /// Receive side: delivers the framed message in buf[0, received) (see frameMessage); a message shorter than its
  /// header or than the length it announces is dropped.
  void deliverFramed(const uint8_t* buf, size_t received);
  /// Completes a registration's descriptor: addr, size and numNics (the engine has set keys[]), then the checksum
  /// that MemoryDesc::deserialize verifies.
  void sealDesc(MemoryDesc& desc, const void* data, size_t bytes) const;
  /// Records the first engine error (sticky).
  void recordError(ErrorCode code, const std::string& message);
  bool hasError() const { return hasError_.load(std::memory_order_acquire); }
  [[noreturn]] void throwRecorded();

  /// Call at the end of the engine's constructor, once address() works: fixes selfHash_ from the address and
  /// starts the progress thread. stopProgress in the engine's destructor.
  void startProgress();
  void stopProgress();

  int64_t timeoutMs() const { return timeoutMs_; }
  const EngineOptions& options() const { return options_; }
  /// Splits an op into per-NIC chunk lists following the sharding mode.
  std::vector<NicPlan> planChunks(PeerId peer, std::vector<Chunk> chunks, bool withImm, bool splitBytes) const;
  void checkTargetRange(const Target& t, const MemoryRegion* src, const std::vector<Chunk>& chunks) const;

  EngineOptions options_;
  uint64_t selfHash_ = 0;  ///< fnv1a64 of this engine's address(), the sender identity in control messages.
  int numNics_ = 1;
  int64_t timeoutMs_ = 10000;
  uint32_t piecesPerImm_ = 1;

 private:
  template <typename Done, typename Describe>
  void waitUntil(Done done, Describe describe);
  void progressLoop();

  /// Callers inside waitUntil / driveUntil (they drive progress themselves); the progress thread keeps polling while
  /// there is one.
  std::atomic<uint32_t> drivers_{0};
  struct DriverMark {
    explicit DriverMark(std::atomic<uint32_t>& n) : n_(n) { n_.fetch_add(1, std::memory_order_relaxed); }
    ~DriverMark() { n_.fetch_sub(1, std::memory_order_relaxed); }
    DriverMark(const DriverMark&) = delete;
    DriverMark& operator=(const DriverMark&) = delete;

   private:
    std::atomic<uint32_t>& n_;
  };

  // Immediates: a fixed array for small values (no lock on the hot path), a map for the rest.
  static constexpr uint32_t kDirectImms = 1u << 16;
  std::unique_ptr<std::atomic<uint64_t>[]> immDirect_;
  mutable std::mutex immMapMu_;
  std::unordered_map<uint32_t, uint64_t> immMap_;

  std::mutex msgMu_;
  std::unordered_map<uint64_t, std::deque<std::vector<uint8_t>>> messages_;

  struct Group {
    std::vector<Target> targets;
  };
  std::mutex groupMu_;
  std::vector<std::shared_ptr<Group>> groups_;  // by GroupId; null: destroyed (its id is in freeGroups_)
  std::vector<GroupId> freeGroups_;

  std::mutex errMu_;
  std::atomic<bool> hasError_{false};
  ErrorCode errCode_ = ErrorCode::kInternal;
  std::string errMsg_;

  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace fabric
}  // namespace epcomm
