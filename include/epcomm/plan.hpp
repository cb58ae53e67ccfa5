// Memory planner: every buffer a configuration needs, before anything is allocated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/config.hpp"

namespace epcomm {

/// One buffer of a plan.
struct PlannedBuffer {
  std::string owner;   ///< "outputs" (caller-allocated tensors) or the backend name.
  std::string name;    ///< e.g. "outExpertX", "recv buffer".
  std::string memory;  ///< "device", "host pinned", "host", "device (peer-mapped)".
  uint64_t bytes = 0;
  std::string note;  ///< Shape or formula.
};

/// Buffers for `config` on `backend` ("" = outputs only): the caller's output tensors, then the backend's own.
/// Throws kInvalidConfig for a bad config, kInvalidArgument for an unknown backend.
std::vector<PlannedBuffer> planBuffers(const Config& config, const std::string& backend);

/// The plan as a printed table with a total per GPU.
std::string formatPlan(const Config& config, const std::string& backend, const std::vector<PlannedBuffer>& plan);

}  // namespace epcomm
