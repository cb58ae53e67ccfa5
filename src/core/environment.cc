// The public form of the EPCOMM_* table (core/env.cc holds the table itself).
#include "epcomm/environment.hpp"

#include "core/env.hpp"

namespace epcomm {

std::vector<EnvironmentVariable> environmentVariables() {
  std::vector<EnvironmentVariable> out;
  for (const EnvVar& v : envVars()) out.push_back({v.name, v.defaultValue, v.description});
  return out;
}

}  // namespace epcomm
