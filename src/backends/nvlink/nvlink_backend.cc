// The nvlink backend: one cudaMalloc'd region per rank, shared with the other ranks of the node through CUDA IPC
// handles exchanged over the bootstrap (no extra privileges), and kernels that store straight into the peers'
// regions. See docs/nvlink.md.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "backends/backends.hpp"
#include "backends/nvlink/nvlink_agree.hpp"
#include "backends/nvlink/nvlink_cuda.hpp"
#include "backends/nvlink/nvlink_index_mask.hpp"
#include "backends/nvlink/nvlink_kernels.hpp"
#include "backends/nvlink/nvlink_launch.hpp"
#include "backends/nvlink/nvlink_layout.hpp"
#include "backends/nvlink/nvlink_peer_mapping.hpp"
#include "backends/nvlink/nvlink_trace.hpp"
#include "core/abort_board.hpp"
#include "core/call_order.hpp"
#include "core/env.hpp"
#include "core/kernel_args.hpp"
#include "core/log.hpp"
#include "core/validate.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace backends {

namespace {

using nvlink::Geometry;
using nvlink::PeerMapping;

// Tokens of one call of `c` on one rank at most (every dp group's): what the block shape follows.
uint64_t batchTokens(const Config& c) { return static_cast<uint64_t>(c.maxNumTokens) * c.numDpGroups(); }

// Threads per block: 256 when batchTokens is at most 256 (kSmallThreads), else 512 (kMaxThreads);
// EPCOMM_NVLINK_THREADS overrides. With 256 a kernel takes twice the blocks of half the size: the same warps and
// registers, spread over every SM instead of half of them (2x H200, decode T = 128: dispatch and combine ~0.5 us
// faster, docs/nvlink.md). Larger batches keep 512: a routing block of 8 warps scans 256 tokens per pass, and
// T = 512 needed two routing blocks that wait for each other (+6 us).
uint32_t chooseThreads(const Config& c) {
  const int t = env().nvlinkThreads;
  EPCOMM_CHECK(t == 0 || t == static_cast<int>(nvlink::kSmallThreads) || t == static_cast<int>(nvlink::kMaxThreads),
               kInvalidConfig, "EPCOMM_NVLINK_THREADS must be 0 (automatic), 256 or 512, not " << t);
  if (t != 0) return static_cast<uint32_t>(t);
  return batchTokens(c) <= nvlink::kSmallThreads ? nvlink::kSmallThreads : nvlink::kMaxThreads;
}

// Blocks per kernel. NOTE: all ranks must agree (a receiver counts B signals per sender per round); the value is
// checked across ranks at setup. Even decode moves megabytes through HBM on the receiver (expansion ~7.6 MB of
// writes, combine-send ~15 MB of expertY reads) and one SM keeps too few loads in flight to move more than a few tens
// of GB/s, so more SMs help; the flags are counters, so more blocks cost only more increments (one per block).
// But a fused kernel needs all its blocks co-resident (512 threads x ~110 registers fill an SM's registers, 256 half
// of them), and two objects in flight on two streams need the sum of their blocks to fit or they can wait on each
// other until the timeout: small batches (<= 512 tokens) therefore take half of what fits, large ones all of it.
// `slots`: the blocks of `threads` threads that fit the GPU at once. docs/nvlink.md has the sweep.
uint32_t chooseBlocks(const Config& c, int smCount, uint32_t threads) {
  const int slots = smCount * static_cast<int>(nvlink::kMaxThreads / threads);
  if (env().nvlinkBlocks > 0) return static_cast<uint32_t>(std::min(env().nvlinkBlocks, slots));
  const int b = batchTokens(c) <= 512 ? slots / 2 : slots;
  return static_cast<uint32_t>(std::max(1, b));
}

// The geometry of `config` on a GPU of `smCount` SMs, with the environment's overrides.
Geometry geometryFor(const Config& config, int smCount) {
  const uint32_t threads = chooseThreads(config);
  return nvlink::makeGeometry(config, chooseBlocks(config, smCount, threads), threads);
}

// Raises the kernels' dynamic shared-memory limit to at least `bytes`, never lowering it. The limit is a property of
// each kernel function in the process, not of an object: an object of fewer experts created while one of more experts
// is alive must not take the larger object's limit away (its next launch would fail with "invalid argument").
int raiseSharedMemoryLimit(uint32_t bytes) {
  static std::mutex mu;
  static uint32_t configured = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (bytes <= configured) return 0;
  const int rc = nvlink::configureKernels(bytes);
  if (rc == 0) configured = bytes;
  return rc;
}

const char* phaseName(int32_t phase) {
  switch (phase) {
    case nvlink::kPhaseDispatchRecv:
      return "dispatch-recv (waiting for the peer's tokens)";
    case nvlink::kPhaseCombineEnter:
      return "combine-send (waiting for the peer to enter combine: its router weights)";
    case nvlink::kPhaseCombineRecv:
      return "combine-recv (waiting for the peer's expert outputs)";
    case nvlink::kPhaseBadIndex:
      return "dispatch-send (expert index check)";
    case nvlink::kPhaseRouteSync:
      return "dispatch-send (routing blocks of this rank waiting for each other)";
    case nvlink::kPhasePeerAbort:
      return "aborted by a peer";
    default:
      return "unknown";
  }
}

/// What each rank publishes at setup: where it runs, its region's IPC handle, and what every rank must agree on.
struct PeerInfo {
  char host[64];
  cudaIpcMemHandle_t handle;
  uint32_t blocks;
  uint32_t threads;
  int32_t device;
  uint64_t bytes;
  int32_t elastic;  // EPCOMM_ELASTIC, equal on every rank
};

// Where a rank's elastic words live in its slot of the abort board: between its abort word and its process identity.
constexpr uint64_t kElasticWordsOffset = kAbortWordOffset + 8;
static_assert(kElasticWordsOffset + 16 <= kAbortProcessOffset, "the elastic words fit before the process identity");

class NvlinkAllToAll final : public AllToAll {
 public:
  // Every CUDA resource lands in an owner (nvlink_cuda.hpp) as soon as it exists: when a step throws (a peer that
  // never joins the exchange, a disagreement), the members built so far release everything.
  NvlinkAllToAll(const Config& config, Bootstrap& bootstrap) : config_(config), bootstrap_(bootstrap) {
    device_ = pickDevice(config);
    EPCOMM_CHECK_CUDA(cudaSetDevice(device_));
    int sms = 0;
    EPCOMM_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    geo_ = geometryFor(config, sms);
    const uint32_t W = config.worldSize;
    EPCOMM_CHECK(W <= nvlink::kMaxRanks, kUnavailable,
                 "nvlink backend supports at most " << nvlink::kMaxRanks << " ranks, got " << W);
    EPCOMM_CHECK(nvlink::fitsTaggedEntries(geo_), kUnavailable,
                 "nvlink backend supports at most 65536 tokens per rank and DP group (maxNumTokens / dpSize = "
                     << geo_.slotsPerSender << ") and fewer than 32767 experts per rank (" << geo_.numLocalExperts
                     << ")");
    const uint32_t smem = nvlink::sharedBytes(geo_);
    int smemMax = 0;
    EPCOMM_CHECK_CUDA(cudaDeviceGetAttribute(&smemMax, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
    EPCOMM_CHECK(smem <= static_cast<uint32_t>(smemMax), kInvalidConfig,
                 "nvlink kernels would need " << smem << " bytes of shared memory (numExperts = " << config.numExperts
                                              << "), the device allows " << smemMax);
    int rc = raiseSharedMemoryLimit(smem);
    EPCOMM_CHECK(rc == 0, kCuda,
                 "cudaFuncSetAttribute(max dynamic shared memory "
                     << smem << ") failed: " << cudaGetErrorString(static_cast<cudaError_t>(rc)));

    region_ = nvlink::allocDevice(geo_.totalBytes);
    seq_ = nvlink::allocDevice(nvlink::roundCounterBytes(geo_));
    route_ = nvlink::allocDevice(nvlink::routeScratchBytes(geo_));
    rowSlots_ = nvlink::allocDevice(nvlink::rowSlotBytes(geo_));
    // The error record lives in this rank's slot of the object's abort board, next to the abort word its peers set
    // when they refuse a call (core/abort_board.hpp).
    board_.open(bootstrap_);
    boardMapping_ = nvlink::registerMapped(board_.page(), board_.bytes());
    hostError_ = reinterpret_cast<nvlink::ErrorRecord*>(board_.slot(config.rank));
    char* boardDev = nullptr;
    EPCOMM_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&boardDev), board_.page(), 0));
    hostErrorDev_ = reinterpret_cast<nvlink::ErrorRecord*>(boardDev + (board_.slot(config.rank) - board_.page()));
    {
      // Zeroed on a stream of the setup's own, which is all it waits for (not the rest of the device).
      const nvlink::Stream setup = nvlink::makeStream();
      if (env().nvlinkTrace != 0) trace_.enable(geo_.blocks, env().nvlinkTrace >= 2, setup.get());
      EPCOMM_CHECK_CUDA(cudaMemsetAsync(region_.get(), 0, geo_.totalBytes, setup.get()));
      EPCOMM_CHECK_CUDA(cudaMemsetAsync(seq_.get(), 0, nvlink::roundCounterBytes(geo_), setup.get()));
      EPCOMM_CHECK_CUDA(cudaMemsetAsync(route_.get(), 0, nvlink::routeScratchBytes(geo_), setup.get()));
      // Every word kNoRowSlot.
      EPCOMM_CHECK_CUDA(cudaMemsetAsync(rowSlots_.get(), 0xff, nvlink::rowSlotBytes(geo_), setup.get()));
      EPCOMM_CHECK_CUDA(cudaStreamSynchronize(setup.get()));
    }

    PeerInfo mine{};
    gethostname(mine.host, sizeof(mine.host) - 1);
    mine.blocks = geo_.blocks;
    mine.threads = geo_.threads;
    mine.device = device_;
    mine.bytes = geo_.totalBytes;
    mine.elastic = envInt("EPCOMM_ELASTIC") != 0 ? 1 : 0;
    EPCOMM_CHECK_CUDA(cudaIpcGetMemHandle(&mine.handle, region_.get()));
    std::vector<PeerInfo> all(W);
    bootstrap_.allGather(&mine, all.data(), sizeof(PeerInfo));
    const uint32_t me = config.rank;
    for (uint32_t r = 0; r < W; ++r) {
      EPCOMM_CHECK(std::strncmp(all[r].host, mine.host, sizeof(mine.host)) == 0, kUnavailable,
                   "nvlink backend needs every rank on one node: rank "
                       << r << " runs on '" << all[r].host << "', rank " << me << " on '" << mine.host << "'");
      // The knobs that shape the protocol (a receiver counts B signals per sender; blocks x threads set the scan
      // tables and the work split) must be equal on every rank.
      EPCOMM_CHECK(
          all[r].blocks == geo_.blocks, kInvalidConfig,
          "ranks disagree on nvlink blocks per kernel (EPCOMM_NVLINK_BLOCKS, or GPUs of different SM counts): rank "
              << r << " uses " << all[r].blocks << ", rank " << me << " uses " << geo_.blocks);
      EPCOMM_CHECK(
          all[r].threads == geo_.threads, kInvalidConfig,
          "ranks disagree on nvlink threads per block (EPCOMM_NVLINK_THREADS, or maxNumTokens x dp groups on either "
          "side of 256): rank "
              << r << " uses " << all[r].threads << ", rank " << me << " uses " << geo_.threads);
      EPCOMM_CHECK(all[r].bytes == geo_.totalBytes, kInvalidConfig,
                   "ranks disagree on the nvlink buffer size (their configs differ): rank "
                       << r << " has " << all[r].bytes << " bytes, rank " << me << " " << geo_.totalBytes);
      EPCOMM_CHECK(all[r].elastic == mine.elastic, kInvalidConfig,
                   "ranks disagree on EPCOMM_ELASTIC: rank " << r << " has " << all[r].elastic << ", rank " << me << " "
                                                             << mine.elastic);
    }
    openElastic(mine.elastic != 0);
    peers_.assign(nvlink::kMaxRanks, nullptr);
    peers_[me] = static_cast<char*>(region_.get());
    for (uint32_t r = 0; r < W; ++r) {
      if (r == me) continue;
      if (all[r].device != device_) {
        int can = 0;
        EPCOMM_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, device_, all[r].device));
        EPCOMM_CHECK(can != 0, kUnavailable,
                     "GPU " << device_ << " cannot access peer GPU " << all[r].device << " of rank " << r);
      }
      peerMaps_.push_back(PeerMapping::open(all[r].handle, me, r));
      peers_[r] = peerMaps_.back().get();
    }
    // Nobody may store into a peer's region before the peer zeroed it (done above, before the allGather) and
    // every rank has mapped every other one.
    bootstrap_.barrier();
    launches_ = std::make_unique<nvlink::GraphLaunchCache>(env().nvlinkGraphLaunch && !trace_.enabled());
    EPCOMM_LOG(kInfo, "nvlink backend: device " << device_ << ", " << geo_.blocks << " blocks, " << geo_.totalBytes
                                                << " bytes peer-mapped, " << config.toString());
  }

  // Teardown in two steps, each closed by a barrier of every rank:
  // 1. This object's own work ends (LaunchMarks), then the barrier: no rank's kernel stores into a region any more.
  // 2. Every rank unmaps the peers' regions, then the barrier: no rank has this rank's region mapped any more, and only
  //    then the members free it. CUDA leaves freeing exported memory before its importers closed their mappings
  //    undefined; with one barrier, an exporter could free (and allocate again, for its next object) while a peer still
  //    had the old region mapped.
  // When a barrier fails (a peer is gone) the rest goes on without it: a dead process's mappings died with it.
  // Work of this object captured into a caller's CUDA graph is the caller's to finish first (the launches of a graph
  // are not the object's to see); the graph executable itself may be destroyed before or after the object.
  ~NvlinkAllToAll() override {
    cudaSetDevice(device_);
    if (marks_.wait() != cudaSuccess) cudaGetLastError();
    launches_.reset();
    if (trace_.enabled()) std::fputs(trace_.summary(static_cast<int>(config_.rank)).c_str(), stderr);
    bool together = teardownBarrier("after the last kernels");
    for (PeerMapping& m : peerMaps_) {
      if (!m.get()) continue;
      const cudaError_t e = m.reset();
      if (e != cudaSuccess) {
        EPCOMM_LOG(kWarn, "rank " << config_.rank
                                  << ": cudaIpcCloseMemHandle of a peer's region failed: " << cudaGetErrorString(e));
      }
    }
    if (together) teardownBarrier("after unmapping the peers' regions");
  }

  std::vector<int32_t> activeRanks() const override {
    std::vector<int32_t> mask(config_.worldSize);
    for (uint32_t r = 0; r < config_.worldSize; ++r) mask[r] = static_cast<int32_t>((view_ >> r) & 1u);
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
    if (a.doSend) {
      if (board_.raised()) board_.withdraw();  // a refusal of this step, called again with good arguments
      dispatchedM_ = p.m;
    }
    nvlink::DispatchKernelArgs k = p.k;
    checkCurrentDevice(device_, config_.rank);
    if (a.doSend && geo_.live != fullMask()) {
      indexMask_.apply(config_, geo_.live, a.indices, p.m, nullptr, false, a.stream, false, k.indices, k.indexKind,
                       k.indexStrides);
    }
    k.st.trace = trace_.next(nvlink::PhaseTrace::kDispatch, a.doSend, a.doRecv);
    launch(nvlink::dispatchLaunch(k, a.doSend, a.doRecv), &k, sizeof k, a.stream, "dispatch",
           [&] { order_.dispatched(a.doSend, a.doRecv); });
    if (a.doSend) ++dispatchSends_;
  }

  void combine(const CombineArgs& a) override {
    checkUsable();
    order_.checkCombine(a.doSend, a.doRecv);
    const PackedCombine* packed = nullptr;
    try {
      packed = &packedFor(
          packedCombine_, a, [&] { packCombine(a); }, [] {});
      if (a.doSend) {
        // The peers wait for the weights of every token this rank dispatched (tagged words, no flag): fewer rows would
        // leave them waiting until the timeout.
        EPCOMM_CHECK(packed->k.mSend >= dispatchedM_, kInvalidArgument,
                     "rank " << config_.rank << ": combine weights have " << packed->k.mSend
                             << " rows, fewer than the m = " << dispatchedM_ << " tokens this rank dispatched");
      }
    } catch (const Error& e) {
      board_.raiseRefusal(a.doSend, kAbortCombine, dispatchSends_, e);
      throw;
    }
    const PackedCombine& p = *packed;
    if (a.doSend && board_.raised()) board_.withdraw();
    nvlink::CombineKernelArgs k = p.k;
    checkCurrentDevice(device_, config_.rank);
    if (a.doRecv && geo_.live != fullMask()) {
      indexMask_.apply(config_, geo_.live, a.indices, k.m, a.boundM, true, a.stream, true, k.indices, k.indexKind,
                       k.indexStrides);
    }
    k.st.trace = trace_.next(nvlink::PhaseTrace::kCombine, a.doSend, a.doRecv);
    launch(nvlink::combineLaunch(k, a.doSend, a.doRecv, p.sendType, p.recvType), &k, sizeof k, a.stream, "combine",
           [&] { order_.combined(a.doSend, a.doRecv); });
  }

  // Waits for the streams this object launched on, up to its last launch on each (LaunchMarks), not for the device.
  void synchronize() override {
    checkUsable();
    const cudaError_t e = marks_.wait();
    EPCOMM_CHECK(e == cudaSuccess, kCuda,
                 "rank " << config_.rank << ": nvlink kernels failed: " << cudaGetErrorString(e) << " ("
                         << static_cast<int>(e) << ")");
    checkUsable();
  }

  const Config& config() const override { return config_; }
  const char* backendName() const override { return "nvlink"; }
  uint64_t bufferBytes() const override {
    return geo_.totalBytes + nvlink::roundCounterBytes(geo_) + nvlink::routeScratchBytes(geo_) +
           nvlink::rowSlotBytes(geo_) + sizeof(nvlink::ErrorRecord);
  }

 private:
  // One teardown barrier; false (logged) when it failed, e.g. because a peer is gone.
  bool teardownBarrier(const char* when) {
    if (left_) return false;  // the ranks that stay unmapped this rank's region when it left; they wait for nothing
    if (geo_.live != fullMask()) {
      // Ranks are masked: the bootstrap may have lost its rank 0; the active ranks meet on the abort board.
      const uint32_t missing = agree_ ? agree_->barrier(geo_.live) : 0;
      if (missing == 0) return true;
      EPCOMM_LOG(kWarn, "rank " << config_.rank << ": nvlink teardown barrier " << when << ": no answer from "
                                << nvlink::rankSet(missing, config_.worldSize));
      return false;
    }
    try {
      bootstrap_.barrier();
      return true;
    } catch (const std::exception& e) {
      EPCOMM_LOG(kWarn, "rank " << config_.rank << ": nvlink teardown barrier " << when << " failed: " << e.what());
      return false;
    }
  }

  // Launches kernel `l` with the `bytes` bytes at `args` on `stream` (through the launch cache), runs `launched` (the
  // call order's step) once it is on the stream, and marks the launch for synchronize() unless the stream is capturing
  // a graph. Throws Error(kCuda) naming `what` when the launch or its mark fails.
  template <typename Launched>
  void launch(const nvlink::KernelLaunch& l, const void* args, size_t bytes, void* stream, const char* what,
              Launched launched) {
    const auto s = static_cast<cudaStream_t>(stream);
    const int rc = launches_->launch(l, args, bytes, s);
    EPCOMM_CHECK(rc == 0, kCuda,
                 "rank " << config_.rank << ": " << what
                         << " kernel launch failed: " << cudaGetErrorString(static_cast<cudaError_t>(rc)));
    launched();
    marks_.markLaunch(s, "", config_.rank, what);
  }

  // Checks a dispatch call's arguments (its place in the call order was checked before) and packs them into the
  // kernel's, kept in the call kind's slot.
  void packDispatch(const DispatchArgs& a) {
    const CheckedDispatch c = checkDispatchArgs(config_, a, MemoryKind::kCuda, device_, /*appliesCast=*/true);
    PackedDispatch& p = packedDispatch_[callSlot(a.doSend, a.doRecv)];
    p.valid = false;
    nvlink::DispatchKernelArgs& k = p.k;
    std::memset(&k, 0, sizeof k);  // padding too: the launch cache compares the bytes
    fillCommon(k.g, k.peers, k.st);
    k.cast = static_cast<uint32_t>(config_.dispatchCast);
    if (a.doSend) packDispatchSend(k, a, c, k.xScaleStrideBytes, 4);
    if (a.doRecv) {
      packDispatchRecv(k, a, c, config_.layout, k.outScaleStrideBytes, 4);
      k.packed = config_.layout == Layout::kPacked ? 1 : 0;
      k.padding = config_.expertPadding;
    }
    p.m = c.m;
    p.args = a;
    p.valid = true;
  }

  // The same for a combine call (the check of the weights' rows against the last dispatch is the caller's: it
  // depends on that dispatch, not on these arguments).
  void packCombine(const CombineArgs& a) {
    const CheckedCombine c = checkCombineArgs(config_, a, MemoryKind::kCuda, device_);
    PackedCombine& p = packedCombine_[callSlot(a.doSend, a.doRecv)];
    p.valid = false;
    nvlink::CombineKernelArgs& k = p.k;
    std::memset(&k, 0, sizeof k);  // padding too: the launch cache compares the bytes
    fillCommon(k.g, k.peers, k.st);
    if (a.doSend) {
      const TensorView& w = a.weights;
      checkSendHalfWeights(config_, w, device_, "nvlink");
      k.y = static_cast<const uint8_t*>(a.expertY.data);
      k.yExpertStride = c.yExpertStride;
      k.yRowStride = c.yRowStride;
      k.weights = static_cast<const float*>(w.data);
      k.weightStrides[0] = w.strides[0];
      k.weightStrides[1] = w.strides[1];
      k.mSend = static_cast<uint32_t>(w.shape[0]);
      p.sendType = combineType(a.expertY.dtype);
    }
    k.boundM = a.boundM;
    k.packed = config_.layout == Layout::kPacked ? 1 : 0;
    k.padding = config_.expertPadding;
    if (a.doRecv) {
      packCombineRecv(k, a, c);
      p.recvType = combineType(a.outTokens.dtype);
    }
    p.args = a;
    p.valid = true;
  }

  void fillCommon(Geometry& g, char** peers, nvlink::DeviceState& st) const {
    g = geo_;
    for (uint32_t r = 0; r < nvlink::kMaxRanks; ++r) peers[r] = peers_[r];
    // Round counters u32 [4][B], then the error claim and the work queues (roundCounterBytes).
    st.seq = static_cast<uint32_t*>(seq_.get());
    char* counterTail = static_cast<char*>(seq_.get()) + 4 * geo_.blocks * sizeof(uint32_t);
    st.claimed = reinterpret_cast<int32_t*>(counterTail);
    st.queues = reinterpret_cast<uint32_t*>(counterTail + nvlink::kQueueOffset);
    st.routeArrived = static_cast<uint64_t*>(route_.get());
    st.routeScratch = reinterpret_cast<int32_t*>(static_cast<char*>(route_.get()) + 256);
    st.rowSlots = static_cast<uint64_t*>(rowSlots_.get());
    st.hostError = hostErrorDev_;
    st.timeoutNs = static_cast<uint64_t>(env().timeoutMs) * 1000000ull;
    st.trace = nullptr;
  }

  // Reads the host-mapped error record (no synchronisation). Once an error was seen the object refuses all use. The
  // first error of this rank's own kernels (not a peer's abort) is told to the peers, whose waits then end at once.
  void checkUsable() {
    if (failed_.empty()) {
      const volatile nvlink::ErrorRecord* r = hostError_;
      const int32_t code = r->code;
      if (code == 0) return;
      std::atomic_thread_fence(std::memory_order_acquire);
      std::ostringstream oss;
      if (code == nvlink::kPhasePeerAbort) {
        oss << "rank " << r->rank << ": " << board_.describe(static_cast<uint32_t>(r->peer), &failedCode_)
            << "; this rank's kernels gave their round up (phase " << phaseName(static_cast<int32_t>(r->a))
            << ", waiting for rank " << r->b << "): this object cannot continue: destroy it and create a new one";
      } else if (code == nvlink::kPhaseBadIndex) {
        failedCode_ = ErrorCode::kDeviceError;
        oss << "rank " << r->rank << ": expert index " << static_cast<int32_t>(r->b & 0xffffffff) << " at token "
            << r->a << ", position " << (r->b >> 32) << " is outside [-1, " << config_.numExperts << ") (phase "
            << phaseName(code) << "); the entry was skipped";
      } else {
        failedCode_ = ErrorCode::kTimeout;
        oss << "rank " << r->rank << " timed out after " << env().timeoutMs << " ms in phase " << phaseName(code)
            << " waiting for peer rank " << r->peer << " (flag " << r->a << ", expected " << r->b << ", block "
            << r->block << ")";
      }
      // A wait that timed out (here, or at the peer that gave this round up) often waited for a rank that waits
      // itself for a rank whose process is gone: that one is named as the likely cause.
      const bool badIndex = code == nvlink::kPhaseBadIndex;
      failed_ = badIndex ? oss.str() : board_.blameDeadPeers(oss.str());
      if (code != nvlink::kPhasePeerAbort && config_.worldSize > 1) {
        board_.raise(kAbortFailed, dispatchSends_, failedCode_, failed_);
      }
      if (agree_ && elastic_ && lostToPeer(code, static_cast<uint32_t>(r->peer))) recoverFromLoss();
    }
    detail::throwError(failedCode_, failed_ + " [this AllToAll object is unusable]", __FILE__, __LINE__);
  }

  uint32_t fullMask() const { return config_.worldSize >= 32 ? ~0u : (1u << config_.worldSize) - 1; }
  // Elastic ranks (nvlink_elastic.cc).
  void openElastic(bool elastic);
  bool lostToPeer(int32_t phase, uint32_t peer) const;
  [[noreturn]] void recoverFromLoss();
  void adoptView(uint32_t view);

  Config config_;
  Bootstrap& bootstrap_;
  int device_ = -1;
  Geometry geo_{};
  nvlink::DeviceMemory region_;               // this rank's peer-mapped region (Geometry)
  nvlink::DeviceMemory seq_;                  // round counters, error claim, work queues (roundCounterBytes)
  nvlink::DeviceMemory route_;                // routing blocks' arrival counter and histograms (routeScratchBytes)
  nvlink::DeviceMemory rowSlots_;             // DeviceState::rowSlots
  AbortBoard board_;                          // error record and abort word of every rank of the node (host-mapped)
  nvlink::HostRegistration boardMapping_;     // board_.page() registered with CUDA, mapped
  nvlink::ErrorRecord* hostError_ = nullptr;  // this rank's slot of board_
  nvlink::ErrorRecord* hostErrorDev_ = nullptr;
  std::vector<PeerMapping> peerMaps_;  // the other ranks' regions, mapped here
  std::vector<char*> peers_;           // every rank's region by rank (kMaxRanks entries; ours is region_)
  /// Dispatch and combine alternate. A dispatch may not repeat without a combine: its send half would overwrite the
  /// peers' staging and routes while they may still be reading the last round's (the combine is the barrier).
  CallOrder order_{"nvlink", config_.rank, false};
  uint32_t dispatchedM_ = 0;    // m of the last dispatch send half (combine's weights must cover it)
  uint32_t dispatchSends_ = 0;  // dispatch send halves launched (the round of the next one)
  /// The last call of each kind (callSlot) and what its arguments were checked and packed into: an engine calls with
  /// the same buffers every step, and a repeat then skips the checks and the packing (host time inside an eager
  /// call, which delays the kernel's start: docs/nvlink.md).
  struct PackedDispatch {
    bool valid = false;
    DispatchArgs args;
    nvlink::DispatchKernelArgs k{};
    uint32_t m = 0;
  };
  struct PackedCombine {
    bool valid = false;
    CombineArgs args;
    nvlink::CombineKernelArgs k{};
    int sendType = -1;  // the send half's input type (combineType of expertY; the partials are fp32)
    int recvType = -1;  // the receive half's output type
  };
  PackedDispatch packedDispatch_[3];
  PackedCombine packedCombine_[3];
  nvlink::PhaseTrace trace_;
  /// Eager launches through cached graphs (EPCOMM_NVLINK_GRAPH_LAUNCH; off while tracing: the trace slot changes the
  /// arguments every call).
  std::unique_ptr<nvlink::GraphLaunchCache> launches_;
  nvlink::LaunchMarks marks_;  // the object's outstanding work, per stream (synchronize, destructor)
  std::string failed_;
  ErrorCode failedCode_ = ErrorCode::kInternal;
  // Elastic ranks (docs/failures.md): the agreement over the abort board, this rank's view of the active ranks
  // (geo_.live while it takes part), whether it left, the masked indices of a dispatch and a combine (int32
  // [maxNumTokens][K] each, then the drop counter's two words) and the host-mapped drop count.
  bool elastic_ = false;
  std::unique_ptr<nvlink::ElasticAgreement> agree_;
  uint32_t view_ = 0;
  bool left_ = false;
  nvlink::IndexMask indexMask_;
};

// Elastic ranks: the words of every rank on the abort board. A peer whose process the board sees gone leaves at once;
// one it cannot see (another pid namespace) is taken as alive: the timeout decides.
void NvlinkAllToAll::openElastic(bool elastic) {
  const uint32_t W = config_.worldSize;
  elastic_ = elastic;
  view_ = geo_.live;
  std::vector<uint64_t*> proposals(W), barriers(W);
  for (uint32_t r = 0; r < W; ++r) {
    if (r != config_.rank && !board_.sharedWith(r)) return;  // no shared page: no agreement (setActiveRanks refuses)
    proposals[r] = reinterpret_cast<uint64_t*>(board_.slot(r) + kElasticWordsOffset);
    barriers[r] = proposals[r] + 1;
  }
  agree_ = std::make_unique<nvlink::ElasticAgreement>(proposals, barriers, config_.rank, env().timeoutMs,
                                                      [this](uint32_t r) { return !board_.peerGone(r); });
}

// Whether a kernel error is a round lost to a peer that elastic ranks recover from: a wait that timed out, or a peer
// whose own kernels failed (not one that refused its call: that rank is alive and calls again).
bool NvlinkAllToAll::lostToPeer(int32_t phase, uint32_t peer) const {
  if (phase == nvlink::kPhaseBadIndex) return false;
  if (phase != nvlink::kPhasePeerAbort) return true;
  if (peer >= config_.worldSize) return false;
  const auto* note = reinterpret_cast<const AbortNote*>(board_.slot(peer) + kAbortNoteOffset);
  // A peer whose kernel found a bad index failed on its input, not on a lost peer: that stays fatal.
  return __atomic_load_n(&note->kind, __ATOMIC_ACQUIRE) == kAbortFailed &&
         note->code != static_cast<int32_t>(ErrorCode::kDeviceError);
}

// The round in failed_ was lost: once this rank's kernels have stopped, the active ranks agree on who goes on, every
// one resets its buffers as a new object would have them, and the call throws (the object goes on).
void NvlinkAllToAll::recoverFromLoss() {
  if (marks_.wait() != cudaSuccess) cudaGetLastError();
  const uint32_t before = geo_.live;
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

// Every rank of `view` runs this after the agreement: no kernel of theirs runs (each proposed after its own stopped).
// The masked ranks' regions are unmapped, this rank's buffers are reset to a new object's, and the active ranks meet
// before any of them launches again (nobody stores into a region that is still being reset).
void NvlinkAllToAll::adoptView(uint32_t view) {
  const uint32_t me = config_.rank;
  for (uint32_t r = 0; r < config_.worldSize; ++r) {
    if (r == me || ((view >> r) & 1u) || !((geo_.live >> r) & 1u)) continue;
    const cudaError_t e = peerMaps_[r < me ? r : r - 1].reset();
    if (e != cudaSuccess) EPCOMM_LOG(kWarn, "rank " << me << ": unmapping masked rank " << r << " failed");
    peers_[r] = nullptr;
  }
  geo_.live = view_ = view;
  const nvlink::Stream setup = nvlink::makeStream();
  EPCOMM_CHECK_CUDA(cudaMemsetAsync(region_.get(), 0, geo_.totalBytes, setup.get()));
  EPCOMM_CHECK_CUDA(cudaMemsetAsync(seq_.get(), 0, nvlink::roundCounterBytes(geo_), setup.get()));
  EPCOMM_CHECK_CUDA(cudaMemsetAsync(route_.get(), 0, nvlink::routeScratchBytes(geo_), setup.get()));
  EPCOMM_CHECK_CUDA(cudaMemsetAsync(rowSlots_.get(), 0xff, nvlink::rowSlotBytes(geo_), setup.get()));
  EPCOMM_CHECK_CUDA(cudaStreamSynchronize(setup.get()));
  std::memset(static_cast<void*>(hostError_), 0, sizeof(nvlink::ErrorRecord));
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

void NvlinkAllToAll::setActiveRanks(const std::vector<int32_t>& mask) {
  checkUsable();
  const uint32_t W = config_.worldSize, me = config_.rank;
  EPCOMM_CHECK(agree_ != nullptr, kUnavailable,
               "nvlink rank " << me
                              << ": setActiveRanks needs the node's shared abort board, which this object has "
                                 "not got (no POSIX shared memory)");
  EPCOMM_CHECK(order_.state() == CallOrder::State::kIdle, kInvalidArgument,
               "nvlink rank " << me << ": setActiveRanks while the object is '" << CallOrder::name(order_.state())
                              << "' (call it between rounds)");
  const uint32_t want = nvlink::requestedView(mask, W, geo_.live);
  if (marks_.wait() != cudaSuccess) cudaGetLastError();
  checkUsable();
  if (!((want >> me) & 1u)) {
    // This rank leaves: the others adopt the mask, unmap its region and meet; then nothing of theirs touches it.
    const uint32_t missing = agree_->leave(want & geo_.live, agree_->nextBarrier());
    if (missing != 0) {
      EPCOMM_LOG(kWarn, "nvlink rank " << me << ": leaving, no answer from " << nvlink::rankSet(missing, W));
    }
    left_ = true;
    view_ = want & geo_.live;
    failedCode_ = ErrorCode::kInvalidArgument;
    failed_ = "nvlink rank " + std::to_string(me) +
              ": this rank left the object (setActiveRanks masked it) and takes no part in its rounds";
    return;
  }
  const nvlink::ElasticAgreement::Result agreed = agree_->agree(want & geo_.live);
  if (agreed.view == 0) {
    left_ = true;
    view_ = 0;
    failedCode_ = ErrorCode::kPeerFailure;
    failed_ = "nvlink rank " + std::to_string(me) + ": setActiveRanks: the other ranks went on without this rank (" +
              agreed.maskedBy + ")";
    detail::throwError(failedCode_, failed_, __FILE__, __LINE__);
  }
  const uint32_t lost = want & geo_.live & ~agreed.view;
  adoptView(agreed.view);
  EPCOMM_CHECK(lost == 0 || elastic_, kTimeout,
               "nvlink rank " << me << ": setActiveRanks: " << nvlink::rankSet(lost, W)
                              << " did not answer within EPCOMM_TIMEOUT_MS and was masked too (active: "
                              << nvlink::rankSet(agreed.view, W) << ")");
}

}  // namespace

bool nvlinkUsable(std::string* whyNot) { return cudaDeviceSeen(whyNot); }

std::unique_ptr<AllToAll> createNvlink(const Config& config, Bootstrap& bootstrap) {
  return std::make_unique<NvlinkAllToAll>(config, bootstrap);
}

std::vector<PlannedBuffer> planNvlink(const Config& config) {
  config.validate();
  // The planner runs without a GPU: assume an H200's 132 SMs for the block count (only the counters depend on it).
  const Geometry g = geometryFor(config, 132);
  const uint64_t W = config.worldSize, Ts = g.slotsPerSender, K = config.expertsPerToken;
  std::vector<PlannedBuffer> plan;
  auto add = [&](const char* name, const char* memory, uint64_t bytes, const std::string& note) {
    plan.push_back(PlannedBuffer{"nvlink", name, memory, bytes, note});
  };
  add("flags", "device (peer-mapped)", g.offNumTokens - g.offFlags, "u64 [2][W] monotone counters");
  add("routing counts", "device (peer-mapped)", g.offRoute - g.offNumTokens, "u64 [W] + u64 [W][L] (tagged)");
  add("routing entries", "device (peer-mapped)", g.offPayload - g.offRoute,
      "tagged {le, pos} [W=" + std::to_string(W) + "][K/2=" + std::to_string((K + 1) / 2) +
          "][Ts=" + std::to_string(Ts) + "][2]");
  add("dispatch staging", "device (peer-mapped)", g.offWeights - g.offPayload,
      "[W][Ts][" + std::to_string(g.slotBytes) + " B: payload + scales]");
  add("combine weights", "device (peer-mapped)", g.offPartials - g.offWeights, "u64 [W][Ts][K] (f32 + round tag)");
  add("combine partials", "device (peer-mapped)", g.totalBytes - g.offPartials,
      "[W][T=" + std::to_string(config.maxNumTokens) + "][H*4 B]");
  add("round counters", "device", nvlink::roundCounterBytes(g), "u32 [4][blocks=" + std::to_string(g.blocks) + "]");
  add("routing histograms", "device", nvlink::routeScratchBytes(g),
      "i32 [routing blocks=" + std::to_string(g.routeBlocks) + "][E] + arrival counter");
  add("dispatch rows for the combine", "device", nvlink::rowSlotBytes(g),
      "u64 [W][Ts][K]: each received routing entry's expert and row");
  add("error record", "host shared (mapped)", kAbortSlotBytes,
      "written by kernels, read by the host; the abort word peers set (one slot of the node's abort board)");
  return plan;
}

}  // namespace backends
}  // namespace epcomm
