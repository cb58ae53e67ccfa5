// TransferEngine: one-sided RDMA (write, write-with-immediate, scatter, barrier, paged write) over libfabric or
// libibverbs, with a progress thread, several NICs, and receive-side counters per immediate value.
// Used by the host and proxy backends and usable on its own (KV-cache transfer). No libfabric/verbs headers here.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/tensor.hpp"

namespace epcomm {
namespace fabric {

constexpr int kMaxNics = 4;

/// Serialisable description of a registered region: what a peer needs to write into it.
/// Plain bytes; send it through the bootstrap (see serialize/deserialize).
struct MemoryDesc {
  uint64_t addr = 0;  ///< Base address (or offset 0 for providers with FI_MR_VIRT_ADDR off: handled inside).
  uint64_t size = 0;  ///< Registered bytes.
  uint32_t numNics = 0;
  uint64_t keys[kMaxNics] = {0, 0, 0, 0};  ///< Remote key on each NIC the engine drives.
  uint32_t checksum = 0;                   ///< Detects a corrupted descriptor on deserialize.

  std::vector<uint8_t> serialize() const;
  /// Throws Error(kInvalidArgument) for a wrong size or checksum.
  static MemoryDesc deserialize(const void* data, size_t bytes);
};

/// A local registration; owned by the caller, deregistered on destruction (must outlive its transfers and be
/// destroyed before the engine that registered it).
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
  virtual const MemoryDesc& desc() const = 0;
};

using PeerId = uint32_t;

/// How the issuer learns that an operation finished (all its pieces, on every NIC): its source may be reused (and,
/// with EngineOptions::deliveryComplete, the data is in the peer's memory). Either or both may be set.
/// On failure the counter is NOT incremented; the error is recorded in the engine (see checkErrors / wait*).
struct Completion {
  std::atomic<uint64_t>* counter = nullptr;  ///< Incremented once on success.
  /// Called once; `error` is empty on success, else provider + call + peer. Runs on the progress thread, on a
  /// thread driving progress inside wait*/recv, or inline in the submitting call when the operation completes or
  /// fails at once (small injected writes, posting errors): do not hold a lock the callback needs while submitting.
  std::function<void(const std::string& error)> callback;
};

/// One slice of a scatter: bytes [srcOffset, srcOffset+length) of the source go to dstOffset of a member's desc.
struct ScatterSlice {
  uint64_t srcOffset = 0;
  uint64_t dstOffset = 0;
  uint64_t length = 0;
};

/// A pre-registered set of peers, each with the destination region the group writes into.
using GroupId = uint32_t;

/// Engine options.
struct EngineOptions {
  std::string provider;   ///< "tcp", "shm", "efa", "verbs" (libfabric names, ";ofi_rxm" added as needed) or
                          ///< "ibverbs" for the libibverbs engine; "" = probe (EPCOMM_FABRIC_PROVIDER first).
  int numNics = 1;        ///< Endpoints (NICs) driven by the engine; with one physical NIC, several endpoints.
  int progressCpu = -1;   ///< Pin the progress thread to this core (-1: not pinned).
  int64_t timeoutMs = 0;  ///< Bound of every wait (0: EPCOMM_TIMEOUT_MS).
  /// Multi-NIC: split each transfer over the NICs by bytes (else every transfer to peer p uses NIC p % numNics).
  /// By bytes, every NIC carries its share with its own immediate (zero-byte where it has no data), the receiver
  /// counts numNics immediates per operation and immCount/waitImm divide by numNics; all engines of a job must
  /// agree on numNics and this flag (addPeer checks).
  bool shardByBytes = false;
  /// A write's Completion fires once the data is in the peer's memory (FI_DELIVERY_COMPLETE) instead of once the
  /// source buffer may be reused: a rejected key or a dead peer then always reaches the issuer, at the cost of
  /// an acknowledgement per write (tcp/shm: 2-4x slower small writes). Receivers learn of delivery by immediates
  /// either way.
  bool deliveryComplete = false;
};

/// The engine. Submission is non-blocking and thread-safe; a progress thread drives completions.
class TransferEngine {
 public:
  virtual ~TransferEngine() = default;

  /// Opens the provider and starts the progress thread. Throws kFabric/kVerbs with the provider's error string,
  /// kUnavailable when no usable device exists.
  static std::unique_ptr<TransferEngine> create(const EngineOptions& options);
  /// Names of usable providers on this machine (libfabric fi_getinfo + ibverbs devices), for the probe tool.
  static std::vector<std::string> probe();

  virtual std::string providerName() const = 0;
  virtual int numNics() const = 0;

  /// This engine's address (all NICs), to exchange through the bootstrap.
  virtual std::vector<uint8_t> address() const = 0;
  /// Makes a peer reachable; returns its id. Thread-safe; call once per peer.
  virtual PeerId addPeer(const std::vector<uint8_t>& address) = 0;

  /// Registers [data, data+bytes). kCuda memory needs FI_HMEM/dmabuf support, else throws kUnavailable naming
  /// the provider. Throws kInvalidArgument/kFabric for an invalid range.
  virtual std::unique_ptr<MemoryRegion> registerMemory(void* data, size_t bytes, MemoryKind kind = MemoryKind::kHost,
                                                       int device = -1) = 0;

  /// One-sided write of src[srcOffset, +length) to dst.addr + dstOffset on `peer`. If withImm, the peer's counter
  /// for `imm` is incremented once the data has landed (all NICs' pieces).
  virtual void write(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, const MemoryDesc& dst,
                     uint64_t dstOffset, uint64_t length, bool withImm, uint32_t imm, Completion done) = 0;
  /// Immediate only (zero-byte write with immediate).
  virtual void immediate(PeerId peer, uint32_t imm, Completion done) = 0;

  /// Registers a group: members[i] receives into dsts[i]. Work-request templates are prepared here.
  virtual GroupId createGroup(const std::vector<PeerId>& members, const std::vector<MemoryDesc>& dsts) = 0;
  /// Forgets a group (a later createGroup may reuse its id); operations already posted to it complete as usual. An
  /// engine shared by many objects holds only the groups of the live ones.
  virtual void destroyGroup(GroupId group) = 0;
  /// slices[i] go to member i (an empty slice list still delivers the immediate if withImm).
  /// `done` fires once, after every member's writes completed.
  virtual void scatter(GroupId group, const MemoryRegion& src, const std::vector<std::vector<ScatterSlice>>& slices,
                       bool withImm, uint32_t imm, Completion done) = 0;
  /// An immediate to every member.
  virtual void barrier(GroupId group, uint32_t imm, Completion done) = 0;

  /// Paged write (KV cache): page srcPages[i] (at srcOffset + srcPages[i] * srcStride) to dstOffset +
  /// dstPages[i] * dstStride, pageBytes each; one immediate at the end if withImm.
  virtual void pagedWrite(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, uint64_t srcStride,
                          const std::vector<uint32_t>& srcPages, const MemoryDesc& dst, uint64_t dstOffset,
                          uint64_t dstStride, const std::vector<uint32_t>& dstPages, uint64_t pageBytes, bool withImm,
                          uint32_t imm, Completion done) = 0;

  /// Two-sided control messages (<= 4 KiB). recv blocks until a message from `peer` arrives or the timeout.
  virtual void send(PeerId peer, const void* data, size_t bytes, Completion done) = 0;
  virtual size_t recv(PeerId peer, void* data, size_t capacity) = 0;

  /// Receive side: immediates counted per value, arrivals tolerated before any wait and in any order.
  virtual uint64_t immCount(uint32_t imm) const = 0;
  /// Waits until immCount(imm) >= count, then subtracts count (so values can be reused round after round).
  /// Throws kTimeout naming `what` and the missing count, or the engine's recorded error.
  virtual void waitImm(uint32_t imm, uint64_t count, const std::string& what) = 0;
  /// Waits until *counter >= target (issuer side). Throws kTimeout / the recorded error.
  virtual void waitCounter(const std::atomic<uint64_t>& counter, uint64_t target, const std::string& what) = 0;
  /// Throws the first recorded transfer error (peer died, bad descriptor), if any.
  virtual void checkErrors() = 0;
  /// Runs `fn` while no thread of this engine is inside the provider (the libfabric engine holds every endpoint's
  /// lock), e.g. to end the process where it holds none of the provider's shared state: over libfabric's shm, a process
  /// killed inside the provider can leave a peer's region locked for good (docs/failures.md). `fn` must not call the
  /// engine. The default runs `fn` alone.
  virtual void whileQuiet(const std::function<void()>& fn) { fn(); }
};

}  // namespace fabric
}  // namespace epcomm
