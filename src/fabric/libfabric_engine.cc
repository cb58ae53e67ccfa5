// TransferEngine over libfabric: FI_EP_RDM endpoints (one per "NIC"), FI_AV_TABLE, one CQ per endpoint with
// FI_CQ_FORMAT_DATA, fi_writemsg / fi_inject_writedata for one-sided writes with 32-bit immediates carried as
// remote CQ data, fi_send/fi_recv with pre-posted buffers for control messages.
// This file: set-up (providers, endpoints, address vectors), peers and memory registration; posting and progress are
// in libfabric_transfer.cc.
#include "fabric/libfabric_engine.hpp"

#include <sys/uio.h>

#include <cstring>
#include <fstream>
#include <string>
#include <unordered_set>

#include "core/env.hpp"
#include "core/log.hpp"
#include "fabric/engine_base.hpp"
#include "fabric/libfabric_detail.hpp"

namespace epcomm {
namespace fabric {

namespace {

// This host and PID namespace, as a key in the engine's address: a peer's pid is watched (core/process_watch.hpp)
// only where the keys match, since a pid names nothing on another host. 0 when /proc cannot tell (never matches).
uint64_t hostKey() {
  static const uint64_t key = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string boot;
    const uint64_t ns = thisProcessIdentity().pidNamespace;
    if (!std::getline(in, boot) || boot.empty() || ns == 0) return uint64_t{0};
    boot += ":" + std::to_string(static_cast<unsigned long long>(ns));
    const uint64_t h = fnv1a64(boot.data(), boot.size());
    return h == 0 ? uint64_t{1} : h;
  }();
  return key;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

fi_info* LibfabricEngine::getInfo(const std::string& prov, bool hmem, bool ordered, bool threadSafe) {
  fi_info* hints = fi_allocinfo();
  if (hints == nullptr) return nullptr;
  hints->caps = FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_WRITE | FI_REMOTE_WRITE | (hmem ? FI_HMEM : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
  hints->domain_attr->threading = threadSafe ? FI_THREAD_SAFE : FI_THREAD_DOMAIN;
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
      fi_info* info = getInfo(c, false, false, false);
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
    for (int attempt = 0; attempt < 8 && list == nullptr; ++attempt) {
      // Ask for HMEM, RMA write-after-write ordering and FI_THREAD_SAFE first; drop what the provider cannot give
      // (thread safety last: it only saves waiting, the others change what the engine can do).
      const bool withHmem = hmem && attempt < 4;
      const bool ordered = (attempt / 2) % 2 == 0;
      const bool threadSafe = attempt % 2 == 0;
      list = getInfo(c, withHmem, ordered, threadSafe);
      if (list != nullptr) {
        hmem_ = withHmem;
        ordered_ = ordered;
        threadSafe_ = threadSafe;
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
  // shm: a peer that died holding its region's lock would wedge every later post to it (core/process_watch.hpp).
  watchPeers_ = prov_.rfind("shm", 0) == 0;
  // NOTE: libfabric's tcp provider queues an RMA inject (fi_inject_write / fi_inject_writedata) with a null context
  // and without the mark it gives message injects, so when the connection fails with one still queued (its peer
  // died) the endpoint's flush reports it as an FI_ECANCELED error completion with op_context NULL, which ofi_rxm
  // dereferences: SIGSEGV in fi_cq_read (rxm_handle_comp_error, libfabric 1.17), seen with a peer killed mid-round
  // while heads and immediates small enough to inject were queued to it. Over tcp;ofi_rxm every write and immediate
  // therefore goes through fi_writemsg with a context of ours, whose error completion comes back intact (control
  // messages keep fi_inject, which the provider marks). Measured (2-core VM, loopback, 8 B write-with-immediate):
  // ping-pong 4.2 vs 3.9 us, streaming 0.4 vs 0.6 M writes/s.
  rmaInject_ = !(prov_.rfind("tcp", 0) == 0 && prov_.find("ofi_rxm") != std::string::npos);
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
                                                  << ", inject " << injectSize_ << ", ordered " << ordered_
                                                  << (threadSafe_ ? ", thread safe" : ", thread domain"));
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
    for (PeerQueue& q : n.queues) {
      while (q.head != nullptr) {
        Piece* p = q.pop();
        if (p->op) {
          p->op->fail("engine closed before the operation was posted");
          finishOp(p->op);
        }
        freePiece(p);
      }
    }
    n.queued = 0;
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
  // This process, so that a peer on the same host learns at once when it exited (core/process_watch.hpp).
  const ProcessIdentity self = thisProcessIdentity();
  for (uint64_t v : {hostKey(), static_cast<uint64_t>(self.pid), self.pidNamespace, self.startTicks}) {
    put32(static_cast<uint32_t>(v));
    put32(static_cast<uint32_t>(v >> 32));
  }
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
  auto get64 = [&] {
    const uint64_t lo = get32();
    return lo | static_cast<uint64_t>(get32()) << 32;
  };
  const uint64_t peerHost = get64();
  const bool sameHost = peerHost != 0 && peerHost == hostKey();
  ProcessIdentity process;
  process.pid = static_cast<int64_t>(get64());
  process.pidNamespace = get64();
  process.startTicks = get64();
  PeerEntry entry;
  entry.hash = fnv1a64(address.data(), address.size());
  // Locked across the AV inserts: concurrent addPeers run one at a time, each inserting on every NIC before the next.
  return peers_.locked([&](std::vector<PeerEntry>& peers) {
    for (int n = 0; n < numNics_; ++n) {
      uint32_t len = get32();
      EPCOMM_CHECK(pos + len + 16 <= address.size(), kInvalidArgument, "addPeer: truncated address for NIC " << n);
      std::lock_guard<SpinThenBlockMutex> lock(nics_[n]->mu);
      nics_[n]->queues.resize(peers.size() + 1);
      int rc = fi_av_insert(nics_[n]->av, address.data() + pos, 1, &entry.addrs[n], 0, nullptr);
      EPCOMM_CHECK(
          rc == 1, kFabric,
          "fi_av_insert (NIC " << n << ", provider " << prov_ << ") failed: " << (rc < 0 ? fiErr(rc) : "0 inserted"));
      pos += len;
      std::memcpy(&entry.sinkAddr[n], address.data() + pos, 8);
      std::memcpy(&entry.sinkKey[n], address.data() + pos + 8, 8);
      pos += 16;
    }
    if (watchPeers_ && sameHost) {
      watches_.push_back(std::make_unique<ProcessWatch>(process));
      entry.process = watches_.back().get();
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

}  // namespace fabric
}  // namespace epcomm
