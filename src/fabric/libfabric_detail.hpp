// Internal pieces of the libfabric TransferEngine shared by its two source files: libfabric_engine.cc (set-up,
// peers, memory registration) and libfabric_transfer.cc (posting and progress). Not part of the public API.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/log.hpp"
#include "epcomm/error.hpp"
#include "fabric/engine_base.hpp"
#include "fabric/libfabric_engine.hpp"

namespace epcomm {
namespace fabric {

constexpr uint32_t kFiApiVersion = FI_VERSION(1, 14);
constexpr int kRecvBuffers = 64;
constexpr int kCqBatch = 32;
constexpr uint32_t kAddrMagic = 0x32465045;  // "EPF2": with the process identity
constexpr int64_t kSweepPeriodMs = 20;

inline std::string fiErr(int rc) { return std::string(fi_strerror(rc < 0 ? -rc : rc)); }

#define EPCOMM_CHECK_FI(call, what)                                                                                   \
  do {                                                                                                                \
    int epcomm_rc_ = static_cast<int>(call);                                                                          \
    if (epcomm_rc_ != 0) {                                                                                            \
      EPCOMM_THROW(kFabric,                                                                                           \
                   what << " failed (provider " << prov_ << "): " << fiErr(epcomm_rc_) << " (" << epcomm_rc_ << ")"); \
    }                                                                                                                 \
  } while (0)

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
  const ProcessWatch* process = nullptr;  // the peer's process, when watched (LibfabricEngine::peerGone)
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
  Piece* nextQueued = nullptr;  // FIFO of pieces the provider refused (PeerQueue)
};

// Pieces of one peer that the provider refused with FI_EAGAIN, in post order, retried by progress until their
// deadline. A piece is either here or in FiNic::live, never both.
struct PeerQueue {
  Piece* head = nullptr;
  Piece* tail = nullptr;
  void push(Piece* p) {
    p->nextQueued = nullptr;
    if (tail != nullptr) {
      tail->nextQueued = p;
    } else {
      head = p;
    }
    tail = p;
  }
  Piece* pop() {
    Piece* p = head;
    head = p->nextQueued;
    if (head == nullptr) tail = nullptr;
    p->nextQueued = nullptr;
    return p;
  }
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

inline NicBatch::~NicBatch() { delete trailer; }

inline void freePiece(Piece* p) {
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
  // Our state below, and every provider call but the completion queue's reads (every call, FI_THREAD_DOMAIN).
  SpinThenBlockMutex mu;
  // Held by the one thread reading the completion queue (taken before mu where both are held).
  std::mutex cqMu;
  // NOTE: refused posts wait in a queue per peer, not one per endpoint. An endpoint posts to every peer, and the
  // provider refuses (FI_EAGAIN) the posts to a peer it cannot take more for: tcp;ofi_rxm every post to a peer whose
  // connection it saw fail, shm every post to a dead peer once its command queue is full. Behind one FIFO per
  // endpoint the writes to the live peers waited out that post's deadline, and a survivor's error could name a live
  // peer. tests/fabric/dead_peer_test.cc (W = 5, a rank killed mid-round, 3 runs of each case): with one FIFO, 4 of 4
  // cases failed over tcp (1 MiB writes) and 1 of 4 over shm (4 KiB writes); with a queue per peer, none in 20 runs of
  // each. A post to a peer whose queue is empty goes straight to the provider, whatever the other peers' queues hold.
  // Cost: one endpoint, CQ and AV still serve every peer, so a W = 64 rank holds numNics endpoints (tcp;ofi_rxm: 7
  // fds each here, sockets and an epoll, plus one connection per peer), one progress thread and 16 bytes of queue per
  // peer and endpoint, as W = 2 does. An endpoint per peer would isolate more on shm (below) but costs a 16 MiB
  // /dev/shm region each (1 GiB per rank at W = 64). What stays shared on shm: its operations that need the receiver's
  // answer (writes above its inject size, 4 KiB) complete in order per endpoint, so one to a dead peer holds the
  // completions of those behind it, to any peer, until the engine's timeout fails them (docs/failures.md).
  std::vector<PeerQueue> queues;  // indexed by PeerId; grown by addPeer under mu
  size_t queued = 0;              // pieces in all queues
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

}  // namespace fabric
}  // namespace epcomm
