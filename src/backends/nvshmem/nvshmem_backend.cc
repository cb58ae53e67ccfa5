// The nvshmem backend: one symmetric allocation per object on NVSHMEM's heap, and kernels that move tokens with
// put-with-signal (NVLink P2P on one node; IBGDA, IBRC or libfabric between nodes, whichever NVSHMEM runs over).
// See docs/nvshmem.md. Elastic ranks (docs/failures.md) as on nvlink: the same agreement over the node's abort board
// (nvlink_agree.hpp) and the same index mask before the kernels (nvlink_elastic.cu); no NVSHMEM collective after a
// rank is masked.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "backends/backends.hpp"
#include "backends/nvlink/nvlink_agree.hpp"
#include "backends/nvlink/nvlink_index_mask.hpp"
#include "backends/nvlink/nvlink_kernels.hpp"
#include "backends/nvshmem/nvshmem_kernels.hpp"
#include "backends/nvshmem/nvshmem_layout.hpp"
#include "backends/nvshmem/nvshmem_runtime.hpp"
#include "core/abort_board.hpp"
#include "core/call_order.hpp"
#include "core/cuda_check.hpp"
#include "core/cuda_resources.hpp"
#include "core/env.hpp"
#include "core/kernel_args.hpp"
#include "core/log.hpp"
#include "core/validate.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace backends {

namespace {

using nvshmem::Geometry;

/// NVSHMEM's own default heap, the least the first object asks for: smaller plans still leave room for later objects.
constexpr uint64_t kMinHeapBytes = 1ull << 30;

/// NVSHMEM_SYMMETRIC_SIZE the first object of a process sets (unless the user did): room for two objects of its plan
/// in flight at once, plus 256 MiB for NVSHMEM's own symmetric state; never below NVSHMEM's default.
uint64_t heapBytesFor(const Geometry& g) {
  const uint64_t want = roundUpPow2(2 * g.symmetricBytes + (256ull << 20), 2ull << 20);
  return std::max(want, kMinHeapBytes);
}

const char* phaseName(int32_t phase) {
  switch (phase) {
    case nvshmem::kPhaseDispatchRecv:
      return "dispatch-recv (waiting for the peer's tokens)";
    case nvshmem::kPhaseCombineWeights:
      return "combine-send (waiting for the peer to enter combine: its router weights)";
    case nvshmem::kPhaseCombineDone:
      return "combine-recv (waiting for the peer to finish its combine-send)";
    case nvshmem::kPhaseCombineRecv:
      return "combine-recv (waiting for the peer's expert outputs)";
    case nvshmem::kPhaseBadIndex:
      return "dispatch-send (expert index check)";
    case nvshmem::kPhaseBadIndexCombine:
      return "combine-recv (expert index check)";
    case nvshmem::kPhasePeerAbort:
      return "aborted by a peer";
    default:
      return "unknown";
  }
}

// The geometry as every rank must see it (checked over the bootstrap before the collective allocation).
struct SharedShape {
  uint64_t symmetricBytes;
  uint32_t chunks;
  uint32_t recvBlocks;
  uint32_t sendBlocks;
  uint32_t combineBlocks;
  int32_t elastic;  // EPCOMM_ELASTIC, equal on every rank
};

// A rank's elastic words (its proposal and barrier counter) in its slot of the object's abort board.
constexpr uint64_t kElasticWordsOffset = kAbortWordOffset + 8;
static_assert(kElasticWordsOffset + 16 <= kAbortProcessOffset, "the elastic words fit before the process identity");

class NvshmemAllToAll final : public AllToAll {
 public:
  NvshmemAllToAll(const Config& config, Bootstrap& bootstrap) : config_(config), bootstrap_(bootstrap) {
    live_ = view_ = fullMask();
    device_ = pickDevice(config);
    EPCOMM_CHECK_CUDA(cudaSetDevice(device_));
    int smemMax = 0;
    EPCOMM_CHECK_CUDA(cudaDeviceGetAttribute(&smemMax, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
    geo_ = nvshmem::makeGeometry(config);
    EPCOMM_CHECK(config.worldSize <= nvshmem::kMaxRanks, kUnavailable,
                 "nvshmem backend supports at most " << nvshmem::kMaxRanks << " ranks, got " << config.worldSize);
    EPCOMM_CHECK(config.expertsPerToken <= kMaxExpertsPerToken, kInvalidConfig,
                 "nvshmem backend supports at most " << kMaxExpertsPerToken << " experts per token, got "
                                                     << config.expertsPerToken);
    const uint64_t packBytes = nvshmem::packSharedBytes(geo_.numLocalExperts, geo_.chunkRecords);
    EPCOMM_CHECK(packBytes <= static_cast<uint64_t>(smemMax), kInvalidConfig,
                 "nvshmem dispatch-send needs " << packBytes << " bytes of shared memory for " << geo_.numLocalExperts
                                                << " local experts and " << geo_.chunkRecords
                                                << " records per chunk, the device allows " << smemMax);
    EPCOMM_CHECK(nvshmem::recvSharedBytes(geo_) <= static_cast<uint64_t>(smemMax), kInvalidConfig,
                 "nvshmem dispatch-recv needs " << nvshmem::recvSharedBytes(geo_)
                                                << " bytes of shared memory for W x L row tables, the device allows "
                                                << smemMax);
    int rc = nvshmem::configureKernels(geo_);
    EPCOMM_CHECK(rc == 0, kCuda,
                 "cudaFuncSetAttribute (nvshmem kernels' shared memory) failed: "
                     << cudaGetErrorString(static_cast<cudaError_t>(rc)));

    // Everyone must ask NVSHMEM for the same symmetric size (a collective allocation).
    SharedShape mine{geo_.symmetricBytes, geo_.chunks,        geo_.recvBlocks,
                     geo_.sendBlocks,     geo_.combineBlocks, envInt("EPCOMM_ELASTIC") != 0 ? 1 : 0};
    std::vector<SharedShape> all(config.worldSize);
    bootstrap_.allGather(&mine, all.data(), sizeof(SharedShape));
    for (uint32_t r = 0; r < config.worldSize; ++r) {
      EPCOMM_CHECK(all[r].symmetricBytes == mine.symmetricBytes && all[r].chunks == mine.chunks &&
                       all[r].recvBlocks == mine.recvBlocks && all[r].sendBlocks == mine.sendBlocks &&
                       all[r].combineBlocks == mine.combineBlocks,
                   kInvalidConfig,
                   "ranks disagree on the nvshmem buffers: rank "
                       << r << " needs " << all[r].symmetricBytes << " symmetric bytes, rank " << config.rank
                       << " needs " << mine.symmetricBytes << " (every rank must use the same Config)");
      EPCOMM_CHECK(all[r].elastic == mine.elastic, kInvalidConfig,
                   "ranks disagree on EPCOMM_ELASTIC: rank " << r << " has " << all[r].elastic << ", rank "
                                                             << config.rank << " " << mine.elastic);
    }
    elastic_ = mine.elastic != 0;
    // Elastic views are 32-bit masks (the agreement's words); every rank refuses alike (the same Config).
    EPCOMM_CHECK(
        !elastic_ || config.worldSize <= 32, kUnavailable,
        "nvshmem backend: elastic ranks (EPCOMM_ELASTIC=1) support at most 32 ranks, got " << config.worldSize);

    nvshmem::acquireRuntime(bootstrap_, device_, heapBytesFor(geo_));
    acquired_ = true;
    try {
      sym_ = static_cast<char*>(nvshmem::symmetricAlloc(geo_.symmetricBytes, config.rank));
      EPCOMM_CHECK_CUDA(cudaMemset(sym_, 0, geo_.symmetricBytes));
      EPCOMM_CHECK_CUDA(cudaMalloc(&scratch_, geo_.scratchBytes));
      EPCOMM_CHECK_CUDA(cudaMemset(scratch_, 0, geo_.scratchBytes));
      // The error record lives in this rank's slot of the object's abort board, next to the abort word its peers on
      // this node set when they refuse a call (core/abort_board.hpp).
      board_.open(bootstrap_);
      EPCOMM_CHECK_CUDA(
          cudaHostRegister(board_.page(), board_.bytes(), cudaHostRegisterMapped | cudaHostRegisterPortable));
      boardRegistered_ = true;
      hostError_ = reinterpret_cast<nvshmem::ErrorRecord*>(board_.slot(config.rank));
      char* boardDev = nullptr;
      EPCOMM_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&boardDev), board_.page(), 0));
      hostErrorDev_ = reinterpret_cast<nvshmem::ErrorRecord*>(boardDev + (board_.slot(config.rank) - board_.page()));
      EPCOMM_CHECK_CUDA(cudaDeviceSynchronize());
      openElastic();
      // Nobody may put into a peer's buffers before the peer zeroed them.
      bootstrap_.barrier();
    } catch (...) {
      release();
      throw;
    }
    EPCOMM_LOG(kInfo, "nvshmem backend: device " << device_ << ", " << geo_.symmetricBytes << " symmetric bytes, "
                                                 << geo_.scratchBytes << " scratch bytes, " << config.toString());
  }

  ~NvshmemAllToAll() override { release(); }

  std::vector<int32_t> activeRanks() const override {
    std::vector<int32_t> mask(config_.worldSize);
    for (uint32_t r = 0; r < config_.worldSize; ++r) mask[r] = r >= 32 ? 1 : static_cast<int32_t>((view_ >> r) & 1u);
    return mask;
  }
  void setActiveRanks(const std::vector<int32_t>& mask) override;
  uint64_t droppedTokens() const override { return indexMask_.dropped(); }

  void dispatch(const DispatchArgs& a) override {
    checkUsable();
    // A call out of order tells no peer: they are not waiting for it (its step is not theirs).
    order_.checkDispatch(a.doSend, a.doRecv);
    const PackedDispatch* packed = nullptr;
    try {
      packed = &packedFor(
          packedDispatch_, a, [&] { packDispatch(a); }, [] {});
    } catch (const Error& e) {
      board_.raiseRefusal(a.doSend, kAbortDispatch, dispatchSends_, e);
      throw;
    }
    const PackedDispatch& p = *packed;
    checkCurrentDevice(device_, config_.rank);
    if (a.doSend && board_.raised()) board_.withdraw();  // a refusal of this step, called again with good arguments
    nvshmem::DispatchKernelArgs k = p.k;
    if (a.doSend && live_ != fullMask()) {
      indexMask_.apply(config_, live_, a.indices, k.m, nullptr, false, a.stream, false, k.indices, k.indexKind,
                       k.indexStrides);
    }
    checkLaunch(nvshmem::launchDispatch(k, a.doSend, a.doRecv, a.stream), "", config_.rank, "nvshmem dispatch kernel");
    marks_.markLaunch(static_cast<cudaStream_t>(a.stream), "", config_.rank, "nvshmem dispatch");
    if (a.doSend) {
      dispatchedM_ = p.k.m;
      ++dispatchSends_;
    }
    order_.dispatched(a.doSend, a.doRecv);
  }

  void combine(const CombineArgs& a) override {
    checkUsable();
    order_.checkCombine(a.doSend, a.doRecv);
    const PackedCombine* packed = nullptr;
    try {
      packed = &packedFor(
          packedCombine_, a, [&] { packCombine(a); }, [] {});
      if (a.doSend) {
        // The peers' combine-send reads the weights of every token this rank dispatched.
        EPCOMM_CHECK(packed->weightRows >= dispatchedM_, kInvalidArgument,
                     "rank " << config_.rank << ": combine weights have " << packed->weightRows
                             << " rows, fewer than the m = " << dispatchedM_ << " tokens this rank dispatched");
      }
    } catch (const Error& e) {
      board_.raiseRefusal(a.doSend, kAbortCombine, dispatchSends_, e);
      throw;
    }
    const PackedCombine& p = *packed;
    checkCurrentDevice(device_, config_.rank);
    if (a.doSend && board_.raised()) board_.withdraw();
    nvshmem::CombineKernelArgs k = p.k;
    if (a.doRecv && live_ != fullMask()) {
      indexMask_.apply(config_, live_, a.indices, k.m, a.boundM, true, a.stream, true, k.indices, k.indexKind,
                       k.indexStrides);
    }
    checkLaunch(nvshmem::launchCombine(k, a.doSend, a.doRecv, a.stream), "", config_.rank, "nvshmem combine kernel");
    marks_.markLaunch(static_cast<cudaStream_t>(a.stream), "", config_.rank, "nvshmem combine");
    order_.combined(a.doSend, a.doRecv);
  }

  // Waits for the streams this object launched on, up to its last launch on each (LaunchMarks), not for the device.
  void synchronize() override {
    checkUsable();
    const cudaError_t e = marks_.wait();
    EPCOMM_CHECK(e == cudaSuccess, kCuda,
                 "rank " << config_.rank << ": nvshmem kernels failed: " << cudaGetErrorString(e) << " ("
                         << static_cast<int>(e) << ")");
    checkUsable();
  }

  const Config& config() const override { return config_; }
  const char* backendName() const override { return "nvshmem"; }
  uint64_t bufferBytes() const override {
    return geo_.symmetricBytes + geo_.scratchBytes + sizeof(nvshmem::ErrorRecord);
  }

 private:
  // The last call of each kind (send half, receive half, both) and the kernel arguments it was checked and packed
  // into: an engine calls with the same buffers every step, and a repeat skips the checks and the packing.
  struct PackedDispatch {
    bool valid = false;
    DispatchArgs args;
    nvshmem::DispatchKernelArgs k{};
  };
  struct PackedCombine {
    bool valid = false;
    CombineArgs args;
    nvshmem::CombineKernelArgs k{};
    int64_t weightRows = 0;
  };

  // Checks a dispatch's arguments (its place in the call order was checked before) and packs the kernels' arguments
  // into the call kind's slot (packedFor).
  void packDispatch(const DispatchArgs& a) {
    const CheckedDispatch c = checkDispatchArgs(config_, a, MemoryKind::kCuda, device_);
    PackedDispatch& p = packedDispatch_[callSlot(a.doSend, a.doRecv)];
    p.valid = false;
    std::memset(&p.k, 0, sizeof p.k);
    nvshmem::DispatchKernelArgs& k = p.k;
    k.g = geo_;
    k.st = state();
    if (a.doSend) packDispatchSend(k, a, c, k.xScaleStrideBytes, 4);
    if (a.doRecv) packDispatchRecv(k, a, c, config_.layout, k.outScaleStrideBytes, 4);
    p.args = a;
    p.valid = true;
  }

  // The same for a combine (the weights' rows against the last dispatch are checked by the caller on every call).
  void packCombine(const CombineArgs& a) {
    const CheckedCombine c = checkCombineArgs(config_, a, MemoryKind::kCuda, device_);
    PackedCombine& p = packedCombine_[callSlot(a.doSend, a.doRecv)];
    p.valid = false;
    std::memset(&p.k, 0, sizeof p.k);
    nvshmem::CombineKernelArgs& k = p.k;
    k.g = geo_;
    k.st = state();
    if (a.doSend) {
      const TensorView& w = a.weights;
      checkSendHalfWeights(config_, w, device_, "nvshmem");
      k.y = static_cast<const uint8_t*>(a.expertY.data);
      k.yExpertStride = c.yExpertStride;
      k.yRowStride = c.yRowStride;
      k.yType = combineType(a.expertY.dtype);
      k.weights = static_cast<const float*>(w.data);
      k.weightStrides[0] = w.strides[0];
      k.weightStrides[1] = w.strides[1];
      p.weightRows = w.shape[0];
    }
    if (a.doRecv) {
      k.outType = combineType(a.outTokens.dtype);
      packCombineRecv(k, a, c);
    }
    p.args = a;
    p.valid = true;
  }

  nvshmem::DeviceState state() const {
    nvshmem::DeviceState st{};
    st.sym = sym_;
    st.scratch = static_cast<char*>(scratch_);
    st.hostError = hostErrorDev_;
    st.timeoutNs = static_cast<uint64_t>(env().timeoutMs) * 1000000ull;
    st.live = live_;
    return st;
  }

  // Frees what the constructor made. The symmetric allocation is collective (nvshmem_free synchronises the PEs): only
  // when every rank reached the barrier, so a rank whose peer is gone does not hang here (it leaks the allocation).
  // Once a rank is masked (elastic ranks) no rank frees it, nor meets on the bootstrap (whose rank 0 may be the dead
  // one): nvshmem_free needs every PE, so the symmetric buffers stay allocated until the process exits.
  void release() {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    bool together = false;
    const uint32_t W = config_.worldSize;
    if (left_ || live_ != fullMask()) {
      EPCOMM_LOG(kInfo, "rank " << config_.rank << ": nvshmem teardown with "
                                << (left_ ? std::string("this rank") : nvlink::rankSet(fullMask() & ~live_, W))
                                << " masked: the symmetric buffers stay allocated (nvshmem_free needs every PE)");
    } else {
      try {
        bootstrap_.barrier();
        together = true;
      } catch (const std::exception& e) {
        EPCOMM_LOG(kWarn, "nvshmem teardown barrier failed, the symmetric buffers stay allocated: " << e.what());
      }
    }
    if (sym_ != nullptr && together) nvshmem::symmetricFree(sym_);
    sym_ = nullptr;
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    if (boardRegistered_) cudaHostUnregister(board_.page());
    boardRegistered_ = false;
    hostError_ = nullptr;
    if (acquired_) nvshmem::releaseRuntime();
    acquired_ = false;
  }

  // Reads the host-mapped error record (no synchronisation). Once an error was seen the object refuses all use. The
  // first error of this rank's own kernels (not a peer's abort) is told to the peers, whose waits then end at once.
  void checkUsable() {
    if (failed_.empty()) {
      const volatile nvshmem::ErrorRecord* r = hostError_;
      const int32_t code = r->code;
      if (code == 0) return;
      std::atomic_thread_fence(std::memory_order_acquire);
      std::ostringstream oss;
      if (code == nvshmem::kPhasePeerAbort) {
        oss << "rank " << r->rank << ": " << board_.describe(static_cast<uint32_t>(r->peer), &failedCode_)
            << "; this rank's kernels gave their round up (phase " << phaseName(static_cast<int32_t>(r->seen))
            << ", waiting for rank " << r->wanted << "): this object cannot continue: destroy it and create a new one";
      } else if (code == nvshmem::kPhaseBadIndex || code == nvshmem::kPhaseBadIndexCombine) {
        failedCode_ = ErrorCode::kDeviceError;
        oss << "rank " << r->rank << ": expert index " << static_cast<int32_t>(r->wanted & 0xffffffff) << " at token "
            << r->seen << ", position " << (r->wanted >> 32) << " is outside [-1, " << config_.numExperts << ") (phase "
            << phaseName(code) << "); the entry was skipped";
      } else {
        failedCode_ = ErrorCode::kTimeout;
        oss << "rank " << r->rank << " timed out after " << env().timeoutMs << " ms in phase " << phaseName(code)
            << " waiting for peer rank " << r->peer << " (signal " << r->seen << ", expected round " << r->wanted;
        if (r->detail >= 0) oss << (code == nvshmem::kPhaseCombineRecv ? ", token " : ", chunk ") << r->detail;
        oss << ", block " << r->block << ")";
      }
      // A wait that timed out (here, or at the peer that gave this round up) often waited for a rank that waits
      // itself for a rank whose process is gone: that one is named as the likely cause.
      const bool badIndex = code == nvshmem::kPhaseBadIndex || code == nvshmem::kPhaseBadIndexCombine;
      failed_ = badIndex ? oss.str() : board_.blameDeadPeers(oss.str());
      if (code != nvshmem::kPhasePeerAbort && config_.worldSize > 1) {
        board_.raise(kAbortFailed, dispatchSends_, failedCode_, failed_);
      }
      if (agree_ && elastic_ && lostToPeer(code, static_cast<uint32_t>(r->peer))) recoverFromLoss();
    }
    detail::throwError(failedCode_, failed_ + " [this AllToAll object is unusable]", __FILE__, __LINE__);
  }

  uint32_t fullMask() const { return config_.worldSize >= 32 ? ~0u : (1u << config_.worldSize) - 1; }
  // Elastic ranks (below the class).
  void openElastic();
  bool lostToPeer(int32_t phase, uint32_t peer) const;
  [[noreturn]] void recoverFromLoss();
  void adoptView(uint32_t view);

  Config config_;
  Bootstrap& bootstrap_;
  int device_ = -1;
  Geometry geo_{};
  bool acquired_ = false;
  char* sym_ = nullptr;
  void* scratch_ = nullptr;
  AbortBoard board_;                           // error record and abort word of every rank of the node (host-mapped)
  bool boardRegistered_ = false;               // board_.page() is registered with CUDA (mapped)
  nvshmem::ErrorRecord* hostError_ = nullptr;  // this rank's slot of board_
  nvshmem::ErrorRecord* hostErrorDev_ = nullptr;
  /// Dispatch and combine alternate: a dispatch overwrites the peers' regions, which they may read until the combine
  /// (the round's barrier) completed.
  CallOrder order_{"nvshmem", config_.rank, false};
  uint32_t dispatchedM_ = 0;    // m of the last dispatch send half (combine's weights must cover it)
  uint32_t dispatchSends_ = 0;  // dispatch send halves launched (the round of the next one)
  cuda::LaunchMarks marks_;     // the object's outstanding work, per stream (synchronize)
  PackedDispatch packedDispatch_[3];
  PackedCombine packedCombine_[3];
  std::string failed_;
  ErrorCode failedCode_ = ErrorCode::kInternal;
  // Elastic ranks (docs/failures.md): whether EPCOMM_ELASTIC is on, the agreement over the abort board (null where a
  // rank does not share this node's board), the active ranks the kernels skip the others of (DeviceState::live) and
  // this rank's view of them (0 once it was masked), whether it left, the masked indices of a dispatch and a combine
  // (int32 [maxNumTokens][K] each, then the drop counter's two words) and the host-mapped drop count.
  bool elastic_ = false;
  std::unique_ptr<nvlink::ElasticAgreement> agree_;
  uint32_t live_ = 0xffffffffu;
  uint32_t view_ = 0xffffffffu;
  bool left_ = false;
  nvlink::IndexMask indexMask_;
};

// Elastic ranks: the words of every rank on the abort board, as on nvlink (nvlink_agree.hpp). A peer whose process
// the board sees gone leaves at once; one it cannot see (another pid namespace) is taken as alive: the timeout decides.
// The agreement needs every rank on this node's board; where one is not (NVSHMEM between nodes), EPCOMM_ELASTIC is
// refused here on every rank alike, and setActiveRanks raises `unavailable`.
void NvshmemAllToAll::openElastic() {
  const uint32_t W = config_.worldSize;
  uint8_t shared = 1;
  for (uint32_t r = 0; r < W; ++r) shared = shared && (r == config_.rank || board_.sharedWith(r));
  if (elastic_) {
    std::vector<uint8_t> all(W);
    bootstrap_.allGather(&shared, all.data(), 1);
    for (uint32_t r = 0; r < W; ++r) {
      EPCOMM_CHECK(all[r] != 0, kUnavailable,
                   "nvshmem backend: elastic ranks (EPCOMM_ELASTIC=1) need every rank on one node (the survivors "
                   "agree on the mask over the node's shared abort board), but rank "
                       << r
                       << " does not share it with every other rank; leave EPCOMM_ELASTIC unset "
                          "(docs/nvshmem.md, \"Elastic ranks\")");
    }
  }
  if (!shared || W > 32) return;  // no agreement: setActiveRanks refuses
  std::vector<uint64_t*> proposals(W), barriers(W);
  for (uint32_t r = 0; r < W; ++r) {
    proposals[r] = reinterpret_cast<uint64_t*>(board_.slot(r) + kElasticWordsOffset);
    barriers[r] = proposals[r] + 1;
  }
  agree_ = std::make_unique<nvlink::ElasticAgreement>(proposals, barriers, config_.rank, env().timeoutMs,
                                                      [this](uint32_t r) { return !board_.peerGone(r); });
}

// Whether a kernel error is a round lost to a peer that elastic ranks recover from: a wait that timed out, or a peer
// whose own kernels failed so (not one that refused its call: that rank is alive and calls again).
bool NvshmemAllToAll::lostToPeer(int32_t phase, uint32_t peer) const {
  if (phase == nvshmem::kPhaseBadIndex || phase == nvshmem::kPhaseBadIndexCombine) return false;
  if (phase != nvshmem::kPhasePeerAbort) return true;
  if (peer >= config_.worldSize) return false;
  const auto* note = reinterpret_cast<const AbortNote*>(board_.slot(peer) + kAbortNoteOffset);
  // A peer whose kernel found a bad index failed on its input, not on a lost peer: that stays fatal.
  return __atomic_load_n(&note->kind, __ATOMIC_ACQUIRE) == kAbortFailed &&
         note->code != static_cast<int32_t>(ErrorCode::kDeviceError);
}

// The round in failed_ was lost: once this rank's kernels have stopped, the active ranks agree on who goes on, every
// one resets its buffers as a new object would have them, and the call throws (the object goes on).
void NvshmemAllToAll::recoverFromLoss() {
  if (marks_.wait() != cudaSuccess) cudaGetLastError();
  const uint32_t before = live_;
  const nvlink::ElasticAgreement::Result agreed = agree_->agree(before);
  std::ostringstream oss;
  oss << failed_;
  if (agreed.view == 0) {
    left_ = true;
    view_ = 0;
    oss << "; the other ranks went on without this rank (" << agreed.maskedBy
        << "): it takes no part in the object any more [this AllToAll object is unusable]";
    failed_ = oss.str();
    detail::throwError(failedCode_, failed_, __FILE__, __LINE__);
  }
  adoptView(agreed.view);
  oss << "; the ranks agreed to go on";
  if (before & ~agreed.view) oss << " without " << nvlink::rankSet(before & ~agreed.view, config_.worldSize);
  oss << " (active: " << nvlink::rankSet(agreed.view, config_.worldSize)
      << "): this call failed and its round is lost, the object goes on (the next call is a dispatch)";
  detail::throwError(failedCode_, oss.str(), __FILE__, __LINE__);
}

// Every rank of `view` runs this after the agreement: no kernel of theirs runs (each proposed after its own stopped),
// and no put of theirs is in flight (a put-with-signal over P2P has landed when its kernel ended). This rank's
// symmetric buffers and scratch are reset to a new object's with local memsets only (no NVSHMEM call: a masked PE
// may be dead), and the active ranks meet on the board before any of them launches again (nobody puts into buffers
// that are still being reset).
void NvshmemAllToAll::adoptView(uint32_t view) {
  const uint32_t me = config_.rank;
  live_ = view_ = view;
  {
    const cuda::Stream setup = cuda::makeStream();
    EPCOMM_CHECK_CUDA(cudaMemsetAsync(sym_, 0, geo_.symmetricBytes, setup.get()));
    EPCOMM_CHECK_CUDA(cudaMemsetAsync(scratch_, 0, geo_.scratchBytes, setup.get()));
    EPCOMM_CHECK_CUDA(cudaStreamSynchronize(setup.get()));
  }
  std::memset(static_cast<void*>(hostError_), 0, sizeof(nvshmem::ErrorRecord));
  __atomic_store_n(reinterpret_cast<uint32_t*>(board_.slot(me) + kAbortWordOffset), 0u, __ATOMIC_SEQ_CST);
  board_.withdraw();
  for (auto& p : packedDispatch_) p.valid = false;
  for (auto& p : packedCombine_) p.valid = false;
  order_.reset();
  dispatchSends_ = 0;
  dispatchedM_ = 0;
  failed_.clear();
  const uint32_t missing = agree_->barrier(view);
  if (missing != 0) {
    failed_ = "rank " + std::to_string(me) + ": after agreeing on the active " +
              nvlink::rankSet(view, config_.worldSize) + ", " + nvlink::rankSet(missing, config_.worldSize) +
              " did not reset in time";
    failedCode_ = ErrorCode::kTimeout;
    detail::throwError(failedCode_, failed_ + " [this AllToAll object is unusable]", __FILE__, __LINE__);
  }
}

void NvshmemAllToAll::setActiveRanks(const std::vector<int32_t>& mask) {
  checkUsable();
  const uint32_t W = config_.worldSize, me = config_.rank;
  EPCOMM_CHECK(agree_ != nullptr, kUnavailable,
               "nvshmem rank " << me
                               << ": setActiveRanks needs every rank on this node's shared abort board (at most 32 "
                                  "ranks, POSIX shared memory): the survivors agree on the mask there, and NVSHMEM's "
                                  "own collectives cannot run once a PE is masked");
  EPCOMM_CHECK(order_.state() == CallOrder::State::kIdle, kInvalidArgument,
               "nvshmem rank " << me << ": setActiveRanks while the object is '" << CallOrder::name(order_.state())
                               << "' (call it between rounds)");
  const uint32_t want = nvlink::requestedView(mask, W, live_);
  if (marks_.wait() != cudaSuccess) cudaGetLastError();
  checkUsable();
  if (!((want >> me) & 1u)) {
    // This rank leaves: the others adopt the mask and meet; then nothing of theirs puts into its buffers.
    const uint32_t missing = agree_->leave(want & live_, agree_->nextBarrier());
    if (missing != 0) {
      EPCOMM_LOG(kWarn, "nvshmem rank " << me << ": leaving, no answer from " << nvlink::rankSet(missing, W));
    }
    left_ = true;
    view_ = want & live_;
    failedCode_ = ErrorCode::kInvalidArgument;
    failed_ = "nvshmem rank " + std::to_string(me) +
              ": this rank left the object (setActiveRanks masked it) and takes no part in its rounds";
    return;
  }
  const nvlink::ElasticAgreement::Result agreed = agree_->agree(want & live_);
  if (agreed.view == 0) {
    left_ = true;
    view_ = 0;
    failedCode_ = ErrorCode::kPeerFailure;
    failed_ = "nvshmem rank " + std::to_string(me) + ": setActiveRanks: the other ranks went on without this rank (" +
              agreed.maskedBy + ")";
    detail::throwError(failedCode_, failed_, __FILE__, __LINE__);
  }
  const uint32_t lost = want & live_ & ~agreed.view;
  adoptView(agreed.view);
  EPCOMM_CHECK(lost == 0 || elastic_, kTimeout,
               "nvshmem rank " << me << ": setActiveRanks: " << nvlink::rankSet(lost, W)
                               << " did not answer within EPCOMM_TIMEOUT_MS and was masked too (active: "
                               << nvlink::rankSet(agreed.view, W) << ")");
}

}  // namespace

bool nvshmemUsable(std::string* whyNot) { return cudaDeviceSeen(whyNot) && nvshmem::runtimeUsable(whyNot); }

std::unique_ptr<AllToAll> createNvshmem(const Config& config, Bootstrap& bootstrap) {
  return std::make_unique<NvshmemAllToAll>(config, bootstrap);
}

std::vector<PlannedBuffer> planNvshmem(const Config& config) {
  config.validate();
  const Geometry g = nvshmem::makeGeometry(config);
  const std::string W = std::to_string(config.worldSize), T = std::to_string(config.maxNumTokens),
                    Ts = std::to_string(g.slotsPerSender), K = std::to_string(config.expertsPerToken),
                    H = std::to_string(config.hiddenDim);
  std::vector<PlannedBuffer> plan;
  auto add = [&](const char* name, const char* memory, uint64_t bytes, const std::string& note) {
    plan.push_back(PlannedBuffer{"nvshmem", name, memory, bytes, note});
  };
  const char* sym = "device (symmetric)";
  add("signals", sym, g.offDispRecv - g.offDispSig,
      "u64 dispatch [W=" + W + "][C=" + std::to_string(g.chunks) + "], weights [W], done [W], combine [W][T=" + T +
          "][P=" + std::to_string(g.pieces) + " pieces of H]");
  add("dispatch receive", sym, g.offWeightRecv - g.offDispRecv,
      "[W][header + Ts=" + Ts + " x " + std::to_string(g.recordBytes) + " B records (payload, scales, routing)]");
  add("combine weights", sym, g.offCombRecv - g.offWeightRecv, "f32 [W][Ts][K=" + K + "]");
  add("combine partials", sym, g.offDispStage - g.offCombRecv, "f32 [W][T][H=" + H + "]");
  add("dispatch staging", sym, g.offWeightStage - g.offDispStage, "[W][header + Ts records]: the puts' source");
  add("weights staging", sym, g.offCombStage - g.offWeightStage, "f32 [W][Ts][K]: a put's source per destination");
  add("partials staging", sym, g.symmetricBytes - g.offCombStage, "f32 [W][Ts][H]: the puts' source");
  add("rows of received entries", "device", g.offSeq - g.offRows, "int2 [W][Ts][K] for the combine");
  add("round counters", "device", g.scratchBytes - g.offSeq, "u64 per work slot of each phase, and a few words");
  add("error record", "host shared (mapped)", kAbortSlotBytes,
      "written by kernels, read by the host; the abort word peers set (one slot of the node's abort board)");
  add("NVSHMEM heap (first object)", "device (symmetric)", 0,
      "NVSHMEM_SYMMETRIC_SIZE=" + std::to_string(heapBytesFor(g)) +
          " unless set: 2 x the symmetric buffers + 256 MiB, at least 1 GiB (not counted above)");
  return plan;
}

}  // namespace backends
}  // namespace epcomm
