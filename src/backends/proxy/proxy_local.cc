#include "backends/proxy/proxy_local.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

#include "core/cuda_check.hpp"
#include "core/log.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace gpuproxy {

uint32_t chooseLocalSize(int64_t wanted, const std::vector<std::string>& hosts, std::string* note) {
  const uint64_t W = hosts.size();
  EPCOMM_CHECK(wanted >= 0 && (wanted == 0 || (wanted <= static_cast<int64_t>(W) && W % wanted == 0)), kInvalidConfig,
               "EPCOMM_PROXY_LOCAL_SIZE = " << wanted << " must be 0 (from the host names) or divide worldSize " << W);
  if (wanted > 0) {
    const uint64_t n = static_cast<uint64_t>(wanted);
    for (uint64_t r = 0; r < W; ++r) {
      const uint64_t first = r / n * n;
      EPCOMM_CHECK(hosts[r] == hosts[first], kInvalidConfig,
                   "EPCOMM_PROXY_LOCAL_SIZE = " << wanted << " puts ranks " << first << " to " << first + n - 1
                                                << " on one node, but rank " << first << " runs on '" << hosts[first]
                                                << "' and rank " << r << " on '" << hosts[r]
                                                << "' (ranks are grouped by node: rank / EPCOMM_PROXY_LOCAL_SIZE)");
    }
    return static_cast<uint32_t>(n);
  }
  // From the host names: every host one block of consecutive ranks, every block the same size.
  std::map<std::string, uint64_t> perHost;
  for (const std::string& h : hosts) ++perHost[h];
  const uint64_t n = perHost[hosts.empty() ? std::string() : hosts[0]];
  bool grouped = n > 0 && W % n == 0;
  for (uint64_t r = 0; grouped && r < W; ++r) {
    grouped = hosts[r] == hosts[r / n * n] && perHost[hosts[r]] == n;
  }
  if (!grouped) {
    if (note != nullptr) {
      *note =
          "the ranks are not grouped by host in blocks of one size (rank / ranks per node), so every peer goes "
          "over the fabric; EPCOMM_PROXY_LOCAL_SIZE sets the grouping";
    }
    return 1;
  }
  return static_cast<uint32_t>(n);
}

namespace {

/// What each rank publishes at open: its region's handle and device, or why it has none.
struct RegionInfo {
  cudaIpcMemHandle_t handle;
  int32_t device;
  int32_t ok;
  char what[216];
};

/// Whether every rank succeeded a step; one more all-gather, so that all ranks fail together.
struct StepStatus {
  int32_t ok;
  char what[252];
};

void copyWhat(char* dst, size_t cap, const std::string& text) {
  const size_t n = std::min(cap - 1, text.size());
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

// The first failure among every rank's (ok, what), or "".
template <typename T>
std::string firstFailure(const std::vector<T>& all, const char* step) {
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].ok == 0) {
      std::ostringstream oss;
      oss << "proxy backend: rank " << r << " " << step << ": " << all[r].what;
      return oss.str();
    }
  }
  return {};
}

}  // namespace

void LocalPeers::open(const LocalGeometry& lg, uint32_t rank, int device, Bootstrap& bootstrap) {
  rank_ = rank;
  const uint32_t W = static_cast<uint32_t>(bootstrap.worldSize());
  RegionInfo mine{};
  mine.device = device;
  mine.ok = 1;
  try {
    EPCOMM_CHECK_CUDA(cudaMalloc(&region_, lg.bytes));
    // Zeroed (the flags above all) before any peer can map it: the exchange below follows the synchronisation.
    EPCOMM_CHECK_CUDA(cudaMemset(region_, 0, lg.bytes));
    EPCOMM_CHECK_CUDA(cudaDeviceSynchronize());
    EPCOMM_CHECK_CUDA(cudaIpcGetMemHandle(&mine.handle, region_));
  } catch (const Error& e) {
    mine.ok = 0;
    copyWhat(mine.what, sizeof(mine.what), e.message());
  }
  std::vector<RegionInfo> all(W);
  bootstrap.allGather(&mine, all.data(), sizeof(RegionInfo));
  const std::string exportFailure = firstFailure(all, "could not export its NVLink region");

  StepStatus status{};
  status.ok = 1;
  if (exportFailure.empty()) {
    regions_.assign(lg.size, nullptr);
    try {
      for (uint32_t i = 0; i < lg.size; ++i) {
        const uint32_t r = lg.first + i;
        if (r == rank) {
          regions_[i] = static_cast<uint8_t*>(region_);
          continue;
        }
        if (all[r].device != device) {
          int can = 0;
          EPCOMM_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, device, all[r].device));
          EPCOMM_CHECK(can != 0, kUnavailable,
                       "GPU " << device << " cannot access GPU " << all[r].device << " of rank " << r
                              << " (no NVLink or PCIe peer access): EPCOMM_PROXY_LOCAL_SIZE=1 sends every peer over "
                                 "the fabric");
        }
        void* p = nullptr;
        EPCOMM_CHECK_CUDA(cudaIpcOpenMemHandle(&p, all[r].handle, cudaIpcMemLazyEnablePeerAccess));
        mapped_.push_back(p);
        regions_[i] = static_cast<uint8_t*>(p);
      }
    } catch (const Error& e) {
      status.ok = 0;
      copyWhat(status.what, sizeof(status.what), e.message());
    }
  }
  // Also the barrier after which peers store into this rank's region: every rank has zeroed its own and mapped its
  // peers' by then.
  std::vector<StepStatus> statuses(W);
  bootstrap.allGather(&status, statuses.data(), sizeof(StepStatus));
  const std::string mapFailure = firstFailure(statuses, "could not map a node peer's NVLink region");
  if (exportFailure.empty() && mapFailure.empty()) return;
  // Every rank fails here together. Regions some rank may have mapped are released collectively (none is freed while
  // mapped); when the export failed, nobody mapped anything.
  if (exportFailure.empty()) {
    close(bootstrap);
  } else {
    release();
  }
  EPCOMM_THROW(kUnavailable, (exportFailure.empty() ? mapFailure : exportFailure));
}

void LocalPeers::close(Bootstrap& bootstrap) {
  if (region_ == nullptr && mapped_.empty()) return;
  auto barrier = [&](const char* when) {
    try {
      bootstrap.barrier();
      return true;
    } catch (const std::exception& e) {
      EPCOMM_LOG(kWarn,
                 "proxy backend rank " << rank_ << ": NVLink teardown barrier " << when << " failed: " << e.what());
      return false;
    }
  };
  const bool together = barrier("after the last kernels");
  for (void* p : mapped_) {
    const cudaError_t e = cudaIpcCloseMemHandle(p);
    if (e != cudaSuccess) {
      EPCOMM_LOG(kWarn, "proxy backend rank " << rank_ << ": cudaIpcCloseMemHandle of a node peer's region failed: "
                                              << cudaGetErrorString(e));
      cudaGetLastError();
    }
  }
  mapped_.clear();
  if (together) barrier("after unmapping the node peers' regions");
  release();
}

void LocalPeers::release() {
  for (void* p : mapped_) cudaIpcCloseMemHandle(p);
  mapped_.clear();
  if (region_ != nullptr) cudaFree(region_);
  region_ = nullptr;
  regions_.clear();
  cudaGetLastError();
}

LocalPeers::~LocalPeers() { release(); }

}  // namespace gpuproxy
}  // namespace epcomm
