// The AllToAll interface: MoE dispatch and combine, with a send/recv split, on one of several backends.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/config.hpp"
#include "epcomm/tensor.hpp"

namespace epcomm {

/// Arguments of AllToAll::dispatch. Shapes use m = x.shape[0] <= maxNumTokens, K, L = E / W,
/// R = Config::batchedRowsPerExpert(), P = Config::packedRows(), S = hiddenDimScaleBytes / 4 (fp32 scales).
///
/// Semantics (SPEC 2.1): the tokens of this rank's DP group whose index t < boundM are sent by rank
/// group*D + t % D, once per distinct expert among indices[t, :] (-1 = no expert; a repeated expert is
/// delivered once and its weights are all applied in combine). On the expert's rank, rows are ordered by
/// (sending rank, token index).
struct DispatchArgs {
  /// [L] int32, written: tokens received per local expert (unpadded counts).
  TensorView outExpertNumTokens;
  /// Batched: [L, R, hiddenDimBytes / itemsize]; packed: [P, hiddenDimBytes / itemsize]. Any dtype; rows
  /// contiguous inside, row stride a multiple of 16 bytes.
  TensorView outExpertX;
  /// Batched [L, R, S] or packed [P, S], any strides; required iff hiddenDimScaleBytes > 0.
  TensorView outExpertXScale;
  /// [m, hiddenDimBytes / itemsize], any dtype, rows contiguous inside, row stride a multiple of 16 bytes. With
  /// Config::dispatchCast: bf16 [m, hiddenDim] (the dispatch casts it; outExpertX is then fp8_e4m3).
  TensorView x;
  /// [m, S] fp32 (or any 4-byte dtype), any strides; required iff hiddenDimScaleBytes > 0, except with
  /// Config::dispatchCast, which computes the scales (xScale is then not given; outExpertXScale is fp32).
  TensorView xScale;
  /// [m, K] int32 / uint32 / int64, any strides. -1 (all ones for uint32) = masked.
  TensorView indices;
  /// Optional int32 scalar in the backend's memory (device memory for GPU backends): tokens >= *boundM are
  /// ignored. Lets a CUDA graph run with a varying token count. nullptr = m.
  const int32_t* boundM = nullptr;
  bool doSend = true;      ///< Run the send half (never blocks).
  bool doRecv = true;      ///< Run the receive half (waits for the peers' data).
  void* stream = nullptr;  ///< cudaStream_t for GPU backends; ignored by the host backend.
};

/// Arguments of AllToAll::combine. Must follow a dispatch on the same object (it reuses its routing).
///
/// outTokens[t, :] (+)= sum over k with indices[t, k] != -1 of weights[t, k] * expertY[slot(t, k), :],
/// accumulated in fp32 in a fixed order, for t < boundM on every rank of the DP group. Rows >= boundM are
/// not written.
struct CombineArgs {
  /// [>= m, H] bf16 / fp16 / fp32, rows contiguous inside. Rows >= m (and >= boundM) are not written, so one
  /// buffer of maxNumTokens rows serves every batch (as pplx-kernels' callers pass it).
  TensorView outTokens;
  /// [m, K], the same indices that were dispatched; m = indices.shape[0] is the call's token count.
  TensorView indices;
  /// [m, K] fp32, any strides.
  TensorView weights;
  /// Layout of outExpertX with H elements per row: batched [L, R, H] or packed [P, H]; bf16 / fp16 / fp32.
  TensorView expertY;
  const int32_t* boundM = nullptr;  ///< As in DispatchArgs.
  bool doSend = true;
  bool doRecv = true;
  bool accumulate = false;  ///< Add to outTokens instead of overwriting it.
  void* stream = nullptr;
};

/// One MoE communication object. Not thread-safe; dispatch and combine alternate (each whole, or as its send half
/// then its receive half); a call out of that order throws kInvalidArgument naming the object's state, before
/// anything is launched (the host backend also accepts a dispatch that repeats one never combined; nvlink does not:
/// that dispatch would overwrite what the peers may still be reading). Several objects may be in flight at once
/// (micro-batches). Calls on GPU backends are stream-ordered and never synchronise the host.
/// Errors detected by a kernel or a background thread are thrown by the next call on the object.
class AllToAll {
 public:
  virtual ~AllToAll() = default;
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  /// Validates every tensor against the config, then sends and/or receives. See DispatchArgs.
  virtual void dispatch(const DispatchArgs& args) = 0;
  /// Validates every tensor, then sends and/or receives the expert outputs. See CombineArgs.
  virtual void combine(const CombineArgs& args) = 0;
  /// Blocks until the object's outstanding work is finished and rethrows any recorded error. Host: joins its work;
  /// GPU backends: waits, on each stream the object launched on, for its last launch there (not for the device,
  /// other streams or launches from a graph the caller replays: the caller waits for those). Not needed between
  /// calls; useful before destruction in tests.
  virtual void synchronize() = 0;

  virtual const Config& config() const = 0;
  /// "nvlink", "nvshmem", "proxy" or "host".
  virtual const char* backendName() const = 0;
  /// Bytes of communication buffers this object allocated (device and pinned host), for the planner.
  virtual uint64_t bufferBytes() const = 0;

  /// Elastic ranks (docs/failures.md, "Elastic ranks"): the active-ranks mask, worldSize entries, 1 = the rank takes
  /// part in rounds, 0 = masked. A masked rank is skipped in every send and wait; tokens routed to its experts are
  /// dropped (left out of combine; the other weights are not renormalised) and counted (droppedTokens), and tokens it
  /// would have sent for its DP group are not dispatched. The host backend masks a peer whose wait times out, whose
  /// writes fail or that leaves, once the other ranks agree, when EPCOMM_ELASTIC=1; the call that lost the peer
  /// throws and the next rounds run without it. Reading the mask does not block. Backends without elastic ranks
  /// throw kUnavailable.
  virtual std::vector<int32_t> activeRanks() const;
  /// Masks ranks on purpose: collective over the active ranks, those it masks included, each passing the same mask
  /// (0 for every rank to mask) between rounds. Blocks until the ranks that stay agree: on the intersection of their
  /// masks and of the ranks each still hears from (one that does not answer within EPCOMM_TIMEOUT_MS is masked too
  /// with EPCOMM_ELASTIC=1, else the call throws kTimeout). A rank whose own entry is 0 leaves: it returns once the
  /// others answered (they have its writes of the rounds before), and every later call on its object throws. A
  /// masked rank never becomes active again (kInvalidArgument: create a new object for that). Backends without
  /// elastic ranks throw kUnavailable.
  virtual void setActiveRanks(const std::vector<int32_t>& mask);
  /// (token, k) positions of this rank's combines since creation whose expert's rank, or whose token's sending rank,
  /// was masked: the terms left out of its outputs. Backends without elastic ranks throw kUnavailable.
  virtual uint64_t droppedTokens() const;

 protected:
  AllToAll() = default;
};

/// Fabric operations one rank issued to one peer since its object was created (cumulative). Every write carries
/// an immediate.
struct PeerTransferStats {
  uint64_t headWrites = 0;     ///< Dispatch: routing counts + the tokens that fit the private area (one per round).
  uint64_t bulkWrites = 0;     ///< Dispatch: the remaining tokens (one per round whose private area overflowed).
  uint64_t combineWrites = 0;  ///< Combine: expert outputs (one per round).
  uint64_t barrierImms = 0;    ///< Immediates of the reuse barrier (a dispatch that follows a dispatch).
  uint64_t bytes = 0;          ///< Payload bytes of all of the above.
};

/// Counters of an object whose backend moves its data with a TransferEngine (host, proxy): what benchmarks and
/// tests report to show the protocol's operation count (docs/protocol.md). A snapshot, plain data.
struct TransferStats {
  bool available = false;                ///< false: the backend issues no fabric operations (nvlink, nvshmem).
  std::string provider;                  ///< Provider the engine runs on ("tcp", "shm", "efa", "verbs", ...).
  uint32_t privateTokens = 0;            ///< Entries of each sender's private area on each receiver.
  uint64_t dispatchRounds = 0;           ///< Dispatch exchanges completed.
  uint64_t combineRounds = 0;            ///< Combine exchanges completed.
  std::vector<PeerTransferStats> peers;  ///< By rank (worldSize entries); this rank's own entry stays zero.
};

/// The fabric counters of `a2a` (see TransferStats); `available` is false for backends without a TransferEngine.
/// Does not block; call it between calls on the object, not concurrently with them.
TransferStats transferStats(const AllToAll& a2a);

/// Backends this build contains, in preference order ("nvlink", "nvshmem", "proxy", "host").
std::vector<std::string> builtBackends();

/// Backends whose dispatch applies Config::dispatchCast ("nvlink", "host"), whether built or not. The others
/// (nvshmem, proxy) create such an object but refuse its dispatch with Error(kUnavailable): create it with
/// DispatchCast::kNone and cast x first (reference::castFp8Blocks on the CPU, or a kernel of the caller's).
std::vector<std::string> dispatchCastBackends();

/// Creates an AllToAll on `backend` ("auto": the first built backend the machine can run, e.g. nvlink when all
/// ranks see GPUs on one node, host without GPUs). Collective over `bootstrap`. Throws kNotBuilt for a backend
/// this build lacks, kUnavailable when the machine cannot run it, kInvalidConfig for a bad config.
std::unique_ptr<AllToAll> createAllToAll(const Config& config, Bootstrap& bootstrap,
                                         const std::string& backend = "auto");

}  // namespace epcomm
