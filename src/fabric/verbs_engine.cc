// TransferEngine over libibverbs: RC QPs (one per peer and NIC) connected through a UD QP, SRQ receives for
// WRITE_WITH_IMM and control messages, chained and selectively signalled writes.
#include "fabric/verbs_engine.hpp"

#include <arpa/inet.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include "core/env.hpp"
#include "core/log.hpp"

namespace epcomm {
namespace fabric {

namespace {
constexpr uint32_t kVerbsAddrMagic = 0x56425045;  // "EPBV"
constexpr uint32_t kConnectMagic = 0x43425045;    // "EPBC"
constexpr uint32_t kQkey = 0x11111111;
constexpr int kSqDepth = 1024;
constexpr int kSrqDepth = 512;
constexpr int kUdRecvs = 64;
constexpr size_t kGrh = 40;
constexpr uint64_t kMaxWrite = 1ull << 30;
constexpr int kInline = 64;
constexpr size_t kChainMax = 256;  // work requests per ibv_post_send chain (send queue holds kSqDepth)
constexpr int64_t kResendMs = 100;

struct ConnectMsg {
  uint32_t magic;
  uint32_t nic;
  uint64_t senderHash;
  uint32_t qpn;
  uint32_t psn;
  uint32_t reply;
  uint32_t pad;
};
}  // namespace

struct VerbsWork {
  enum class Kind { kChain, kSend, kRecv, kUdSend, kUdRecv } kind = Kind::kChain;
  int nic = 0;
  PeerId peer = 0;
  std::shared_ptr<OpState> op;
  ibv_qp* qp = nullptr;
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  std::vector<uint8_t> buf;
  ibv_mr* mr = nullptr;
  ibv_ah* ah = nullptr;
  int64_t deadline = 0;
  bool timedOut = false;
  bool finished = false;
};

struct VerbsNic {
  int index = 0;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_srq* srq = nullptr;
  ibv_qp* ud = nullptr;
  ibv_port_attr portAttr{};
  ibv_gid gid{};
  std::mutex mu;
  std::deque<VerbsWork*> pending;
  std::unordered_set<VerbsWork*> live;
  std::vector<VerbsWork*> dead;  // failed chains: flushed completions may still name them until close
  std::vector<VerbsWork*> recvs;
  struct QpInfo {
    uint32_t qpn;
    uint32_t psn;
  };
  std::unordered_map<uint64_t, QpInfo> local;   // our RC QP for a peer (by the peer's address hash)
  std::unordered_map<uint64_t, QpInfo> remote;  // the peer's RC QP for us, as received over UD
  int64_t lastSweep = 0;
};

namespace {

std::string errnoText(int e) { return std::string(std::strerror(e)); }

void freeWork(VerbsWork* w) {
  if (w->mr != nullptr) ibv_dereg_mr(w->mr);
  if (w->ah != nullptr) ibv_destroy_ah(w->ah);
  delete w;
}

class VerbsRegion : public MemoryRegion {
 public:
  ~VerbsRegion() override {
    for (ibv_mr* mr : mrs_) ibv_dereg_mr(mr);
  }
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  const MemoryDesc& desc() const override { return desc_; }

  void* data_ = nullptr;
  size_t size_ = 0;
  MemoryDesc desc_;
  std::vector<ibv_mr*> mrs_;
};

}  // namespace

std::vector<std::string> VerbsEngine::probeDevices() {
  std::vector<std::string> out;
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return out;
  for (int i = 0; i < num; ++i) out.push_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  return out;
}

VerbsEngine::VerbsEngine(const EngineOptions& options) : EngineBase(options) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr || num == 0) {
    int e = errno;
    if (list != nullptr) ibv_free_device_list(list);
    EPCOMM_THROW(kUnavailable, "no RDMA device: ibv_get_device_list returned 0 devices"
                                   << (list == nullptr ? " (" + errnoText(e) + ")" : std::string()));
  }
  const std::string wanted = envString("EPCOMM_IB_DEVICE");
  port_ = static_cast<int>(envInt("EPCOMM_IB_PORT"));
  gidIndex_ = static_cast<int>(envInt("EPCOMM_IB_GID_INDEX"));
  sl_ = static_cast<int>(envInt("EPCOMM_IB_SL"));
  std::vector<ibv_device*> devices;
  for (int i = 0; i < num; ++i) {
    if (wanted.empty() || wanted == ibv_get_device_name(list[i])) devices.push_back(list[i]);
  }
  if (devices.empty()) {
    ibv_free_device_list(list);
    EPCOMM_THROW(kUnavailable, "no RDMA device named '" << wanted << "' (EPCOMM_IB_DEVICE)");
  }
  devName_ = ibv_get_device_name(devices[0]);
  try {
    for (int n = 0; n < numNics_; ++n) {
      nics_.push_back(std::make_unique<VerbsNic>());
      nics_.back()->index = n;
      // Several NICs: one device per NIC when there are enough, else several contexts on one device.
      openNic(*nics_.back(), devices[n % devices.size()]);
    }
  } catch (...) {
    ibv_free_device_list(list);
    closeAll();
    throw;
  }
  ibv_free_device_list(list);
  startProgress();
}

VerbsEngine::~VerbsEngine() {
  stopProgress();
  closeAll();
}

void VerbsEngine::openNic(VerbsNic& n, ibv_device* dev) {
  const char* name = ibv_get_device_name(dev);
  n.ctx = ibv_open_device(dev);
  EPCOMM_CHECK(n.ctx != nullptr, kVerbs, "ibv_open_device(" << name << ") failed: " << errnoText(errno));
  int rc = ibv_query_port(n.ctx, static_cast<uint8_t>(port_), &n.portAttr);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_query_port(" << name << ", port " << port_ << ") failed: " << errnoText(rc));
  EPCOMM_CHECK(n.portAttr.state == IBV_PORT_ACTIVE, kUnavailable,
               "RDMA device " << name << " port " << port_ << " is not active (state " << n.portAttr.state << ")");
  rc = ibv_query_gid(n.ctx, static_cast<uint8_t>(port_), gidIndex_, &n.gid);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_query_gid(" << name << ", index " << gidIndex_ << ") failed: " << errnoText(rc));
  n.pd = ibv_alloc_pd(n.ctx);
  EPCOMM_CHECK(n.pd != nullptr, kVerbs, "ibv_alloc_pd(" << name << ") failed: " << errnoText(errno));
  n.cq = ibv_create_cq(n.ctx, 4 * kSqDepth + kSrqDepth + kUdRecvs, nullptr, nullptr, 0);
  EPCOMM_CHECK(n.cq != nullptr, kVerbs, "ibv_create_cq(" << name << ") failed: " << errnoText(errno));
  ibv_srq_init_attr srqAttr{};
  srqAttr.attr.max_wr = kSrqDepth;
  srqAttr.attr.max_sge = 1;
  n.srq = ibv_create_srq(n.pd, &srqAttr);
  EPCOMM_CHECK(n.srq != nullptr, kVerbs, "ibv_create_srq(" << name << ") failed: " << errnoText(errno));

  ibv_qp_init_attr ud{};
  ud.send_cq = n.cq;
  ud.recv_cq = n.cq;
  ud.qp_type = IBV_QPT_UD;
  ud.cap.max_send_wr = 64;
  ud.cap.max_recv_wr = kUdRecvs;
  ud.cap.max_send_sge = 1;
  ud.cap.max_recv_sge = 1;
  ud.cap.max_inline_data = kInline;
  n.ud = ibv_create_qp(n.pd, &ud);
  EPCOMM_CHECK(n.ud != nullptr, kVerbs, "ibv_create_qp(UD, " << name << ") failed: " << errnoText(errno));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(port_);
  a.qkey = kQkey;
  rc = ibv_modify_qp(n.ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_modify_qp(UD INIT) failed: " << errnoText(rc));
  a = {};
  a.qp_state = IBV_QPS_RTR;
  rc = ibv_modify_qp(n.ud, &a, IBV_QP_STATE);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_modify_qp(UD RTR) failed: " << errnoText(rc));
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  rc = ibv_modify_qp(n.ud, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_modify_qp(UD RTS) failed: " << errnoText(rc));

  auto addRecv = [&](VerbsWork::Kind kind, size_t bytes) {
    auto* w = new VerbsWork();
    w->kind = kind;
    w->nic = n.index;
    w->buf.resize(bytes);
    w->mr = ibv_reg_mr(n.pd, w->buf.data(), bytes, IBV_ACCESS_LOCAL_WRITE);
    if (w->mr == nullptr) {
      delete w;
      EPCOMM_THROW(kVerbs, "ibv_reg_mr(receive buffer) failed: " << errnoText(errno));
    }
    n.recvs.push_back(w);
    postRecv(n, w);
  };
  for (int i = 0; i < kUdRecvs; ++i) addRecv(VerbsWork::Kind::kUdRecv, kGrh + sizeof(ConnectMsg));
  for (int i = 0; i < kSrqDepth - 1; ++i) addRecv(VerbsWork::Kind::kRecv, kMsgHeader + kMaxMessage);
}

void VerbsEngine::postRecv(VerbsNic& n, VerbsWork* w) {
  ibv_sge sge{reinterpret_cast<uint64_t>(w->buf.data()), static_cast<uint32_t>(w->buf.size()), w->mr->lkey};
  ibv_recv_wr wr{};
  ibv_recv_wr* bad = nullptr;
  wr.wr_id = reinterpret_cast<uint64_t>(w);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  int rc = w->kind == VerbsWork::Kind::kUdRecv ? ibv_post_recv(n.ud, &wr, &bad) : ibv_post_srq_recv(n.srq, &wr, &bad);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_post_recv (NIC " << n.index << ") failed: " << errnoText(rc));
}

void VerbsEngine::closeAll() {
  for (auto& np : nics_) {
    VerbsNic& n = *np;
    std::lock_guard<std::mutex> lock(n.mu);
    peers_.locked([&](std::vector<PeerEntry>& peers) {
      for (auto& p : peers) {
        if (static_cast<size_t>(n.index) < p.qps.size() && p.qps[n.index] != nullptr) {
          ibv_destroy_qp(p.qps[n.index]);
          p.qps[n.index] = nullptr;
        }
      }
    });
    if (n.ud != nullptr) ibv_destroy_qp(n.ud);
    if (n.srq != nullptr) ibv_destroy_srq(n.srq);
    for (VerbsWork* w : n.recvs) freeWork(w);
    for (VerbsWork* w : n.pending) {
      if (w->op) {
        w->op->fail("engine closed before the operation was posted");
        finishOp(w->op);
      }
      freeWork(w);
    }
    for (VerbsWork* w : n.live) {
      if (w->op) {
        w->op->fail("engine closed before the operation completed");
        finishOp(w->op);
      }
      freeWork(w);
    }
    for (VerbsWork* w : n.dead) freeWork(w);
    n.recvs.clear();
    n.pending.clear();
    n.live.clear();
    n.dead.clear();
    if (n.cq != nullptr) ibv_destroy_cq(n.cq);
    if (n.pd != nullptr) ibv_dealloc_pd(n.pd);
    if (n.ctx != nullptr) ibv_close_device(n.ctx);
    n.ud = nullptr;
    n.srq = nullptr;
    n.cq = nullptr;
    n.pd = nullptr;
    n.ctx = nullptr;
  }
}

std::string VerbsEngine::providerName() const { return "ibverbs:" + devName_; }

std::vector<uint8_t> VerbsEngine::address() const {
  // Header (magic, NIC count, sharding mode), then one NicAddr image per NIC, which addPeer copies back.
  // Built zero-filled at its final size and written field by field: NicAddr has two padding bytes after gid,
  // which copying a whole NicAddr left indeterminate, yet both sides hash every byte of the address (selfHash_
  // here, PeerEntry::hash at the peer), so separately produced copies must be identical.
  const uint32_t hdr[3] = {kVerbsAddrMagic, static_cast<uint32_t>(numNics_), options_.shardByBytes ? 1u : 0u};
  std::vector<uint8_t> out(sizeof(hdr) + sizeof(NicAddr) * nics_.size(), 0);
  std::memcpy(out.data(), hdr, sizeof(hdr));
  uint8_t* at = out.data() + sizeof(hdr);
  for (const auto& n : nics_) {
    const uint16_t lid = n->portAttr.lid;
    const uint32_t udQpn = n->ud->qp_num;
    std::memcpy(at + offsetof(NicAddr, lid), &lid, sizeof(lid));
    std::memcpy(at + offsetof(NicAddr, gid), n->gid.raw, sizeof(NicAddr::gid));
    std::memcpy(at + offsetof(NicAddr, udQpn), &udQpn, sizeof(udQpn));
    at += sizeof(NicAddr);
  }
  return out;
}

ibv_ah* VerbsEngine::makeAh(VerbsNic& n, const NicAddr& to) {
  ibv_ah_attr ah{};
  ah.dlid = to.lid;
  ah.sl = static_cast<uint8_t>(sl_);
  ah.port_num = static_cast<uint8_t>(port_);
  // RoCE (and IB across subnets) route by GID; on a plain IB fabric the LID suffices.
  if (n.portAttr.link_layer == IBV_LINK_LAYER_ETHERNET || to.lid == 0) {
    ah.is_global = 1;
    std::memcpy(ah.grh.dgid.raw, to.gid, 16);
    ah.grh.sgid_index = static_cast<uint8_t>(gidIndex_);
    ah.grh.hop_limit = 64;
  }
  ibv_ah* h = ibv_create_ah(n.pd, &ah);
  EPCOMM_CHECK(h != nullptr, kVerbs, "ibv_create_ah (NIC " << n.index << ") failed: " << errnoText(errno));
  return h;
}

void VerbsEngine::sendConnectInfo(VerbsNic& n, const NicAddr& to, uint32_t qpn, uint32_t psn, bool reply) {
  auto* w = new VerbsWork();
  w->kind = VerbsWork::Kind::kUdSend;
  w->nic = n.index;
  ConnectMsg m{kConnectMagic, static_cast<uint32_t>(n.index), selfHash_, qpn, psn, reply ? 1u : 0u, 0};
  w->buf.assign(reinterpret_cast<uint8_t*>(&m), reinterpret_cast<uint8_t*>(&m) + sizeof(m));
  w->ah = makeAh(n, to);
  ibv_sge sge{reinterpret_cast<uint64_t>(w->buf.data()), static_cast<uint32_t>(w->buf.size()), 0};
  ibv_send_wr wr{};
  ibv_send_wr* bad = nullptr;
  wr.wr_id = reinterpret_cast<uint64_t>(w);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
  wr.wr.ud.ah = w->ah;
  wr.wr.ud.remote_qpn = to.udQpn;
  wr.wr.ud.remote_qkey = kQkey;
  int rc = ibv_post_send(n.ud, &wr, &bad);
  if (rc != 0) {
    freeWork(w);
    EPCOMM_THROW(kVerbs, "ibv_post_send(UD connect info, NIC " << n.index << ") failed: " << errnoText(rc));
  }
  n.live.insert(w);
}

void VerbsEngine::modifyToRts(VerbsNic& n, ibv_qp* qp, const NicAddr& remote, uint32_t remoteQpn, uint32_t remotePsn,
                              uint32_t localPsn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = n.portAttr.active_mtu;
  a.dest_qp_num = remoteQpn;
  a.rq_psn = remotePsn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = remote.lid;
  a.ah_attr.sl = static_cast<uint8_t>(sl_);
  a.ah_attr.port_num = static_cast<uint8_t>(port_);
  if (n.portAttr.link_layer == IBV_LINK_LAYER_ETHERNET || remote.lid == 0) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gidIndex_);
    a.ah_attr.grh.hop_limit = 64;
  }
  int rc = ibv_modify_qp(qp, &a,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_modify_qp(RC RTR, NIC " << n.index << ") failed: " << errnoText(rc));
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = localPsn;
  a.max_rd_atomic = 1;
  rc = ibv_modify_qp(
      qp, &a,
      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  EPCOMM_CHECK(rc == 0, kVerbs, "ibv_modify_qp(RC RTS, NIC " << n.index << ") failed: " << errnoText(rc));
}

PeerId VerbsEngine::addPeer(const std::vector<uint8_t>& address) {
  const size_t expected = 12 + sizeof(NicAddr) * numNics_;
  EPCOMM_CHECK(address.size() == expected, kInvalidArgument,
               "addPeer: verbs address of " << address.size() << " bytes, expected " << expected);
  uint32_t hdr[3];
  std::memcpy(hdr, address.data(), 12);
  EPCOMM_CHECK(hdr[0] == kVerbsAddrMagic, kInvalidArgument, "addPeer: not a verbs engine address");
  EPCOMM_CHECK(hdr[1] == static_cast<uint32_t>(numNics_) && hdr[2] == (options_.shardByBytes ? 1u : 0u),
               kInvalidArgument, "addPeer: the peer's NIC count or sharding mode differs from this engine's");
  PeerEntry e;
  e.hash = fnv1a64(address.data(), address.size());
  e.nics.resize(numNics_);
  e.qps.resize(numNics_, nullptr);
  std::mt19937 rng(static_cast<uint32_t>(e.hash ^ selfHash_ ^ static_cast<uint64_t>(nowMs())));
  std::vector<uint32_t> psn(numNics_);
  for (int n = 0; n < numNics_; ++n) {
    std::memcpy(&e.nics[n], address.data() + 12 + sizeof(NicAddr) * n, sizeof(NicAddr));
    VerbsNic& nic = *nics_[n];
    ibv_qp_init_attr qa{};
    qa.send_cq = nic.cq;
    qa.recv_cq = nic.cq;
    qa.srq = nic.srq;
    qa.qp_type = IBV_QPT_RC;
    qa.sq_sig_all = 0;  // selective signalling: only the last work request of a chain
    qa.cap.max_send_wr = kSqDepth;
    qa.cap.max_send_sge = 1;
    qa.cap.max_inline_data = kInline;
    std::lock_guard<std::mutex> lock(nic.mu);
    ibv_qp* qp = ibv_create_qp(nic.pd, &qa);
    EPCOMM_CHECK(qp != nullptr, kVerbs, "ibv_create_qp(RC, NIC " << n << ") failed: " << errnoText(errno));
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(port_);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
    int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0) {
      ibv_destroy_qp(qp);
      EPCOMM_THROW(kVerbs, "ibv_modify_qp(RC INIT, NIC " << n << ") failed: " << errnoText(rc));
    }
    e.qps[n] = qp;
    psn[n] = rng() & 0xffffff;
    nic.local[e.hash] = {qp->qp_num, psn[n]};
  }
  // Exchange QP numbers over UD: resend until the peer's info arrives; the peer answers every request, so a lost
  // datagram in either direction is repaired by the next resend.
  const int64_t deadline = nowMs() + timeoutMs_;
  for (int n = 0; n < numNics_; ++n) {
    VerbsNic& nic = *nics_[n];
    int64_t lastSend = 0;
    for (;;) {
      VerbsNic::QpInfo remote{};
      bool have = false;
      {
        std::lock_guard<std::mutex> lock(nic.mu);
        auto it = nic.remote.find(e.hash);
        if (it != nic.remote.end()) {
          remote = it->second;
          have = true;
        } else if (nowMs() - lastSend > kResendMs) {
          sendConnectInfo(nic, e.nics[n], e.qps[n]->qp_num, psn[n], false);
          lastSend = nowMs();
        }
      }
      if (have) {
        std::lock_guard<std::mutex> lock(nic.mu);
        modifyToRts(nic, e.qps[n], e.nics[n], remote.qpn, remote.psn, psn[n]);
        break;
      }
      EPCOMM_CHECK(nowMs() < deadline, kTimeout,
                   "addPeer: no RC connection info from the peer (UD QP " << e.nics[n].udQpn << ", NIC " << n
                                                                          << ") after " << timeoutMs_ << " ms");
      if (!progressOnce()) std::this_thread::yield();
    }
  }
  return peers_.add(std::move(e));
}

std::unique_ptr<MemoryRegion> VerbsEngine::registerMemory(void* data, size_t bytes, MemoryKind kind, int device) {
  checkRegisterRange(data, bytes, kind);
  auto r = std::make_unique<VerbsRegion>();
  r->data_ = data;
  r->size_ = bytes;
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
#ifdef IBV_ACCESS_RELAXED_ORDERING
  // NOTE: relaxed PCIe ordering lets the NIC write GPU memory faster; completions still order the immediates.
  access |= IBV_ACCESS_RELAXED_ORDERING;
#endif
  for (int n = 0; n < numNics_; ++n) {
    ibv_mr* mr = ibv_reg_mr(nics_[n]->pd, data, bytes, access);
    if (mr == nullptr) {
      int e = errno;
      if (kind == MemoryKind::kCuda) {
        EPCOMM_THROW(kUnavailable, "registerMemory: " << providerName() << " cannot register CUDA memory ("
                                                      << errnoText(e) << "): load nvidia-peermem, or stage through "
                                                      << "pinned host memory");
      }
      EPCOMM_THROW(kVerbs, "ibv_reg_mr([" << data << ", +" << bytes << "), NIC " << n << ") failed: " << errnoText(e));
    }
    r->mrs_.push_back(mr);
    r->desc_.keys[n] = mr->rkey;
  }
  sealDesc(r->desc_, data, bytes);
  return r;
}

EngineBase::Target VerbsEngine::makeTarget(PeerId peer, const MemoryDesc& desc) {
  EPCOMM_CHECK(peer < numPeers(), kInvalidArgument, "unknown peer " << peer);
  EPCOMM_CHECK(desc.numNics == static_cast<uint32_t>(numNics_), kInvalidArgument,
               "descriptor for peer " << peer << " has " << desc.numNics << " NIC keys, engine drives " << numNics_);
  Target t;
  t.peer = peer;
  t.size = desc.size;
  for (int n = 0; n < numNics_; ++n) {
    t.remoteBase[n] = desc.addr;
    t.key[n] = desc.keys[n];
  }
  return t;
}

int VerbsEngine::postWork(VerbsNic& n, VerbsWork* w) {
  for (size_t i = 0; i < w->wrs.size(); ++i) {
    w->wrs[i].next = i + 1 < w->wrs.size() ? &w->wrs[i + 1] : nullptr;
    w->wrs[i].sg_list = w->wrs[i].num_sge > 0 ? &w->sges[i] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(w->qp, w->wrs.data(), &bad);
}

void VerbsEngine::submitLocked(VerbsNic& n, VerbsWork* w, Finished& finished) {
  w->deadline = w->op ? w->op->deadlineMs : nowMs() + timeoutMs_;
  if (!n.pending.empty()) {
    n.pending.push_back(w);
    return;
  }
  int rc = postWork(n, w);
  if (rc == 0) {
    n.live.insert(w);
  } else if (rc == ENOMEM) {
    n.pending.push_back(w);  // send queue full: retried by progress
  } else {
    workDone(n, w,
             "ibv_post_send to peer " + std::to_string(w->peer) + " (NIC " + std::to_string(n.index) + ", " +
                 providerName() + ") failed: " + errnoText(rc),
             finished);
  }
}

void VerbsEngine::workDone(VerbsNic& n, VerbsWork* w, const std::string& error, Finished& finished) {
  n.live.erase(w);
  if (w->finished) return;
  w->finished = true;
  if (w->op) {
    if (!error.empty()) w->op->fail(error);
    if (w->op->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) finished.push_back(w->op);
  }
  if (error.empty()) {
    freeWork(w);
  } else {
    n.dead.push_back(w);  // flushed completions of the chain's other work requests may still name it
  }
}

void VerbsEngine::postPlan(const Target& target, const MemoryRegion* src, std::vector<NicPlan>& plan, uint32_t imm,
                           const std::shared_ptr<OpState>& op) {
  const auto* region = static_cast<const VerbsRegion*>(src);
  const std::vector<ibv_qp*> qps = peers_.locked([&](const std::vector<PeerEntry>& peers) {
    EPCOMM_CHECK(target.peer < peers.size(), kInvalidArgument, "unknown peer " << target.peer);
    return peers[target.peer].qps;
  });
  // One chain per NIC, cut into pieces of at most kChainMax work requests so a long paged write never exceeds
  // the send queue; each piece signals only its last request, and RC order keeps the immediate after the data.
  std::vector<std::vector<VerbsWork*>> works(numNics_);
  int total = 0;
  for (int n = 0; n < numNics_; ++n) {
    NicPlan& np = plan[n];
    if (np.chunks.empty() && !np.imm) continue;
    std::vector<ibv_send_wr> wrs;
    std::vector<ibv_sge> sges;
    auto add = [&](uint64_t srcOff, uint64_t dstOff, uint64_t len) {
      ibv_send_wr wr{};
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.num_sge = len > 0 ? 1 : 0;
      wr.wr.rdma.remote_addr = target.remoteBase[n] + dstOff;
      wr.wr.rdma.rkey = static_cast<uint32_t>(target.key[n]);
      ibv_sge sge{};
      if (len > 0) {
        sge.addr = reinterpret_cast<uint64_t>(region->data()) + srcOff;
        sge.length = static_cast<uint32_t>(len);
        sge.lkey = region->mrs_[n]->lkey;
        if (len <= static_cast<uint64_t>(kInline)) wr.send_flags |= IBV_SEND_INLINE;
      }
      wrs.push_back(wr);
      sges.push_back(sge);
    };
    for (const Chunk& c : np.chunks) {
      for (uint64_t off = 0; off < c.length; off += kMaxWrite) {
        add(c.srcOffset + off, c.dstOffset + off, std::min<uint64_t>(kMaxWrite, c.length - off));
      }
    }
    if (np.imm && wrs.empty()) add(0, 0, 0);
    if (np.imm) {
      wrs.back().opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wrs.back().imm_data = htonl(imm);
    }
    for (size_t first = 0; first < wrs.size(); first += kChainMax) {
      const size_t last = std::min(wrs.size(), first + kChainMax);
      auto* w = new VerbsWork();
      w->kind = VerbsWork::Kind::kChain;
      w->nic = n;
      w->peer = target.peer;
      w->op = op;
      w->qp = qps[n];
      w->wrs.assign(wrs.begin() + first, wrs.begin() + last);
      w->sges.assign(sges.begin() + first, sges.begin() + last);
      for (ibv_send_wr& wr : w->wrs) wr.wr_id = reinterpret_cast<uint64_t>(w);
      w->wrs.back().send_flags |= IBV_SEND_SIGNALED;
      works[n].push_back(w);
      ++total;
    }
  }
  if (!armOp(op, total)) return;
  Finished finished;
  for (int n = 0; n < numNics_; ++n) {
    if (works[n].empty()) continue;
    std::lock_guard<std::mutex> lock(nics_[n]->mu);
    for (VerbsWork* w : works[n]) submitLocked(*nics_[n], w, finished);
  }
  for (auto& f : finished) finishOp(f);
}

void VerbsEngine::send(PeerId peer, const void* data, size_t bytes, Completion done) {
  EPCOMM_CHECK(bytes <= kMaxMessage, kInvalidArgument,
               "send: control message of " << bytes << " bytes exceeds " << kMaxMessage);
  EPCOMM_CHECK(bytes == 0 || data != nullptr, kInvalidArgument, "send: null data for " << bytes << " bytes");
  const int n = static_cast<int>(peer % numNics_);
  ibv_qp* const qp = peers_.locked([&](const std::vector<PeerEntry>& peers) {
    EPCOMM_CHECK(peer < peers.size(), kInvalidArgument, "send: unknown peer " << peer);
    return peers[peer].qps[n];
  });
  auto op = newOp(peer, "send", std::move(done));
  op->pending.store(1);
  auto* w = new VerbsWork();
  w->kind = VerbsWork::Kind::kSend;
  w->nic = n;
  w->peer = peer;
  w->op = op;
  w->qp = qp;
  w->buf = frameMessage(data, bytes);
  VerbsNic& nic = *nics_[n];
  w->mr = ibv_reg_mr(nic.pd, w->buf.data(), w->buf.size(), IBV_ACCESS_LOCAL_WRITE);
  if (w->mr == nullptr) {
    int e = errno;
    delete w;
    EPCOMM_THROW(kVerbs, "ibv_reg_mr(send buffer) failed: " << errnoText(e));
  }
  ibv_send_wr wr{};
  wr.wr_id = reinterpret_cast<uint64_t>(w);
  wr.opcode = IBV_WR_SEND;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  w->wrs.push_back(wr);
  w->sges.push_back({reinterpret_cast<uint64_t>(w->buf.data()), static_cast<uint32_t>(w->buf.size()), w->mr->lkey});
  Finished finished;
  {
    std::lock_guard<std::mutex> lock(nic.mu);
    submitLocked(nic, w, finished);
  }
  for (auto& f : finished) finishOp(f);
}

void VerbsEngine::handleWc(VerbsNic& n, const ibv_wc& wc, Finished& finished) {
  auto* w = reinterpret_cast<VerbsWork*>(wc.wr_id);
  if (w == nullptr) return;
  const bool ok = wc.status == IBV_WC_SUCCESS;
  switch (w->kind) {
    case VerbsWork::Kind::kRecv:
    case VerbsWork::Kind::kUdRecv:
      if (!ok) {
        if (wc.status != IBV_WC_WR_FLUSH_ERR) {
          recordError(ErrorCode::kVerbs, std::string("receive completion on NIC ") + std::to_string(n.index) + ": " +
                                             ibv_wc_status_str(wc.status));
        }
        return;  // flushed at close: not reposted
      }
      if (w->kind == VerbsWork::Kind::kUdRecv) {
        ConnectMsg m{};
        if (wc.byte_len >= kGrh + sizeof(m)) {
          std::memcpy(&m, w->buf.data() + kGrh, sizeof(m));
          if (m.magic == kConnectMagic) {
            n.remote[m.senderHash] = {m.qpn, m.psn};
            auto local = n.local.find(m.senderHash);
            if (m.reply == 0 && local != n.local.end()) {
              peers_.locked([&](const std::vector<PeerEntry>& peers) {
                for (const PeerEntry& p : peers) {
                  if (p.hash == m.senderHash)
                    sendConnectInfo(n, p.nics[n.index], local->second.qpn, local->second.psn, true);
                }
              });
            }
          }
        }
      } else if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        countImm(ntohl(wc.imm_data));
      } else if (wc.opcode == IBV_WC_RECV) {
        deliverFramed(w->buf.data(), wc.byte_len);
      }
      postRecv(n, w);
      return;
    case VerbsWork::Kind::kUdSend:
      n.live.erase(w);
      freeWork(w);
      return;
    case VerbsWork::Kind::kChain:
    case VerbsWork::Kind::kSend:
      if (ok) {
        workDone(n, w, "", finished);
      } else if (!w->finished) {
        workDone(n, w,
                 std::string(w->kind == VerbsWork::Kind::kSend ? "send" : (w->op ? w->op->what : "write")) +
                     " to peer " + std::to_string(w->peer) + " (NIC " + std::to_string(n.index) + ", " +
                     providerName() + ") failed: ibv_poll_cq: " + ibv_wc_status_str(wc.status) + " (vendor error " +
                     std::to_string(wc.vendor_err) + ")",
                 finished);
      }
      return;
  }
}

void VerbsEngine::sweep(VerbsNic& n, Finished& finished) {
  const int64_t now = nowMs();
  if (now - n.lastSweep < 20) return;
  n.lastSweep = now;
  auto text = [&](VerbsWork* w) {
    return std::string(w->op ? w->op->what : "operation") + " to peer " + std::to_string(w->peer) + " (NIC " +
           std::to_string(n.index) + ", " + providerName() + ") timed out after " + std::to_string(timeoutMs_) + " ms";
  };
  for (auto it = n.pending.begin(); it != n.pending.end();) {
    VerbsWork* w = *it;
    if (now > w->deadline) {
      it = n.pending.erase(it);
      workDone(n, w, text(w) + " (send queue full)", finished);
    } else {
      ++it;
    }
  }
  for (VerbsWork* w : n.live) {
    if (w->timedOut || w->kind == VerbsWork::Kind::kUdSend || now <= w->deadline || !w->op) continue;
    w->timedOut = true;
    w->op->fail(text(w));
    finished.push_back(w->op);
  }
}

bool VerbsEngine::progressOnce() {
  bool worked = false;
  Finished finished;
  for (auto& np : nics_) {
    VerbsNic& n = *np;
    std::unique_lock<std::mutex> lock(n.mu, std::try_to_lock);
    if (!lock.owns_lock()) continue;
    while (!n.pending.empty()) {
      VerbsWork* w = n.pending.front();
      int rc = postWork(n, w);
      if (rc == ENOMEM) break;
      n.pending.pop_front();
      if (rc == 0) {
        n.live.insert(w);
      } else {
        workDone(n, w, "ibv_post_send to peer " + std::to_string(w->peer) + " failed: " + errnoText(rc), finished);
      }
    }
    ibv_wc wcs[32];
    int got = ibv_poll_cq(n.cq, 32, wcs);
    if (got < 0) {
      recordError(ErrorCode::kVerbs, "ibv_poll_cq on NIC " + std::to_string(n.index) + " failed");
    }
    for (int i = 0; i < got; ++i) handleWc(n, wcs[i], finished);
    worked = worked || got > 0;
    if (!n.pending.empty() || !n.live.empty()) sweep(n, finished);
  }
  for (auto& f : finished) finishOp(f);
  return worked;
}

}  // namespace fabric
}  // namespace epcomm
