// The libibverbs TransferEngine (internal header): RC queue pairs per peer and NIC, set up over a UD queue pair.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "fabric/engine_base.hpp"

namespace epcomm {
namespace fabric {

struct VerbsNic;
struct VerbsWork;

/// RC engine over libibverbs. Per NIC: a device context, PD, one CQ, one SRQ (shared by the RC QPs: receives for
/// control messages and for WRITE_WITH_IMM), and a UD QP used only to exchange RC QP numbers and PSNs when a peer
/// is added. Writes of one operation to one peer are chained into a single ibv_post_send with only the last work
/// request signalled. Device, port, GID index and service level come from EPCOMM_IB_*.
class VerbsEngine : public EngineBase {
 public:
  /// Throws kUnavailable("no RDMA device: ...") on machines without an RDMA device, kVerbs when a call fails.
  explicit VerbsEngine(const EngineOptions& options);
  ~VerbsEngine() override;

  /// Names of RDMA devices present (empty without any).
  static std::vector<std::string> probeDevices();

  std::string providerName() const override;
  std::vector<uint8_t> address() const override;
  PeerId addPeer(const std::vector<uint8_t>& address) override;
  std::unique_ptr<MemoryRegion> registerMemory(void* data, size_t bytes, MemoryKind kind, int device) override;
  void send(PeerId peer, const void* data, size_t bytes, Completion done) override;

 protected:
  Target makeTarget(PeerId peer, const MemoryDesc& desc) override;
  void postPlan(const Target& target, const MemoryRegion* src, std::vector<NicPlan>& plan, uint32_t imm,
                const std::shared_ptr<OpState>& op) override;
  bool progressOnce() override;
  size_t numPeers() const override { return peers_.size(); }
  uint64_t peerHash(PeerId peer) const override { return peers_.hash(peer); }

 private:
  struct NicAddr {
    uint16_t lid = 0;
    uint8_t gid[16] = {0};
    uint32_t udQpn = 0;
  };
  struct PeerEntry {
    uint64_t hash = 0;
    std::vector<NicAddr> nics;
    std::vector<ibv_qp*> qps;  // RC QP per NIC
  };

  void openNic(VerbsNic& n, ibv_device* dev);
  void closeAll();
  ibv_ah* makeAh(VerbsNic& n, const NicAddr& a);
  void modifyToRts(VerbsNic& n, ibv_qp* qp, const NicAddr& remote, uint32_t remoteQpn, uint32_t remotePsn,
                   uint32_t localPsn);
  void sendConnectInfo(VerbsNic& n, const NicAddr& to, uint32_t qpn, uint32_t psn, bool reply);
  void postRecv(VerbsNic& n, VerbsWork* w);
  void submitLocked(VerbsNic& n, VerbsWork* w, Finished& finished);
  int postWork(VerbsNic& n, VerbsWork* w);
  void workDone(VerbsNic& n, VerbsWork* w, const std::string& error, Finished& finished);
  void handleWc(VerbsNic& n, const ibv_wc& wc, Finished& finished);
  void sweep(VerbsNic& n, Finished& finished);

  std::string devName_;
  int port_ = 1;
  int gidIndex_ = 0;
  int sl_ = 0;
  std::vector<std::unique_ptr<VerbsNic>> nics_;
  PeerTable<PeerEntry> peers_;
};

}  // namespace fabric
}  // namespace epcomm
