// Same-node peers of the proxy backend over NVLink: how many ranks share a node, and the regions of device memory
// they share through CUDA IPC handles exchanged over the bootstrap (no privileges, as the nvlink backend maps its
// peers). What the kernels do with them is LocalGeometry's comment (proxy_kernels.hpp); docs/proxy.md has the design.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/proxy/proxy_kernels.hpp"
#include "epcomm/bootstrap.hpp"

namespace epcomm {
namespace gpuproxy {

/// Ranks per node, the same answer on every rank (a pure function of what every rank knows). `wanted` is
/// EPCOMM_PROXY_LOCAL_SIZE: when > 0 it must divide the world, and every block of `wanted` consecutive ranks must run
/// on one host (else kInvalidConfig naming the ranks and hosts); 0 counts the ranks of each host, which must form
/// blocks of consecutive ranks of one size (rank / size is the node), else the answer is 1 and `note` says why.
/// `hosts`: every rank's host name, by rank. 1 means no NVLink path (every peer over the fabric).
uint32_t chooseLocalSize(int64_t wanted, const std::vector<std::string>& hosts, std::string* note);

/// This rank's region and its node peers' regions as this process maps them. Movable only by pointer: one per object.
class LocalPeers {
 public:
  LocalPeers() = default;
  /// Releases what it still holds without the collective steps of close() (a setup that failed half-way).
  ~LocalPeers();
  LocalPeers(const LocalPeers&) = delete;
  LocalPeers& operator=(const LocalPeers&) = delete;

  /// Collective over `bootstrap`, on every rank of the world when lg.size > 1 (on every rank alike). Allocates and
  /// zeroes this rank's region (lg.bytes on `device`, the current device), exchanges its IPC handle and maps the node
  /// peers' regions. Every rank learns whether every other one succeeded: a failure anywhere throws on every rank
  /// (kUnavailable, or kCuda), naming the rank and what failed, after a collective release.
  void open(const LocalGeometry& lg, uint32_t rank, int device, Bootstrap& bootstrap);
  /// Collective teardown, each step closed by a barrier of every rank: (1) the caller synchronised its device, so
  /// after the first barrier no rank's kernel stores into a region; (2) every rank unmaps its peers' regions, and after
  /// the second barrier nobody maps this rank's region any more, which only then is freed (CUDA leaves freeing
  /// exported memory before its importers closed their mappings undefined). A barrier that fails (a peer is gone) is
  /// logged and the rest goes on without it: a dead process's mappings died with it. Nothing happens when not open.
  void close(Bootstrap& bootstrap);

  bool isOpen() const { return region_ != nullptr; }
  /// Every node rank's region by local index (this rank's own included), as this process addresses them.
  const std::vector<uint8_t*>& regions() const { return regions_; }
  uint8_t* mine() const { return static_cast<uint8_t*>(region_); }

 private:
  void release();

  uint32_t rank_ = 0;
  void* region_ = nullptr;     // cudaMalloc'd, exported
  std::vector<void*> mapped_;  // peers' regions (cudaIpcOpenMemHandle)
  std::vector<uint8_t*> regions_;
};

}  // namespace gpuproxy
}  // namespace epcomm
