// Protocol math shared by every backend, the reference and the planner: who sends which token, where rows go.
// Written once, usable from host and device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EPCOMM_HD __host__ __device__ __forceinline__
#else
#define EPCOMM_HD inline
#endif

namespace epcomm {

/// Upper bound on K (per-token arrays on the device are sized by it).
constexpr uint32_t kMaxExpertsPerToken = 64;

EPCOMM_HD uint64_t roundUpPow2(uint64_t x, uint64_t pow2) { return (x + pow2 - 1) & ~(pow2 - 1); }
EPCOMM_HD uint64_t ceilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

/// Rank that holds global expert e (experts in contiguous blocks of L per rank).
EPCOMM_HD uint32_t expertOwner(uint32_t expert, uint32_t numLocalExperts) { return expert / numLocalExperts; }

/// The rank of DP group `group` that sends token t (sending work is spread round-robin over the D ranks).
EPCOMM_HD uint32_t tokenSender(uint32_t group, uint32_t token, uint32_t dpSize) {
  return group * dpSize + token % dpSize;
}

/// Whether `rank` sends token t of its own DP group.
EPCOMM_HD bool sendsToken(uint32_t rank, uint32_t token, uint32_t dpSize) { return token % dpSize == rank % dpSize; }

/// Number of tokens among [0, m) that `rank` sends (tokens t with t % D == rank % D).
EPCOMM_HD uint32_t numTokensSentBy(uint32_t rank, uint32_t m, uint32_t dpSize) {
  uint32_t r = rank % dpSize;
  return m > r ? (m - r + dpSize - 1) / dpSize : 0;
}

/// Rows of the packed layout: at most maxNumTokens * G tokens arrive, each at up to min(K, L) local experts,
/// plus up to padding - 1 rows of padding per expert.
EPCOMM_HD uint64_t packedRowsFor(uint32_t maxNumTokens, uint32_t numDpGroups, uint32_t numLocalExperts,
                                 uint32_t expertsPerToken, uint32_t padding) {
  uint64_t perToken = expertsPerToken < numLocalExperts ? expertsPerToken : numLocalExperts;
  return static_cast<uint64_t>(maxNumTokens) * numDpGroups * perToken +
         static_cast<uint64_t>(numLocalExperts) * (padding - 1);
}

/// Decodes one routing index: returns -1 for masked, the expert otherwise (range is checked by the caller).
/// `kind`: 0 = int32, 1 = uint32 (0xFFFFFFFF = masked), 2 = int64.
EPCOMM_HD int64_t decodeIndex(const void* base, int kind, int64_t offsetElems) {
  if (kind == 0) return static_cast<const int32_t*>(base)[offsetElems];
  if (kind == 1) {
    uint32_t v = static_cast<const uint32_t*>(base)[offsetElems];
    return v == 0xFFFFFFFFu ? -1 : static_cast<int64_t>(v);
  }
  return static_cast<const int64_t*>(base)[offsetElems];
}

/// Whether expert `e` at position k of a token already appeared at an earlier position (it is then delivered
/// once; its weights all apply to that one row in combine).
template <typename LoadFn>
EPCOMM_HD bool isRepeatOfEarlier(LoadFn load, uint32_t k, int64_t e) {
  for (uint32_t j = 0; j < k; ++j) {
    if (load(j) == e) return true;
  }
  return false;
}

}  // namespace epcomm
