// TransferEngine over libfabric: FI_EP_RDM endpoints (one per "NIC"), FI_AV_TABLE, one CQ per endpoint with
// FI_CQ_FORMAT_DATA, fi_writemsg / fi_inject_writedata for one-sided writes with 32-bit immediates carried as
// remote CQ data, fi_send/fi_recv with pre-posted buffers for control messages.
#include "fabric/libfabric_engine.hpp"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/uio.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_set>

#include "core/env.hpp"
#include "core/log.hpp"
#include "fabric/engine_base.hpp"

namespace epcomm {
namespace fabric {

namespace {

constexpr uint32_t kFiApiVersion = FI_VERSION(1, 14);
constexpr int kRecvBuffers = 64;
constexpr int kCqBatch = 32;
constexpr uint32_t kAddrMagic = 0x41465045;  // "EPFA"
constexpr int64_t kSweepPeriodMs = 20;

std::string fiErr(int rc) { return std::string(fi_strerror(rc < 0 ? -rc : rc)); }

#define EPCOMM_CHECK_FI(call, what)                                                                                   \
  do {                                                                                                                \
    int epcomm_rc_ = static_cast<int>(call);                                                                          \
    if (epcomm_rc_ != 0) {                                                                                            \
      EPCOMM_THROW(kFabric,                                                                                           \
                   what << " failed (provider " << prov_ << "): " << fiErr(epcomm_rc_) << " (" << epcomm_rc_ << ")"); \
    }                                                                                                                 \
  } while (0)

}  // namespace

enum class PieceKind : uint8_t { kWrite, kSend, kRecv };

// Data pieces of one operation on one NIC; for providers without RMA write-after-write ordering the immediate
// (trailer) is posted only once they all completed with FI_DELIVERY_COMPLETE. Guarded by the NIC's mutex.
struct NicBatch {
  int remaining = 0;
  bool failed = false;
  Piece* trailer = nullptr;
  ~NicBatch();
};

struct Piece {
  fi_context2 ctx;  // first member: libfabric returns &ctx as op_context
  PieceKind kind = PieceKind::kWrite;
  int nic = 0;
  std::shared_ptr<OpState> op;
  std::shared_ptr<NicBatch> batch;
  PeerId peer = 0;
  const void* buf = nullptr;
  size_t len = 0;
  void* desc = nullptr;
  fi_addr_t dest = FI_ADDR_UNSPEC;
  uint64_t raddr = 0;
  uint64_t key = 0;
  uint64_t data = 0;
  bool imm = false;
  bool delivery = false;
  bool inject = false;
  bool timedOut = false;
  int64_t deadline = 0;
  std::vector<uint8_t> msg;  // send: header + payload; recv: buffer
  fid_mr* msgMr = nullptr;
  Piece* prev = nullptr;  // intrusive list of posted pieces (FiNic::live): no allocation per operation
  Piece* next = nullptr;
  bool isLive = false;
};

// Posted pieces awaiting their completion, as an intrusive list.
struct LiveList {
  Piece* head = nullptr;
  size_t count = 0;
  void insert(Piece* p) {
    p->prev = nullptr;
    p->next = head;
    if (head != nullptr) head->prev = p;
    head = p;
    p->isLive = true;
    ++count;
  }
  void erase(Piece* p) {
    if (!p->isLive) return;
    if (p->prev != nullptr) p->prev->next = p->next;
    if (p->next != nullptr) p->next->prev = p->prev;
    if (head == p) head = p->next;
    p->isLive = false;
    --count;
  }
  bool empty() const { return count == 0; }
};

NicBatch::~NicBatch() { delete trailer; }

static void freePiece(Piece* p) {
  if (p->msgMr != nullptr) fi_close(&p->msgMr->fid);
  delete p;
}

// NOTE: a mutex that spins briefly before sleeping. The critical sections (one post, one CQ poll) last about a
// microsecond, and a submitting thread that meets the progress thread in one otherwise sleeps in the kernel and
// pays a futex wake-up per write, which shows on hosts with idle cores where the progress thread always runs.
class SpinThenBlockMutex {
 public:
  void lock() {
    for (int i = 0; i < 2000; ++i) {
      if (mu_.try_lock()) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    mu_.lock();
  }
  bool try_lock() { return mu_.try_lock(); }
  void unlock() { mu_.unlock(); }

 private:
  std::mutex mu_;
};

struct FiNic {
  int index = 0;
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  fid_cq* cq = nullptr;
  fid_ep* ep = nullptr;
  SpinThenBlockMutex mu;  // every call on this domain is serialised here (FI_THREAD_DOMAIN)
  std::deque<Piece*> pending;
  LiveList live;
  std::vector<Piece*> recvs;
  std::vector<uint8_t> name;
  int64_t lastSweep = 0;
  // Zero-byte writes (immediates) still need a valid remote key on some providers (tcp checks it even for 0
  // bytes), so every endpoint exposes a small registered sink that immediates target.
  uint64_t sink[8] = {0};
  fid_mr* sinkMr = nullptr;
  uint64_t sinkKey = 0;
};

namespace {

class FiRegion : public MemoryRegion {
 public:
  FiRegion(LibfabricEngine* engine, void* data, size_t size) : engine_(engine), data_(data), size_(size) {}
  ~FiRegion() override { engine_->deregister(mrs_); }
  void* data() const override { return data_; }
  size_t size() const override { return size_; }
  const MemoryDesc& desc() const override { return desc_; }

  LibfabricEngine* engine_;
  void* data_;
  size_t size_;
  MemoryDesc desc_;
  std::vector<fid_mr*> mrs_;
  void* mrDesc_[kMaxNics] = {nullptr, nullptr, nullptr, nullptr};
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

fi_info* LibfabricEngine::getInfo(const std::string& prov, bool hmem, bool ordered) {
  fi_info* hints = fi_allocinfo();
  if (hints == nullptr) return nullptr;
  hints->caps = FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE | (hmem ? FI_HMEM : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->av_type = FI_AV_TABLE;
  if (ordered) {
    hints->tx_attr->msg_order = FI_ORDER_RMA_WAW | FI_ORDER_WAW;
    hints->rx_attr->msg_order = FI_ORDER_RMA_WAW | FI_ORDER_WAW;
  }
  if (!prov.empty()) hints->fabric_attr->prov_name = strdup(prov.c_str());
  fi_info* info = nullptr;
  int rc = fi_getinfo(kFiApiVersion, nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  if (rc != 0) return nullptr;
  return info;
}

std::vector<std::string> LibfabricEngine::candidates(const std::string& name) {
  if (name == "tcp") return {"tcp;ofi_rxm", "tcp"};
  if (name == "verbs") return {"verbs;ofi_rxm", "verbs"};
  return {name};
}

std::vector<std::string> LibfabricEngine::probeProviders() {
  std::vector<std::string> out;
  for (const char* name : {"efa", "verbs", "tcp", "shm", "sockets"}) {
    for (const std::string& c : candidates(name)) {
      fi_info* info = getInfo(c, false, false);
      if (info == nullptr) continue;
      std::string prov = info->fabric_attr->prov_name;
      fi_freeinfo(info);
      if (std::find(out.begin(), out.end(), prov) == out.end()) out.push_back(prov);
      break;
    }
  }
  return out;
}

LibfabricEngine::LibfabricEngine(const EngineOptions& options) : EngineBase(options) {
  std::string want = options.provider;
  fi_info* list = nullptr;
  std::string tried;
  for (const std::string& c : candidates(want)) {
    tried += (tried.empty() ? "" : ", ") + c;
    const bool hmem = c.rfind("efa", 0) == 0 || c.rfind("verbs", 0) == 0;
    for (int attempt = 0; attempt < 4 && list == nullptr; ++attempt) {
      // Ask for HMEM and RMA write-after-write ordering first; drop what the provider cannot give.
      bool withHmem = hmem && attempt < 2;
      bool ordered = (attempt % 2) == 0;
      list = getInfo(c, withHmem, ordered);
      if (list != nullptr) {
        hmem_ = withHmem;
        ordered_ = ordered;
      }
    }
    if (list != nullptr) break;
  }
  if (list == nullptr) {
    EPCOMM_THROW(kUnavailable, "libfabric provider '" << want << "' (tried " << tried
                                                      << ") offers no FI_EP_RDM endpoint with FI_RMA and FI_MSG here");
  }
  // Pick the interface: EPCOMM_FABRIC_DOMAIN if set, else the first IPv4 one, else the first.
  const std::string domainWanted = envString("EPCOMM_FABRIC_DOMAIN");
  fi_info* chosen = nullptr;
  for (fi_info* i = list; i != nullptr; i = i->next) {
    if (!domainWanted.empty()) {
      if (i->domain_attr->name != nullptr && domainWanted == i->domain_attr->name) {
        chosen = i;
        break;
      }
      continue;
    }
    if (chosen == nullptr) chosen = i;
    if (i->addr_format == FI_SOCKADDR_IN && chosen->addr_format != FI_SOCKADDR_IN) chosen = i;
  }
  if (chosen == nullptr) {
    fi_freeinfo(list);
    EPCOMM_THROW(kUnavailable, "libfabric provider '" << want << "' has no domain named '" << domainWanted
                                                      << "' (EPCOMM_FABRIC_DOMAIN)");
  }
  prov_ = chosen->fabric_attr->prov_name;
  const uint64_t mrMode = chosen->domain_attr->mr_mode;
  virtAddr_ = (mrMode & FI_MR_VIRT_ADDR) != 0;
  mrLocal_ = (mrMode & FI_MR_LOCAL) != 0;
  provKey_ = (mrMode & FI_MR_PROV_KEY) != 0;
  mrEndpoint_ = (mrMode & FI_MR_ENDPOINT) != 0;
  rxCqData_ = (chosen->mode & FI_RX_CQ_DATA) != 0;
  injectSize_ = chosen->tx_attr->inject_size;
  maxMsg_ = chosen->ep_attr->max_msg_size > 0 ? chosen->ep_attr->max_msg_size : (1ull << 30);
  if (chosen->domain_attr->cq_data_size < 4) {
    std::string p = prov_;
    fi_freeinfo(list);
    EPCOMM_THROW(kUnavailable, "libfabric provider " << p << " carries only " << chosen->domain_attr->cq_data_size
                                                     << " bytes of remote CQ data; immediates need 4");
  }
  nics_.reserve(numNics_);
  try {
    for (int n = 0; n < numNics_; ++n) {
      nics_.push_back(std::make_unique<FiNic>());
      nics_.back()->index = n;
      openNic(*nics_.back(), chosen);
    }
  } catch (...) {
    fi_freeinfo(list);
    closeAll();
    throw;
  }
  fi_freeinfo(list);
  EPCOMM_LOG(kInfo, "libfabric engine: provider " << prov_ << ", " << numNics_ << " endpoint(s), mr_mode"
                                                  << (virtAddr_ ? " virt_addr" : "") << (mrLocal_ ? " local" : "")
                                                  << (provKey_ ? " prov_key" : "") << (mrEndpoint_ ? " endpoint" : "")
                                                  << ", inject " << injectSize_ << ", ordered " << ordered_);
  startProgress();
}

LibfabricEngine::~LibfabricEngine() {
  stopProgress();
  closeAll();
}

void LibfabricEngine::openNic(FiNic& n, fi_info* info) {
  n.info = fi_dupinfo(info);
  EPCOMM_CHECK(n.info != nullptr, kFabric, "fi_dupinfo failed (provider " << prov_ << ")");
  EPCOMM_CHECK_FI(fi_fabric(n.info->fabric_attr, &n.fabric, nullptr), "fi_fabric");
  EPCOMM_CHECK_FI(fi_domain(n.fabric, n.info, &n.domain, nullptr), "fi_domain");
  fi_av_attr avAttr{};
  avAttr.type = FI_AV_TABLE;
  EPCOMM_CHECK_FI(fi_av_open(n.domain, &avAttr, &n.av, nullptr), "fi_av_open");
  fi_cq_attr cqAttr{};
  cqAttr.format = FI_CQ_FORMAT_DATA;
  cqAttr.wait_obj = FI_WAIT_NONE;
  cqAttr.size = 0;
  EPCOMM_CHECK_FI(fi_cq_open(n.domain, &cqAttr, &n.cq, nullptr), "fi_cq_open");
  EPCOMM_CHECK_FI(fi_endpoint(n.domain, n.info, &n.ep, nullptr), "fi_endpoint");
  EPCOMM_CHECK_FI(fi_ep_bind(n.ep, &n.av->fid, 0), "fi_ep_bind(av)");
  EPCOMM_CHECK_FI(fi_ep_bind(n.ep, &n.cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
  EPCOMM_CHECK_FI(fi_enable(n.ep), "fi_enable");
  size_t len = 0;
  int rc = fi_getname(&n.ep->fid, nullptr, &len);
  EPCOMM_CHECK(rc == -FI_ETOOSMALL || rc == 0, kFabric, "fi_getname failed (provider " << prov_ << "): " << fiErr(rc));
  n.name.resize(len);
  EPCOMM_CHECK_FI(fi_getname(&n.ep->fid, n.name.data(), &len), "fi_getname");
  n.name.resize(len);
  // Receive buffers for control messages (and, for FI_RX_CQ_DATA providers, for remote CQ data).
  for (int i = 0; i < kRecvBuffers; ++i) {
    auto* p = new Piece();
    p->kind = PieceKind::kRecv;
    p->nic = n.index;
    p->msg.resize(kMsgHeader + kMaxMessage);
    n.recvs.push_back(p);
    if (mrLocal_) {
      fid_mr* mr = nullptr;
      EPCOMM_CHECK_FI(fi_mr_reg(n.domain, p->msg.data(), p->msg.size(), FI_RECV, 0,
                                provKey_ ? 0 : nextKey_.fetch_add(1), 0, &mr, nullptr),
                      "fi_mr_reg(receive buffer)");
      p->msgMr = mr;
      if (mrEndpoint_) {
        EPCOMM_CHECK_FI(fi_mr_bind(mr, &n.ep->fid, 0), "fi_mr_bind(receive buffer)");
        EPCOMM_CHECK_FI(fi_mr_enable(mr), "fi_mr_enable(receive buffer)");
      }
      p->desc = fi_mr_desc(mr);
    }
    EPCOMM_CHECK_FI(fi_recv(n.ep, p->msg.data(), p->msg.size(), p->desc, FI_ADDR_UNSPEC, &p->ctx), "fi_recv");
  }
  EPCOMM_CHECK_FI(fi_mr_reg(n.domain, n.sink, sizeof(n.sink), FI_REMOTE_WRITE | FI_WRITE, 0,
                            provKey_ ? 0 : nextKey_.fetch_add(1), 0, &n.sinkMr, nullptr),
                  "fi_mr_reg(immediate sink)");
  if (mrEndpoint_) {
    EPCOMM_CHECK_FI(fi_mr_bind(n.sinkMr, &n.ep->fid, 0), "fi_mr_bind(immediate sink)");
    EPCOMM_CHECK_FI(fi_mr_enable(n.sinkMr), "fi_mr_enable(immediate sink)");
  }
  n.sinkKey = fi_mr_key(n.sinkMr);
}

void LibfabricEngine::closeAll() {
  for (auto& np : nics_) {
    FiNic& n = *np;
    std::lock_guard<SpinThenBlockMutex> lock(n.mu);
    // Closing the endpoint first cancels what is still posted, so the pieces below are no longer referenced.
    if (n.ep != nullptr) fi_close(&n.ep->fid);
    n.ep = nullptr;
    for (Piece* p : n.recvs) freePiece(p);
    n.recvs.clear();
    for (Piece* p : n.pending) {
      if (p->op) {
        p->op->fail("engine closed before the operation was posted");
        finishOp(p->op);
      }
      freePiece(p);
    }
    n.pending.clear();
    while (!n.live.empty()) {
      Piece* p = n.live.head;
      n.live.erase(p);
      if (p->op) {
        p->op->fail("engine closed before the operation completed");
        finishOp(p->op);
      }
      freePiece(p);
    }
    if (n.sinkMr != nullptr) fi_close(&n.sinkMr->fid);
    n.sinkMr = nullptr;
    if (n.av != nullptr) fi_close(&n.av->fid);
    if (n.cq != nullptr) fi_close(&n.cq->fid);
    if (n.domain != nullptr) fi_close(&n.domain->fid);
    if (n.fabric != nullptr) fi_close(&n.fabric->fid);
    if (n.info != nullptr) fi_freeinfo(n.info);
    n.av = nullptr;
    n.cq = nullptr;
    n.domain = nullptr;
    n.fabric = nullptr;
    n.info = nullptr;
  }
}

std::string LibfabricEngine::providerName() const { return prov_; }

std::vector<uint8_t> LibfabricEngine::address() const {
  std::vector<uint8_t> out;
  auto put32 = [&](uint32_t v) {
    const auto* b = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), b, b + 4);
  };
  put32(kAddrMagic);
  put32(static_cast<uint32_t>(numNics_));
  put32(options_.shardByBytes ? 1u : 0u);
  put32(static_cast<uint32_t>(fnv1a64(prov_.data(), prov_.size())));
  for (const auto& n : nics_) {
    put32(static_cast<uint32_t>(n->name.size()));
    out.insert(out.end(), n->name.begin(), n->name.end());
    uint64_t sink[2] = {virtAddr_ ? reinterpret_cast<uint64_t>(n->sink) : 0, n->sinkKey};
    const auto* b = reinterpret_cast<const uint8_t*>(sink);
    out.insert(out.end(), b, b + sizeof(sink));
  }
  return out;
}

PeerId LibfabricEngine::addPeer(const std::vector<uint8_t>& address) {
  size_t pos = 0;
  auto get32 = [&]() -> uint32_t {
    EPCOMM_CHECK(pos + 4 <= address.size(), kInvalidArgument,
                 "addPeer: truncated address (" << address.size() << " bytes)");
    uint32_t v;
    std::memcpy(&v, address.data() + pos, 4);
    pos += 4;
    return v;
  };
  EPCOMM_CHECK(get32() == kAddrMagic, kInvalidArgument, "addPeer: not a libfabric engine address");
  uint32_t nics = get32();
  uint32_t byBytes = get32();
  uint32_t provHash = get32();
  EPCOMM_CHECK(nics == static_cast<uint32_t>(numNics_) && byBytes == (options_.shardByBytes ? 1u : 0u),
               kInvalidArgument,
               "addPeer: peer drives " << nics << " NIC(s) sharding by " << (byBytes ? "bytes" : "peer") << ", this "
                                       << "engine " << numNics_ << " sharding by "
                                       << (options_.shardByBytes ? "bytes" : "peer") << ": they must match");
  EPCOMM_CHECK(provHash == static_cast<uint32_t>(fnv1a64(prov_.data(), prov_.size())), kInvalidArgument,
               "addPeer: the peer uses another libfabric provider than " << prov_);
  PeerEntry entry;
  entry.hash = fnv1a64(address.data(), address.size());
  // Locked across the AV inserts: concurrent addPeers run one at a time, each inserting on every NIC before the next.
  return peers_.locked([&](std::vector<PeerEntry>& peers) {
    for (int n = 0; n < numNics_; ++n) {
      uint32_t len = get32();
      EPCOMM_CHECK(pos + len + 16 <= address.size(), kInvalidArgument, "addPeer: truncated address for NIC " << n);
      std::lock_guard<SpinThenBlockMutex> lock(nics_[n]->mu);
      int rc = fi_av_insert(nics_[n]->av, address.data() + pos, 1, &entry.addrs[n], 0, nullptr);
      EPCOMM_CHECK(
          rc == 1, kFabric,
          "fi_av_insert (NIC " << n << ", provider " << prov_ << ") failed: " << (rc < 0 ? fiErr(rc) : "0 inserted"));
      pos += len;
      std::memcpy(&entry.sinkAddr[n], address.data() + pos, 8);
      std::memcpy(&entry.sinkKey[n], address.data() + pos + 8, 8);
      pos += 16;
    }
    peers.push_back(entry);
    return static_cast<PeerId>(peers.size() - 1);
  });
}

LibfabricEngine::PeerEntry LibfabricEngine::peerEntry(PeerId peer) const {
  return peers_.locked([&](const std::vector<PeerEntry>& peers) {
    EPCOMM_CHECK(peer < peers.size(), kInvalidArgument, "unknown peer " << peer << " (" << peers.size() << " added)");
    return peers[peer];
  });
}

std::unique_ptr<MemoryRegion> LibfabricEngine::registerMemory(void* data, size_t bytes, MemoryKind kind, int device) {
  EPCOMM_CHECK(kind != MemoryKind::kCuda || hmem_, kUnavailable,
               "registerMemory: libfabric provider " << prov_ << " cannot register CUDA memory (no FI_HMEM support "
                                                     << "in this libfabric build): stage through pinned host memory");
  checkRegisterRange(data, bytes, kind);
  auto region = std::make_unique<FiRegion>(this, data, bytes);
  for (int n = 0; n < numNics_; ++n) {
    FiNic& nic = *nics_[n];
    iovec iov{data, bytes};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ;
    attr.requested_key = provKey_ ? 0 : nextKey_.fetch_add(1);
    attr.iface = kind == MemoryKind::kCuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (kind == MemoryKind::kCuda) attr.device.cuda = device;
    fid_mr* mr = nullptr;
    std::lock_guard<SpinThenBlockMutex> lock(nic.mu);
    int rc = fi_mr_regattr(nic.domain, &attr, 0, &mr);
    EPCOMM_CHECK(rc == 0, kFabric,
                 "fi_mr_regattr of [" << data << ", +" << bytes << ") on NIC " << n << " (provider " << prov_
                                      << ") failed: " << fiErr(rc));
    region->mrs_.push_back(mr);
    if (mrEndpoint_) {
      EPCOMM_CHECK_FI(fi_mr_bind(mr, &nic.ep->fid, 0), "fi_mr_bind");
      EPCOMM_CHECK_FI(fi_mr_enable(mr), "fi_mr_enable");
    }
    region->desc_.keys[n] = fi_mr_key(mr);
    region->mrDesc_[n] = fi_mr_desc(mr);
  }
  sealDesc(region->desc_, data, bytes);
  return region;
}

void LibfabricEngine::deregister(std::vector<fid_mr*>& mrs) {
  for (size_t n = 0; n < mrs.size(); ++n) {
    if (n < nics_.size()) {
      std::lock_guard<SpinThenBlockMutex> lock(nics_[n]->mu);
      fi_close(&mrs[n]->fid);
    } else {
      fi_close(&mrs[n]->fid);
    }
  }
  mrs.clear();
}

EngineBase::Target LibfabricEngine::makeTarget(PeerId peer, const MemoryDesc& desc) {
  EPCOMM_CHECK(peer < numPeers(), kInvalidArgument, "unknown peer " << peer);
  EPCOMM_CHECK(desc.numNics == static_cast<uint32_t>(numNics_), kInvalidArgument,
               "descriptor for peer " << peer << " carries keys for " << desc.numNics << " NIC(s), the engine drives "
                                      << numNics_);
  Target t;
  t.peer = peer;
  t.size = desc.size;
  for (int n = 0; n < numNics_; ++n) {
    t.remoteBase[n] = virtAddr_ ? desc.addr : 0;
    t.key[n] = desc.keys[n];
  }
  return t;
}

// ---------------------------------------------------------------------------------------------------------------
// Posting.

ssize_t LibfabricEngine::postPiece(FiNic& n, Piece* p) {
  switch (p->kind) {
    case PieceKind::kWrite: {
      if (p->inject) {
        return p->imm ? fi_inject_writedata(n.ep, p->buf, p->len, p->data, p->dest, p->raddr, p->key)
                      : fi_inject_write(n.ep, p->buf, p->len, p->dest, p->raddr, p->key);
      }
      iovec iov{const_cast<void*>(p->buf), p->len};
      void* desc = p->desc;
      fi_rma_iov rma{p->raddr, p->len, p->key};
      fi_msg_rma m{};
      m.msg_iov = &iov;
      m.desc = &desc;
      m.iov_count = p->len > 0 ? 1 : 0;
      m.addr = p->dest;
      m.rma_iov = &rma;
      m.rma_iov_count = 1;
      m.context = &p->ctx;
      m.data = p->data;
      uint64_t flags = FI_COMPLETION | (p->imm ? FI_REMOTE_CQ_DATA : 0) | (p->delivery ? FI_DELIVERY_COMPLETE : 0);
      return fi_writemsg(n.ep, &m, flags);
    }
    case PieceKind::kSend:
      if (p->inject) return fi_inject(n.ep, p->msg.data(), p->msg.size(), p->dest);
      return fi_send(n.ep, p->msg.data(), p->msg.size(), p->desc, p->dest, &p->ctx);
    case PieceKind::kRecv:
      return fi_recv(n.ep, p->msg.data(), p->msg.size(), p->desc, FI_ADDR_UNSPEC, &p->ctx);
  }
  return -FI_EINVAL;
}

std::string LibfabricEngine::describe(const Piece* p, const char* call) const {
  std::ostringstream oss;
  oss << (p->op ? p->op->what : std::string("operation")) << " to peer " << p->peer << " (NIC " << p->nic
      << ", provider " << prov_ << ", " << call << ")";
  return oss.str();
}

void LibfabricEngine::pieceDone(FiNic& n, Piece* p, const std::string& error, Finished& finished) {
  n.live.erase(p);
  if (!error.empty() && p->op) p->op->fail(error);
  if (p->batch) {
    std::shared_ptr<NicBatch> b = std::move(p->batch);
    if (!error.empty()) b->failed = true;
    if (--b->remaining == 0 && b->trailer != nullptr) {
      Piece* t = b->trailer;
      b->trailer = nullptr;
      if (b->failed) {
        pieceDone(n, t, "not sent: an earlier piece of the same operation failed", finished);
      } else {
        submitLocked(n, t, finished);
      }
    }
  }
  if (p->op && p->op->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) finished.push_back(p->op);
  freePiece(p);
}

void LibfabricEngine::submitLocked(FiNic& n, Piece* p, Finished& finished) {
  p->deadline = p->op ? p->op->deadlineMs : nowMs() + timeoutMs_;
  if (!n.pending.empty()) {
    n.pending.push_back(p);
    return;
  }
  ssize_t rc = postPiece(n, p);
  if (rc == 0) {
    // Injected operations produce no completion entry: the buffer is free and the provider owns delivery.
    if (p->inject) {
      pieceDone(n, p, "", finished);
    } else {
      n.live.insert(p);
    }
  } else if (rc == -FI_EAGAIN) {
    n.pending.push_back(p);
  } else {
    pieceDone(n, p, describe(p, p->kind == PieceKind::kSend ? "fi_send" : "fi_writemsg") + " failed: " + fiErr(rc),
              finished);
  }
}

void LibfabricEngine::retryPending(FiNic& n, Finished& finished) {
  while (!n.pending.empty()) {
    Piece* p = n.pending.front();
    ssize_t rc = postPiece(n, p);
    if (rc == -FI_EAGAIN) return;
    n.pending.pop_front();
    if (rc == 0) {
      if (p->inject) {
        pieceDone(n, p, "", finished);
      } else {
        n.live.insert(p);
      }
    } else {
      pieceDone(n, p, describe(p, "post") + " failed: " + fiErr(rc), finished);
    }
  }
}

void LibfabricEngine::postPlan(const Target& target, const MemoryRegion* src, std::vector<NicPlan>& plan, uint32_t imm,
                               const std::shared_ptr<OpState>& op) {
  const auto* region = static_cast<const FiRegion*>(src);
  // Build every piece first so op->pending is final before the first one can complete.
  std::vector<std::vector<Piece*>> now(numNics_);
  std::vector<std::shared_ptr<NicBatch>> batches(numNics_);
  int total = 0;
  const PeerEntry peer = peerEntry(target.peer);
  for (int n = 0; n < numNics_; ++n) {
    NicPlan& np = plan[n];
    if (np.chunks.empty() && !np.imm) continue;
    const fi_addr_t dest = peer.addrs[n];
    auto make = [&](uint64_t srcOff, uint64_t dstOff, uint64_t len) {
      auto* p = new Piece();
      p->kind = PieceKind::kWrite;
      p->nic = n;
      p->op = op;
      p->peer = target.peer;
      p->buf = len > 0 ? static_cast<const uint8_t*>(region->data()) + srcOff : nullptr;
      p->len = len;
      p->desc = len > 0 ? region->mrDesc_[n] : nullptr;
      p->dest = dest;
      p->raddr = len > 0 ? target.remoteBase[n] + dstOff : peer.sinkAddr[n];
      p->key = len > 0 ? target.key[n] : peer.sinkKey[n];
      p->data = imm;
      ++total;
      return p;
    };
    std::vector<Piece*> pieces;
    for (const Chunk& c : np.chunks) {
      for (uint64_t off = 0; off < c.length; off += maxMsg_) {
        uint64_t len = std::min<uint64_t>(maxMsg_, c.length - off);
        pieces.push_back(make(c.srcOffset + off, c.dstOffset + off, len));
      }
    }
    if (np.imm) {
      if (pieces.empty()) {
        pieces.push_back(make(0, 0, 0));
        pieces.back()->imm = true;
      } else if (ordered_) {
        // RMA write-after-write ordering: the immediate rides on the last piece and lands after all of them.
        pieces.back()->imm = true;
      } else {
        // Unordered provider (EFA SRD): the immediate follows once every piece is delivered.
        auto b = std::make_shared<NicBatch>();
        b->remaining = static_cast<int>(pieces.size());
        b->trailer = make(0, 0, 0);
        b->trailer->imm = true;
        b->trailer->inject = injectSize_ > 0;
        for (Piece* p : pieces) {
          p->delivery = true;
          p->batch = b;
        }
      }
    }
    // NOTE: FI_DELIVERY_COMPLETE only on request (options.deliveryComplete) and only for writes whose completion
    // someone observes. Measured (H200 host, tcp/shm loopback): it doubled the one-way latency of 128 B..2 KiB
    // write-with-immediate ping-pong on tcp (13.5 vs 6.8 us) and cut 8 B streaming on shm 4x.
    const bool wantsCompletion = op->done.counter != nullptr || static_cast<bool>(op->done.callback);
    for (Piece* p : pieces) {
      if (wantsCompletion && options_.deliveryComplete) p->delivery = true;
      if (!p->delivery && !p->batch && p->len <= injectSize_) p->inject = true;
    }
    now[n] = std::move(pieces);
  }
  if (!armOp(op, total)) return;
  Finished finished;
  for (int n = 0; n < numNics_; ++n) {
    if (now[n].empty()) continue;
    FiNic& nic = *nics_[n];
    std::lock_guard<SpinThenBlockMutex> lock(nic.mu);
    for (Piece* p : now[n]) submitLocked(nic, p, finished);
  }
  for (auto& f : finished) finishOp(f);
}

bool LibfabricEngine::tryInject(PeerId peer, const void* buf, size_t len, const MemoryDesc* dst, uint64_t dstOffset,
                                bool withImm, uint32_t imm, Completion& done) {
  const int n = static_cast<int>(peer % numNics_);
  PeerEntry e;
  const bool known = peers_.locked([&](const std::vector<PeerEntry>& peers) {
    if (peer >= peers.size()) return false;
    e = peers[peer];
    return true;
  });
  if (!known) return false;  // the slow path reports it
  const uint64_t raddr = len > 0 ? (virtAddr_ ? dst->addr : 0) + dstOffset : e.sinkAddr[n];
  const uint64_t key = len > 0 ? dst->keys[n] : e.sinkKey[n];
  FiNic& nic = *nics_[n];
  ssize_t rc;
  {
    std::lock_guard<SpinThenBlockMutex> lock(nic.mu);
    if (!nic.pending.empty()) return false;  // keep the order behind queued work
    rc = withImm ? fi_inject_writedata(nic.ep, buf, len, imm, e.addrs[n], raddr, key)
                 : fi_inject_write(nic.ep, buf, len, e.addrs[n], raddr, key);
  }
  if (rc != 0) return false;  // FI_EAGAIN or an error: the slow path queues or reports it
  if (done.counter != nullptr) done.counter->fetch_add(1, std::memory_order_acq_rel);
  if (done.callback) {
    try {
      done.callback("");
    } catch (const std::exception& ex) {
      recordError(ErrorCode::kInternal, std::string("completion callback threw: ") + ex.what());
    }
  }
  return true;
}

void LibfabricEngine::write(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, const MemoryDesc& dst,
                            uint64_t dstOffset, uint64_t length, bool withImm, uint32_t imm, Completion done) {
  // NOTE: the latency path (small write-with-immediate) skips the op/piece allocations and the plan: a direct
  // fi_inject_writedata under the NIC lock. Anything unusual falls through to the general path, which validates.
  // With deliveryComplete a requested completion means delivery (see postPlan), which inject cannot report.
  const bool fireAndForget = !options_.deliveryComplete || (done.counter == nullptr && !done.callback);
  if (fireAndForget && length <= injectSize_ && (numNics_ == 1 || !options_.shardByBytes) &&
      dst.numNics == static_cast<uint32_t>(numNics_) && dstOffset <= dst.size && length <= dst.size - dstOffset &&
      srcOffset <= src.size() && length <= src.size() - srcOffset) {
    const void* buf = length > 0 ? static_cast<const uint8_t*>(src.data()) + srcOffset : nullptr;
    if (tryInject(peer, buf, length, &dst, dstOffset, withImm, imm, done)) return;
  }
  // One piece on one NIC (the common case of the host/proxy backends): no plan, no per-NIC vectors.
  if ((numNics_ == 1 || !options_.shardByBytes) && length > 0 && length <= maxMsg_ && (ordered_ || !withImm) &&
      dst.numNics == static_cast<uint32_t>(numNics_) && dstOffset <= dst.size && length <= dst.size - dstOffset &&
      srcOffset <= src.size() && length <= src.size() - srcOffset) {
    const int n = static_cast<int>(peer % numNics_);
    const fi_addr_t dest = peers_.locked([&](const std::vector<PeerEntry>& peers) {
      EPCOMM_CHECK(peer < peers.size(), kInvalidArgument, "write: unknown peer " << peer);
      return peers[peer].addrs[n];
    });
    auto op = newOp(peer, withImm ? "write-with-immediate" : "write", std::move(done));
    op->pending.store(1, std::memory_order_relaxed);
    auto* p = new Piece();
    p->kind = PieceKind::kWrite;
    p->nic = n;
    p->op = op;
    p->peer = peer;
    p->buf = static_cast<const uint8_t*>(src.data()) + srcOffset;
    p->len = length;
    p->desc = static_cast<const FiRegion&>(src).mrDesc_[n];
    p->dest = dest;
    p->raddr = (virtAddr_ ? dst.addr : 0) + dstOffset;
    p->key = dst.keys[n];
    p->data = imm;
    p->imm = withImm;
    const bool wantsCompletion = op->done.counter != nullptr || static_cast<bool>(op->done.callback);
    p->delivery = wantsCompletion && options_.deliveryComplete;
    p->inject = !p->delivery && length <= injectSize_;
    Finished finished;
    {
      std::lock_guard<SpinThenBlockMutex> lock(nics_[n]->mu);
      submitLocked(*nics_[n], p, finished);
    }
    for (auto& f : finished) finishOp(f);
    return;
  }
  EngineBase::write(peer, src, srcOffset, dst, dstOffset, length, withImm, imm, std::move(done));
}

void LibfabricEngine::immediate(PeerId peer, uint32_t imm, Completion done) {
  const bool fireAndForget = !options_.deliveryComplete || (done.counter == nullptr && !done.callback);
  if (fireAndForget && (numNics_ == 1 || !options_.shardByBytes) &&
      tryInject(peer, nullptr, 0, nullptr, 0, true, imm, done)) {
    return;
  }
  EngineBase::immediate(peer, imm, std::move(done));
}

void LibfabricEngine::send(PeerId peer, const void* data, size_t bytes, Completion done) {
  EPCOMM_CHECK(bytes <= kMaxMessage, kInvalidArgument,
               "send: control message of " << bytes << " bytes exceeds " << kMaxMessage);
  EPCOMM_CHECK(bytes == 0 || data != nullptr, kInvalidArgument, "send: null data for " << bytes << " bytes");
  const int n = static_cast<int>(peer % numNics_);
  auto op = newOp(peer, "send", std::move(done));
  auto* p = new Piece();
  p->kind = PieceKind::kSend;
  p->nic = n;
  p->op = op;
  p->peer = peer;
  p->dest = peerEntry(peer).addrs[n];
  p->msg = frameMessage(data, bytes);
  p->inject = p->msg.size() <= injectSize_;
  op->pending.store(1);
  FiNic& nic = *nics_[n];
  Finished finished;
  {
    std::lock_guard<SpinThenBlockMutex> lock(nic.mu);
    if (!p->inject && mrLocal_) {
      fid_mr* mr = nullptr;
      int rc = fi_mr_reg(nic.domain, p->msg.data(), p->msg.size(), FI_SEND, 0, provKey_ ? 0 : nextKey_.fetch_add(1), 0,
                         &mr, nullptr);
      if (rc != 0) {
        delete p;
        EPCOMM_THROW(kFabric, "fi_mr_reg(send buffer, provider " << prov_ << ") failed: " << fiErr(rc));
      }
      p->msgMr = mr;
      if (mrEndpoint_) {
        fi_mr_bind(mr, &nic.ep->fid, 0);
        fi_mr_enable(mr);
      }
      p->desc = fi_mr_desc(mr);
    }
    submitLocked(nic, p, finished);
  }
  for (auto& f : finished) finishOp(f);
}

// ---------------------------------------------------------------------------------------------------------------
// Progress.

void LibfabricEngine::handleEntry(FiNic& n, const fi_cq_data_entry& e, Finished& finished) {
  const bool remoteData = (e.flags & FI_REMOTE_CQ_DATA) != 0;
  if (remoteData) countImm(static_cast<uint32_t>(e.data));
  // A remote write's completion carries no context of ours unless the provider consumed a posted receive.
  if (e.op_context == nullptr || (remoteData && (e.flags & FI_RECV) == 0 && !rxCqData_)) return;
  auto* p = reinterpret_cast<Piece*>(e.op_context);
  if (p->kind == PieceKind::kRecv) {
    if ((e.flags & FI_MSG) != 0 && !remoteData) deliverFramed(p->msg.data(), e.len);
    ssize_t rc = postPiece(n, p);
    if (rc != 0) recordError(ErrorCode::kFabric, "fi_recv repost (provider " + prov_ + ") failed: " + fiErr(rc));
    return;
  }
  pieceDone(n, p, "", finished);
}

void LibfabricEngine::handleError(FiNic& n, Finished& finished) {
  fi_cq_err_entry err{};
  ssize_t rc = fi_cq_readerr(n.cq, &err, 0);
  if (rc < 0) return;
  char buf[256] = {0};
  const char* provErr = fi_cq_strerror(n.cq, err.prov_errno, err.err_data, buf, sizeof(buf));
  std::string detail = fiErr(err.err) + " (provider error: " + (provErr != nullptr ? provErr : "?") + ")";
  auto* p = reinterpret_cast<Piece*>(err.op_context);
  if (p == nullptr) {
    recordError(ErrorCode::kFabric,
                "fi_cq_readerr on NIC " + std::to_string(n.index) + " (provider " + prov_ + "): " + detail);
    return;
  }
  if (p->kind == PieceKind::kRecv) {
    if (err.err == FI_ECANCELED) return;
    recordError(ErrorCode::kFabric, "control message receive (provider " + prov_ + ") failed: " + detail);
    postPiece(n, p);
    return;
  }
  pieceDone(n, p, describe(p, "fi_cq_readerr") + " failed: " + detail, finished);
}

void LibfabricEngine::sweep(FiNic& n, Finished& finished) {
  const int64_t now = nowMs();
  if (now - n.lastSweep < kSweepPeriodMs) return;
  n.lastSweep = now;
  auto timeoutText = [&](Piece* p) {
    return describe(p, "no completion") + " timed out after " + std::to_string(timeoutMs_) + " ms";
  };
  for (auto it = n.pending.begin(); it != n.pending.end();) {
    Piece* p = *it;
    if (now > p->deadline) {
      it = n.pending.erase(it);
      pieceDone(n, p, timeoutText(p) + " (never accepted: FI_EAGAIN)", finished);
    } else {
      ++it;
    }
  }
  for (Piece* p = n.live.head; p != nullptr; p = p->next) {
    if (p->timedOut || now <= p->deadline) continue;
    // The provider still owns the piece, so it stays live until its completion (or the engine's close);
    // the operation itself is reported failed now.
    p->timedOut = true;
    if (p->op) {
      p->op->fail(timeoutText(p));
      finished.push_back(p->op);
    }
  }
}

bool LibfabricEngine::progressOnce() {
  bool worked = false;
  Finished finished;
  for (auto& np : nics_) {
    FiNic& n = *np;
    std::unique_lock<SpinThenBlockMutex> lock(n.mu, std::try_to_lock);
    if (!lock.owns_lock()) continue;
    if (!n.pending.empty()) retryPending(n, finished);
    fi_cq_data_entry entries[kCqBatch];
    ssize_t got = fi_cq_read(n.cq, entries, kCqBatch);
    if (got > 0) {
      worked = true;
      for (ssize_t i = 0; i < got; ++i) handleEntry(n, entries[i], finished);
    } else if (got == -FI_EAVAIL) {
      worked = true;
      handleError(n, finished);
    } else if (got != -FI_EAGAIN) {
      recordError(ErrorCode::kFabric, "fi_cq_read on NIC " + std::to_string(n.index) + " (provider " + prov_ +
                                          ") failed: " + fiErr(static_cast<int>(got)));
    }
    if (!n.pending.empty() || !n.live.empty()) sweep(n, finished);
  }
  for (auto& f : finished) finishOp(f);
  return worked;
}

}  // namespace fabric
}  // namespace epcomm
