// Out-of-band rendezvous between the ranks: small byte blobs, barriers. Used once at setup, never per call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace epcomm {

/// Collective operations over an out-of-band channel. Every call is collective (all ranks call it in the same
/// order), blocks, and throws Error(kBootstrap / kTimeout) naming the rank that failed or never arrived.
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int worldSize() const = 0;
  /// Gathers `bytes` from every rank: recv holds worldSize * bytes, rank i's blob at offset i * bytes.
  /// `send` may alias recv + rank * bytes.
  virtual void allGather(const void* send, void* recv, size_t bytes) = 0;
  /// Returns when every rank has entered.
  virtual void barrier() = 0;
  /// Copies `bytes` at `data` from `root` to every rank.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
};

/// Collective allGather of blobs whose length may differ per rank (lengths first, then the blobs padded to the
/// longest). Returns every rank's blob, indexed by rank. Errors as Bootstrap::allGather.
std::vector<std::vector<uint8_t>> allGatherBlobs(Bootstrap& bootstrap, const std::vector<uint8_t>& mine);

/// TCP rendezvous: rank 0 listens on `hostPort` ("host:port"), the others connect (retrying until `timeoutMs`).
/// Throws kBootstrap naming the ranks that never joined. timeoutMs <= 0 uses EPCOMM_TIMEOUT_MS.
std::unique_ptr<Bootstrap> createTcpBootstrap(const std::string& hostPort, int rank, int worldSize,
                                              int64_t timeoutMs = 0);

/// TCP rendezvous from EPCOMM_BOOTSTRAP, EPCOMM_RANK and EPCOMM_WORLD_SIZE; throws kInvalidArgument naming a
/// missing variable.
std::unique_ptr<Bootstrap> createBootstrapFromEnv();

/// A bootstrap for one rank alone (W = 1): every operation is a local copy.
std::unique_ptr<Bootstrap> createSelfBootstrap();

}  // namespace epcomm
