// The CPU reference of dispatch and combine (SPEC 2.1) for every rank in one process, and the CPU form of the
// per-block fp8 cast that DeepEP-style callers apply before dispatch. Every backend test compares against these;
// they are written for obviousness, not speed. Host memory only.
#pragma once

#include <cstdint>
#include <vector>

#include "epcomm/all_to_all.hpp"

namespace epcomm {
namespace reference {

/// Dispatch for all ranks: args[r] is rank r's DispatchArgs (host memory; doSend/doRecv/stream ignored;
/// *boundM read if given). Writes each rank's outExpertNumTokens, outExpertX and outExpertXScale; rows that receive
/// no token are left untouched. With config.dispatchCast each rank's bf16 x is cast as castFp8Blocks casts it
/// (blocks of 128) before it travels. The config is validated (kInvalidConfig) and every rank's tensors go through the
/// same argument checks as the backends (kInvalidArgument), so the reference rejects what the backends reject.
void dispatch(const Config& config, const std::vector<DispatchArgs>& args);

/// Combine for all ranks: args[r] is rank r's CombineArgs (host memory). Each outTokens row t < boundM is set to
/// (accumulate ? out : 0) + sum_k weights[t,k] * expertY[slot(t,k)], in fp32, k ascending, then rounded once to the
/// output dtype (round to nearest even); each term is a separate multiply and add (no FMA). Rank r reads its own
/// indices; a token whose expert row does not exist on the owner (the ranks of a DP group disagree on indices or
/// boundM) throws kInvalidArgument.
void combine(const Config& config, const std::vector<CombineArgs>& args);

/// Dispatch and combine for all ranks under an active-ranks mask (elastic ranks, AllToAll::activeRanks: worldSize
/// entries, 1 = active): every position whose expert is on a masked rank, and every position of a token whose sending
/// rank (t % dpSize within its DP group) is masked, counts as -1, so it is neither delivered nor summed; the other
/// weights are not renormalised. A masked rank's own outputs mean nothing. Otherwise as the functions above.
void dispatch(const Config& config, const std::vector<DispatchArgs>& args, const std::vector<int32_t>& activeRanks);
void combine(const Config& config, const std::vector<CombineArgs>& args, const std::vector<int32_t>& activeRanks);

/// Uniform random top-K routing without repeats (SPEC 3): row-major [m, K] int32 expert indices in [0, E), from
/// `seed` (the same seed gives the same routing on every platform).
std::vector<int32_t> randomIndices(const Config& config, uint32_t m, uint64_t seed);

/// The per-block fp8 e4m3 cast of DeepEP's low-latency dispatch: for every row t of x and every block b of
/// `blockSize` consecutive elements, amax = max(max |x|, 1e-4), out = fp8(x * (448 / amax)) (round to nearest
/// even) and scales[t, b] = amax / 448, so that x ~ out * scales. With `roundScale` the scale is rounded up to a
/// power of two (scale = 2^ceil(log2(amax / 448)) from the bits of amax / 448, exact; out = fp8(x / scale)). With
/// blockSize 128 this is the cast of Config::dispatchCast (kFp8Blocks, kFp8BlocksPow2): a dispatch that casts gives
/// the bits of this cast followed by a dispatch of its output.
/// x: [m, H] bf16 / fp16 / fp32, rows contiguous inside; out: [m, H] fp8_e4m3, rows contiguous inside; scales:
/// [m, H / blockSize] fp32, any strides; H % blockSize == 0. Throws kInvalidArgument naming the bad argument.
void castFp8Blocks(const TensorView& x, const TensorView& out, const TensorView& scales, int blockSize = 128,
                   bool roundScale = false);

}  // namespace reference
}  // namespace epcomm
