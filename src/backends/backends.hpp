// Entry points of the backends, called only by the factory (src/api/factory.cc). A backend that is built
// defines EPCOMM_HAVE_<NAME>_BACKEND on the epcomm target.
#pragma once

#include <memory>
#include <string>

#include "epcomm/all_to_all.hpp"

namespace epcomm {
namespace backends {

/// Local (non-collective) check whether this process can run the backend; on false, *whyNot says why.
bool hostUsable(std::string* whyNot);
/// Collective: creates the host backend object (CPU loops + TransferEngine).
std::unique_ptr<AllToAll> createHost(const Config& config, Bootstrap& bootstrap);

bool nvlinkUsable(std::string* whyNot);
std::unique_ptr<AllToAll> createNvlink(const Config& config, Bootstrap& bootstrap);

/// NVSHMEM kernels (symmetric heap, put-with-signal); NVSHMEM is initialised once per process from the bootstrap.
bool nvshmemUsable(std::string* whyNot);
std::unique_ptr<AllToAll> createNvshmem(const Config& config, Bootstrap& bootstrap);

/// GPU kernels + a host proxy thread over the TransferEngine; NVLink for same-node peers.
bool proxyUsable(std::string* whyNot);
std::unique_ptr<AllToAll> createProxy(const Config& config, Bootstrap& bootstrap);

}  // namespace backends
}  // namespace epcomm

#include <vector>
#include "epcomm/plan.hpp"

namespace epcomm {
namespace backends {
/// The backend's own buffers for a config (the planner adds the caller's outputs). Pure arithmetic, no allocation.
std::vector<PlannedBuffer> planHost(const Config& config);
std::vector<PlannedBuffer> planNvlink(const Config& config);
std::vector<PlannedBuffer> planNvshmem(const Config& config);
std::vector<PlannedBuffer> planProxy(const Config& config);
}  // namespace backends
}  // namespace epcomm
