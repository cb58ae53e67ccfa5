// What the proxy backend's two GPU tests share (proxy_test: every peer over the fabric; proxy_local_test: node peers
// over NVLink): their scenarios and one rank's part of the cases both run, with GoogleTest assertions (a rank's part
// first makes the rank's GPU current). Builds on gpu_cases.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "gpu_cases.hpp"
#include "gpu_harness.hpp"
#include "proxy/proxy_channel.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace gputest {

/// The proxy tests' scenario: `world` ranks with 4 experts each.
Scenario proxyScenario(uint32_t world);

/// Masked and repeated experts, ragged m, a device boundM, both layouts with padding (batched by 4 with u32 indices,
/// packed by 16 with i64): two scenarios of proxyScenario(world).
std::vector<Scenario> maskedLayouts(uint32_t world);

/// `rounds` eager rounds of `s` on `a2a` through `dev` (inputs seed, seed + 1, ...; the default stream), each checked
/// against the reference.
void checkedRounds(AllToAll& a2a, const Scenario& s, int rank, DeviceTensors& dev, int rounds, uint64_t seed);

/// The control of `rounds` rounds in a channel's counters: as many dispatch and combine exchanges, and for every peer
/// (ranks below `world` but `rank`) one head write and one combine write per round.
void expectControlPerRound(const proxy::ChannelStats& st, int world, int rank, int rounds);

/// Rank 2 of `s.world` dies (SIGKILL) after its dispatch send half, mid-round (after one complete round; inputs 5): the
/// others raise an error naming it (its silence, kTimeout, the engine's failed transfer to it, kFabric, or
/// kPeerFailure) within 3 x 2 s + 3 s (the test sets EPCOMM_TIMEOUT_MS = 2000), and the object then refuses further
/// use.
void peerKilledMidRound(const Scenario& s, int rank, Bootstrap& bootstrap);

/// The outcome of peerKilledMidRound on `world` ranks: rank 2 killed by SIGKILL, every other one ok. A failure names
/// `what` (unless empty), then every rank's outcome.
void expectRank2Killed(const test::RunResult& result, int world, const std::string& what = "");

}  // namespace gputest
}  // namespace epcomm
