// The libfabric TransferEngine (internal header; the public interface is epcomm/fabric/transfer_engine.hpp).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_eq.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/process_watch.hpp"
#include "fabric/engine_base.hpp"

namespace epcomm {
namespace fabric {

struct FiNic;
struct Piece;

/// FI_EP_RDM engine. One fabric/domain/AV/CQ/endpoint per NIC (numNics endpoints of one provider stand in for
/// several NICs). Providers: "tcp" (-> "tcp;ofi_rxm"), "verbs" (-> "verbs;ofi_rxm"), "shm", "efa", "sockets".
/// Submitting threads post under the NIC's mutex and queue on FI_EAGAIN, per peer (a peer the provider refuses holds
/// no other), which the progress thread (or a waiting caller) retries until the timeout. Where the provider offers
/// FI_THREAD_SAFE (tcp;ofi_rxm and shm do here), the completion queue is read outside that mutex, so a post never
/// waits for a progress call that is moving a peer's bytes (shm copies a large incoming write inside fi_cq_read);
/// otherwise (FI_THREAD_DOMAIN) every call on the domain is serialised by the mutex.
class LibfabricEngine : public EngineBase {
 public:
  /// Throws kUnavailable when the provider offers no suitable endpoint, kFabric when opening it fails.
  explicit LibfabricEngine(const EngineOptions& options);
  ~LibfabricEngine() override;

  /// Providers usable here, in preference order (fi_getinfo names such as "tcp;ofi_rxm").
  static std::vector<std::string> probeProviders();

  std::string providerName() const override;
  std::vector<uint8_t> address() const override;
  PeerId addPeer(const std::vector<uint8_t>& address) override;
  std::unique_ptr<MemoryRegion> registerMemory(void* data, size_t bytes, MemoryKind kind, int device) override;
  void send(PeerId peer, const void* data, size_t bytes, Completion done) override;
  /// Small writes and immediates to one NIC take an inject fast path (no allocation, no completion entry), except
  /// with options.deliveryComplete when a Completion is requested (inject cannot report delivery), and never over
  /// tcp;ofi_rxm (see the constructor).
  void write(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, const MemoryDesc& dst, uint64_t dstOffset,
             uint64_t length, bool withImm, uint32_t imm, Completion done) override;
  void immediate(PeerId peer, uint32_t imm, Completion done) override;

  /// Closes registrations (called by the region's destructor).
  void deregister(std::vector<fid_mr*>& mrs);

 protected:
  Target makeTarget(PeerId peer, const MemoryDesc& desc) override;
  void postPlan(const Target& target, const MemoryRegion* src, std::vector<NicPlan>& plan, uint32_t imm,
                const std::shared_ptr<OpState>& op) override;
  bool progressOnce() override;
  void whileQuiet(const std::function<void()>& fn) override;
  size_t numPeers() const override { return peers_.size(); }
  uint64_t peerHash(PeerId peer) const override { return peers_.hash(peer); }

 private:
  struct PeerEntry {
    uint64_t hash = 0;
    fi_addr_t addrs[kMaxNics] = {FI_ADDR_UNSPEC, FI_ADDR_UNSPEC, FI_ADDR_UNSPEC, FI_ADDR_UNSPEC};
    uint64_t sinkAddr[kMaxNics] = {0, 0, 0, 0};  // per NIC: the peer's immediate sink (target of zero-byte writes)
    uint64_t sinkKey[kMaxNics] = {0, 0, 0, 0};
    const ProcessWatch* process = nullptr;  // the peer's process when it runs on this host (watches_ owns it)
  };

  static fi_info* getInfo(const std::string& prov, bool hmem, bool ordered, bool threadSafe);
  static std::vector<std::string> candidates(const std::string& name);
  void openNic(FiNic& n, fi_info* info);
  void closeAll();
  PeerEntry peerEntry(PeerId peer) const;
  bool tryInject(PeerId peer, const void* buf, size_t len, const MemoryDesc* dst, uint64_t dstOffset, bool withImm,
                 uint32_t imm, Completion& done);
  ssize_t postPiece(FiNic& n, Piece* p);
  void submitLocked(FiNic& n, Piece* p, Finished& finished);
  void retryPending(FiNic& n, Finished& finished);
  void pieceDone(FiNic& n, Piece* p, const std::string& error, Finished& finished);
  void handleEntry(FiNic& n, const fi_cq_data_entry& e, Finished& finished);
  void handleError(FiNic& n, Finished& finished);
  void sweep(FiNic& n, Finished& finished);
  /// Whether a post to `watch`'s process must not reach the provider: over shm, once that process exited (see
  /// core/process_watch.hpp).
  bool peerGone(const ProcessWatch* watch) const { return watchPeers_ && watch != nullptr && watch->exited(); }
  std::string goneText(const Piece* p) const;
  std::string describe(const Piece* p, const char* call) const;

  std::string prov_;
  bool virtAddr_ = true;
  bool mrLocal_ = false;
  bool provKey_ = true;
  bool mrEndpoint_ = false;
  bool rxCqData_ = false;
  bool ordered_ = false;
  bool hmem_ = false;
  bool threadSafe_ = false;  // FI_THREAD_SAFE: fi_cq_read runs outside FiNic::mu
  size_t injectSize_ = 0;
  bool rmaInject_ = true;  // writes and immediates may take fi_inject_write(data) (see the constructor's NOTE)
  uint64_t maxMsg_ = 1ull << 30;
  std::atomic<uint64_t> nextKey_{1};
  std::vector<std::unique_ptr<FiNic>> nics_;
  PeerTable<PeerEntry> peers_;
  bool watchPeers_ = false;                             // shm: never post to a peer whose process exited
  std::vector<std::unique_ptr<ProcessWatch>> watches_;  // guarded by peers_'s lock; entries never move
};

}  // namespace fabric
}  // namespace epcomm
