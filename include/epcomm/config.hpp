// The configuration of one AllToAll object (SPEC 2.1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epcomm {

/// Layout of the dispatch output (and of the combine input expertY).
enum class Layout : int {
  /// `[L, batchedRowsPerExpert, ...]`: each local expert owns a fixed block of rows (pplx-kernels, vLLM).
  kBatched = 0,
  /// `[packedRows, ...]`: experts back to back, expert e's rows start at the sum of the earlier experts'
  /// counts, each rounded up to `expertPadding`.
  kPacked = 1,
};

/// "batched" / "packed".
const char* layoutName(Layout layout);

/// Elements per scale of the dispatch's fp8 casts (DeepEP's block).
constexpr uint32_t kFp8CastBlock = 128;

/// A conversion the dispatch applies to every token on its way from x to outExpertX (DeepEP's low-latency dispatch
/// with use_fp8): the sender reads x in one format and the receivers get another, with no separate cast before the
/// dispatch. Every rank must give the same value (it is part of the config check at construction).
enum class DispatchCast : int {
  /// x's bytes travel as they are: x is [m, hiddenDimBytes / itemsize] of any dtype, xScale as configured.
  kNone = 0,
  /// x is bf16 [m, hiddenDim]; each block of kFp8CastBlock (128) elements of a token arrives as fp8 e4m3 with one
  /// fp32 scale: amax = max(max |x| over the block, 1e-4), scale = amax / 448, fp8 = e4m3(x * (448 / amax)) (IEEE
  /// division and product, round to nearest even), so x ~ fp8 * scale. outExpertX is fp8_e4m3 and outExpertXScale
  /// fp32, bit for bit what reference::castFp8Blocks followed by a dispatch of its output gives (for finite x; a NaN
  /// element gives an fp8 NaN whose sign bit may differ). Requires hiddenDim % 128 == 0, hiddenDimBytes == hiddenDim
  /// and hiddenDimScaleBytes == hiddenDim / 128 * 4; xScale is not given. Applied by the nvlink backend (inside the
  /// dispatch kernel's send half) and the host backend (dispatchCastBackends()); the others refuse the dispatch with
  /// Error(kUnavailable).
  kFp8Blocks = 1,
  /// kFp8Blocks with each scale rounded up to a power of two (DeepEP's round_scale): scale = 2^ceil(log2(amax / 448)),
  /// fp8 = e4m3(x * (1 / scale)), the product exact in its exponent.
  kFp8BlocksPow2 = 2,
};

/// "none" / "fp8_blocks" / "fp8_blocks_pow2".
const char* dispatchCastName(DispatchCast cast);

/// Everything that sizes an AllToAll object. Plain data; `validate()` checks it.
///
/// Experts are placed in contiguous blocks: rank r holds experts [r*L, (r+1)*L) with L = numExperts / worldSize.
/// A DP group is `dpSize` consecutive ranks holding identical tokens; each token is dispatched once per group.
struct Config {
  uint32_t maxNumTokens = 0;         ///< Max tokens per rank per call (m <= maxNumTokens).
  uint32_t numExperts = 0;           ///< E, total experts over all ranks.
  uint32_t expertsPerToken = 0;      ///< K, the router's top-k.
  uint32_t worldSize = 0;            ///< W, number of ranks.
  uint32_t rank = 0;                 ///< This rank, in [0, W).
  uint32_t dpSize = 1;               ///< D, ranks per DP group (W % D == 0).
  uint32_t hiddenDim = 0;            ///< H, elements per token of the combine (expertY, outTokens).
  uint32_t hiddenDimBytes = 0;       ///< Dispatch payload bytes per token (any dtype), multiple of 16.
  uint32_t hiddenDimScaleBytes = 0;  ///< Dispatch scale bytes per token (0 = no scales), multiple of 4.
  uint32_t expertPadding = 1;        ///< Row alignment of each expert's segment (power of two).
  Layout layout = Layout::kBatched;  ///< Layout of outExpertX / expertY.
  /// Cast the dispatch applies to each token (DeepEP's fp8 cast inside the dispatch); see DispatchCast.
  DispatchCast dispatchCast = DispatchCast::kNone;

  /// Throws Error(kInvalidConfig) naming the first bad field and its value.
  void validate() const;

  uint32_t numLocalExperts() const { return numExperts / worldSize; }  ///< L = E / W
  uint32_t numDpGroups() const { return worldSize / dpSize; }          ///< G = W / D
  uint32_t dpGroup() const { return rank / dpSize; }                   ///< This rank's DP group.
  /// Rows per expert in the batched layout: maxNumTokens * G rounded up to expertPadding.
  uint64_t batchedRowsPerExpert() const;
  /// Rows of the packed layout: the most any rank can receive, with padding.
  uint64_t packedRows() const;
  /// Rows addressed by one expert's index range: batchedRowsPerExpert() (dimension 1 of [L, R, ...]) in the
  /// batched layout, packedRows() (dimension 0 of [P, ...]) in the packed layout.
  uint64_t expertRows() const;
  /// Rows of the whole outExpertX / expertY tensor: L * R batched, P packed.
  uint64_t totalExpertRows() const;
  /// Where each local expert's rows start in outExpertX / expertY, from the counts a dispatch wrote
  /// (outExpertNumTokens, L int32 values): L + 1 row offsets. Packed: the sum of the earlier experts' counts, each
  /// rounded up to expertPadding, and last the rows in use; batched: le * batchedRowsPerExpert(), and last
  /// totalExpertRows(). Expert le's rows are [offsets[le], offsets[le] + numTokens[le]). Throws kInvalidArgument for
  /// a count that is negative or does not fit the layout.
  std::vector<uint64_t> expertRowOffsets(const int32_t* numTokens) const;

  /// One-line description: "E=256 K=8 H=7168 bytes=7168 scale=224 T=128 W=8 D=1 pad=1 batched rank=0" (with
  /// " cast=fp8_blocks" before the rank when the dispatch casts).
  std::string toString() const;
};

/// The standard configurations of SPEC 3 by name (decode, prefill, small, qwen3), with `worldSize`, `dpSize`
/// and `rank` set from the arguments. Throws kInvalidArgument for an unknown name.
Config standardConfig(const std::string& name, uint32_t worldSize, uint32_t rank = 0, uint32_t dpSize = 1);

/// Names accepted by standardConfig, in SPEC order.
const char* const* standardConfigNames(int* count);

}  // namespace epcomm
