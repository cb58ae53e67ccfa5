// Shared by the tests that drive a ProxyChannel directly (kill, notice and elastic cases): the channel's config and
// the heads of a round.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "host_harness.hpp"
#include "proxy/proxy_channel.hpp"

namespace epcomm {
namespace test {

/// Rank `rank` of `world`: 4 experts per rank (at W = 3 a head of 64 bytes, within tcp;ofi_rxm's inject size, as in
/// the GPU proxy backend's test), K = 4, T = 16, H = 64.
inline Config channelConfig(uint32_t world, uint32_t rank) {
  Scenario sc;
  sc.W = world;
  sc.E = 4 * world;
  sc.K = 4;
  sc.T = 16;
  sc.H = 64;
  return sc.config(rank);
}

/// Heads of one round: `tokens` tokens to the first expert of every rank (the same counts in every process).
inline void packHeads(proxy::ProxyChannel& ch, uint32_t tokens) {
  const proxy::ProtocolSizes& s = ch.sizes();
  std::vector<uint32_t> head(s.numExperts + s.worldSize, 0);
  for (uint32_t p = 0; p < s.worldSize; ++p) {
    head[p * s.numLocalExperts] = tokens;
    head[s.numExperts + p] = tokens;
  }
  for (uint32_t p = 0; p < s.worldSize; ++p) std::memcpy(ch.sendSlot(p), head.data(), head.size() * 4);
}

}  // namespace test
}  // namespace epcomm
