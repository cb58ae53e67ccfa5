// The cases that each GPU backend's own test runs (nvlink_test, nvshmem_test, proxy_test, proxy_local_test), written
// once: scenario lists, and one rank's part of a case inside test::runRanks, with GoogleTest assertions, for the
// backend and scenario the test gives. A rank's part first makes the rank's GPU current (useRankDevice). Builds on
// gpu_harness.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "gpu_harness.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace gputest {

/// One rank's object of `backend` for `s`, its device tensors and one round's inputs (`seed`) uploaded into them: for
/// the cases that drive the calls themselves.
struct LoadedObject {
  LoadedObject(const Scenario& s, int rank, Bootstrap& bootstrap, uint64_t seed, const std::string& backend);
  std::unique_ptr<AllToAll> a2a;
  DeviceTensors dev;
  Round round;
};

/// Runs every scenario of `list` on this rank, each with its own object of `backend` (runScenario); a failure names
/// `what` (unless empty), then the scenario's index.
void runScenarios(const std::vector<Scenario>& list, uint32_t rank, Bootstrap& bootstrap, const std::string& backend,
                  const std::string& what = "");

/// runScenarios on `world` ranks, one process each (test::runRanks with `options`), and every rank must succeed.
void runScenariosOnRanks(int world, const std::vector<Scenario>& list, const std::string& backend,
                         const test::RunOptions& options, const std::string& what = "");

/// Masked and repeated experts, ragged m and a device boundM: packed rows padded to 8; batched rows padded to 4 (u32
/// indices); packed with i64 indices in split halves with accumulate (three scenarios of `base`).
std::vector<Scenario> maskedBoundLayouts(const Scenario& base);

/// DP groups of 2 (every rank of a group gets the combine), masked experts and a device boundM: batched, and packed
/// rows padded to 4 in split halves (two scenarios of `base`).
std::vector<Scenario> dpGroupsOfTwo(const Scenario& base);

/// Every payload dtype with every (expertY, outTokens) pair: 36 scenarios of `base` with tokens of 128 elements, masked
/// and repeated experts, one round each, seeds 100, 101, ...
std::vector<Scenario> dtypeMatrix(const Scenario& base);

/// `s` in SPEC's decode shape: 256 experts, top-8, 128 tokens of 7168 fp8 bytes and 56 fp32 scales; two rounds.
Scenario decodeShape(Scenario s);

/// `s` with packed rows, tokens of 512 elements and masked experts: object B of twoObjectsInFlight.
Scenario secondObject(Scenario s);

/// Two objects (micro-batches) in flight at once on two streams, three rounds: A's and B's dispatches, then their
/// combines, each round checked. `splitB`: B's calls as send and receive halves, one after the other.
void twoObjectsInFlight(const Scenario& sa, const Scenario& sb, int rank, Bootstrap& bootstrap,
                        const std::string& backend, bool splitB = false);

/// How graphReplay captures and replays.
struct Replays {
  int count = 100;
  bool splitHalves = false;  ///< the capture holds dispatch and combine as four halves (separate calls)
  bool repeatFirst = false;  ///< replay 1 repeats replay 0's inputs, and its outputs must be bitwise equal
  std::string what;          ///< a failure names this (unless empty), then the replay
};

/// Captures dispatch + combine of `s` (with 16 tokens of 128 elements, masked, not ragged: m is part of the captured
/// call, the token count varies through a device boundM) into a CUDA graph once, then replays it `r.count` times with
/// new inputs and a new *boundM each time, each replay checked.
void graphReplay(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend, const Replays& r = {});

/// What peerNeverEnters expects of the error.
struct Silence {
  std::string phase = "dispatch";    ///< "dispatch" (the silent rank makes no call) or "combine" (it only dispatches)
  std::string names = "peer rank ";  ///< how the error names the silent rank (its number follows)
  int64_t withinMs = 1500 + 3000;    ///< how soon it comes (the test sets EPCOMM_TIMEOUT_MS = 1500)
  bool contextUsable = true;         ///< afterwards cudaMalloc still succeeds
  std::string who = "a peer";        ///< a failure: "no error after <who> skipped <phase>"
};

/// The last rank of `s` never enters `x.phase`: every other rank gets Error(kTimeout) naming it and the phase, within
/// `x.withinMs`, and the object then refuses further use. Every rank then meets the others at a barrier.
void peerNeverEnters(const Scenario& s, int rank, Bootstrap& bootstrap, const std::string& backend, const Silence& x);

/// Calls out of order are refused before anything is launched (combine before any dispatch, a receive half without its
/// send half, a second dispatch before the combine; `weightRows`: combine weights with fewer rows than the dispatch
/// had tokens), and the object stays usable.
void callsOutOfOrderAreRefused(const Scenario& s, int rank, Bootstrap& bootstrap, const std::string& backend,
                               bool weightRows);

/// synchronize() waits for the object's own launches, not for the device: with another stream of the process held
/// up for 2 s (a host function that sleeps), a round launched on a stream of its own and synchronize() must return
/// well before that, with the round's outputs complete (checked against the reference without any other wait).
void synchronizeWaitsForItsOwnWork(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend);

/// An expert index outside [-1, E) in token 2 of `s` (made not ragged, so the token exists) is detected on the device
/// and reported as kDeviceError naming the token and the index by the next call; the object then refuses a combine.
void badIndexIsDeviceError(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend);

/// What rank 1 does wrong in peerRefuses.
enum class Refusal {
  kDispatch,     ///< its dispatch of round 1 has x with one token more than maxNumTokens (a host check refuses it)
  kCombine,      ///< its combine of round 1 has expertY of dtype int32 (a host check refuses it)
  kDeviceIndex,  ///< its dispatch of round 1 has an expert index outside [-1, E): its kernel finds it (kDeviceError)
};

/// Failing together: round 0 completes; in round 1 rank 1 of `s` (s.world >= 2; made not ragged) does `what` wrong and
/// its call raises its own error (kInvalidArgument naming the check; kDeviceError for the index). Every other rank's
/// call of that round (dispatch, or combine after a completed dispatch; with kDeviceIndex its dispatch or combine:
/// rank 1's kernels may stop before they sent everything, and its next call tells the peers) raises within
/// `withinMs` of the call (the test sets EPCOMM_TIMEOUT_MS = 10000: far longer) an error naming rank 1 and the check's
/// text, prints the time it took, and the object then refuses further use. Every rank then meets the others at a
/// barrier.
void peerRefuses(Scenario s, int rank, Bootstrap& bootstrap, const std::string& backend, Refusal what,
                 int64_t withinMs = 2000);

/// peerRefuses on `world` ranks, one process each (test::runRanks with `options`) with EPCOMM_TIMEOUT_MS = 10000: `s`
/// with 8 experts per rank; every rank must succeed.
void peerRefusesOnRanks(int world, Scenario s, const std::string& backend, Refusal what,
                        const test::RunOptions& options);

}  // namespace gputest
}  // namespace epcomm
