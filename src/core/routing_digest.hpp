// A 64-bit digest of one round's routing: the expert indices of the tokens < boundM, and boundM. A backend takes it
// at dispatch and compares it at combine, which must use the routing that was dispatched (combine finds each
// token's rows from its own indices: other indices with the same per-expert counts would pass every count check
// and give a silently wrong sum).
//
// The digest is a sum modulo 2^64 of one mixed term per (token, position), finished with boundM: any thread may add
// any term in any order (a kernel: each thread its tokens, then one atomicAdd), and the result does not depend on
// the index dtype (int32, uint32 with 0xFFFFFFFF for -1, int64 give the same digest for the same experts).
#pragma once

#include <cstdint>

#include "core/layout.hpp"

namespace epcomm {

/// The splitmix64 finaliser: a bijection of 64-bit values that spreads every input bit over the output.
EPCOMM_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The term of token t's position k routed to `expert` (-1 = no expert).
EPCOMM_HD uint64_t routingTerm(uint32_t t, uint32_t k, int64_t expert) {
  return mix64(mix64((static_cast<uint64_t>(t) << 8) ^ k ^ 0x9E3779B97F4A7C15ull) ^ static_cast<uint64_t>(expert + 1));
}

/// The digest of a round from the sum (mod 2^64) of its terms and boundM.
EPCOMM_HD uint64_t routingDigest(uint64_t sumOfTerms, uint32_t boundM) {
  return mix64(sumOfTerms ^ mix64(0xD6E8FEB86659FD93ull + boundM));
}

/// The digest of indices [m, K] (kind as decodeIndex, strides in elements) over the tokens < boundM, on the host.
inline uint64_t routingDigestOf(const void* indices, int kind, int64_t stride0, int64_t stride1, uint32_t K,
                                uint32_t boundM) {
  uint64_t sum = 0;
  for (uint32_t t = 0; t < boundM; ++t) {
    for (uint32_t k = 0; k < K; ++k) sum += routingTerm(t, k, decodeIndex(indices, kind, t * stride0 + k * stride1));
  }
  return routingDigest(sum, boundM);
}

}  // namespace epcomm
