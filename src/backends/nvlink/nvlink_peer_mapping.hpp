// The peers' regions one process has mapped through CUDA IPC (the nvlink backend's PeerMapping).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

#include "backends/nvlink/nvlink_cuda.hpp"
#include "core/cuda_check.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace nvlink {

// The peers' regions this process has mapped (cudaIpcOpenMemHandle), by address. A handle that is already open in a
// context is not mapped again: the driver returns the existing address and counts a reference. Two objects never share
// a region, so an address already in the set means the driver took a new handle for one this process has open, a
// mapping of memory its exporter freed (CUDA leaves freeing exported memory before the importers closed their mappings
// undefined): refused, rather than handed to kernels that would store into it.
class PeerMapping {
 public:
  PeerMapping() = default;
  ~PeerMapping() { reset(); }
  PeerMapping(PeerMapping&& o) noexcept : map_(std::move(o.map_)) {}
  PeerMapping& operator=(PeerMapping&&) = delete;
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  /// Maps `handle` (rank `peer`'s region) for rank `me`. Throws Error(kCuda) when the driver fails, Error(kInternal)
  /// when it returns an address this process has mapped already.
  static PeerMapping open(const cudaIpcMemHandle_t& handle, uint32_t me, uint32_t peer) {
    void* p = nullptr;
    EPCOMM_CHECK_CUDA(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess));
    PeerMapping m;
    std::lock_guard<std::mutex> lock(registryMutex());
    if (!registry().insert(p).second) {
      cudaIpcCloseMemHandle(p);  // drops the reference this open took; the earlier one stays with its owner
      EPCOMM_THROW(kInternal, "rank " << me << ": the IPC handle of rank " << peer << "'s region opened at " << p
                                      << ", an address this process has mapped already (a stale mapping of freed "
                                         "memory); refusing to use it");
    }
    m.map_ = IpcMapping(p);
    return m;
  }

  char* get() const { return static_cast<char*>(map_.get()); }

  /// Unmaps (if mapped). Returns the cudaError_t of cudaIpcCloseMemHandle (cudaSuccess when nothing was mapped).
  cudaError_t reset() {
    if (!map_) return cudaSuccess;
    void* p = map_.get();
    {
      std::lock_guard<std::mutex> lock(registryMutex());
      registry().erase(p);
    }
    cudaGetLastError();
    map_.reset();
    return cudaGetLastError();
  }

 private:
  static std::mutex& registryMutex() {
    static std::mutex* mu = new std::mutex;  // never destroyed: objects may outlive static destructors
    return *mu;
  }
  static std::set<const void*>& registry() {
    static auto* r = new std::set<const void*>;
    return *r;
  }

  IpcMapping map_;
};

}  // namespace nvlink
}  // namespace epcomm
