// The elastic-ranks cases that the GPU backends offering them (nvlink, proxy, nvshmem) run alike (docs/failures.md
// "Elastic ranks"): a rank killed with SIGKILL at one of three points of a round, after which every survivor's failing
// call names it and the same object goes on under the mask; and the caller's setActiveRanks without a death. The
// caller sets the environment (EPCOMM_TIMEOUT_MS, EPCOMM_ELASTIC, the backend's own variables) and skips where the
// backend cannot run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"

namespace epcomm {
namespace gputest {

/// The scenario of the elastic cases on `backend`: W = `world` ranks, DP groups of `dp`, 4 experts per rank, top-3,
/// up to 32 tokens of 256 elements, masked experts.
Scenario elasticScenario(const std::string& backend, uint32_t world, uint32_t dp = 1);

/// The rounds a kill case checks after the kill: the environment variable `variable` when it is a positive number,
/// else `byDefault`.
int roundsAfter(const char* variable, int byDefault);

/// What one rank of an elastic case holds besides its object: its GPU made current (useRankDevice), a stream, a
/// scratch buffer for the split halves, its copy of the scenario and its device tensors.
struct ElasticRank {
  ElasticRank(const Scenario& scenario, uint32_t rank);
  int device;  // first: the GPU is made current before the stream and buffers are made
  Stream stream;
  DeviceBuffer scratch;
  Scenario s;
  DeviceTensors dev;
};

/// Where in a round the victim dies: the survivors' dispatch waits for its data, their combine does, or it dies
/// between two rounds.
enum class KillPoint { kMidDispatch, kMidCombine, kBetweenRounds };
const char* killPointName(KillPoint when);

/// `rounds` rounds of `s` (its mask in s.active) from seed `seed0`, each checked against the reference, and the drop
/// count of the first few against the reference's.
void roundsUnderMask(AllToAll& a2a, const Scenario& s, uint32_t rank, DeviceTensors& dev, cudaStream_t stream,
                     DeviceBuffer& scratch, uint64_t seed0, int rounds);

/// One kill case: `s` (W = s.world ranks, on GPU r % devices) on `backend`, two checked rounds, then rank `victim`
/// dies at `when`. Every survivor's failing call must raise one of `codes`, name "without rank <victim>" and "the
/// object goes on", within `boundMs`; its activeRanks() must then mask the victim, and `roundsAfter` rounds under the
/// mask must equal the reference with drops counted. The object is then destroyed among the survivors.
struct KillCase {
  std::string backend;
  KillPoint when = KillPoint::kMidDispatch;
  uint32_t victim = 0;
  int roundsAfter = 100;
  int64_t boundMs = 3000;
  std::vector<ErrorCode> codes{ErrorCode::kTimeout, ErrorCode::kPeerFailure};
  std::string label;  ///< printed with each survivor's error
};
void runKillCase(const Scenario& s, const KillCase& k);

/// setActiveRanks by the caller, no death, W = 4: bad masks are refused and leave the object as it was; rank 1 is
/// masked between rounds, leaves (its later calls raise), and the others run `rounds` rounds under the mask and may not
/// unmask it; everyone destroys its object and the bootstrap stays intact.
void runCallerMasksARank(const Scenario& s, const std::string& backend, int rounds);

}  // namespace gputest
}  // namespace epcomm
