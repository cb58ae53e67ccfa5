// The EPCOMM_* environment variables the library reads, as data: for documentation, tools and bindings.
#pragma once

#include <string>
#include <vector>

namespace epcomm {

/// One EPCOMM_* variable: its name, its default ("" when unset means something documented in the description) and
/// what it does.
struct EnvironmentVariable {
  std::string name;
  std::string defaultValue;
  std::string description;
};

/// Every EPCOMM_* variable the library reads, in the order of its table (the README's list comes from the same
/// table through `epcomm-plan --env`).
std::vector<EnvironmentVariable> environmentVariables();

}  // namespace epcomm
