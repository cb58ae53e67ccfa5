#include <unistd.h>

#include <cstring>
#include <vector>

#include "api/factory_detail.hpp"
#include "backends/backends.hpp"
#include "core/agreement.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"

namespace epcomm {

namespace {

struct BackendEntry {
  const char* name;
  bool built;
  bool singleNode;  ///< Every rank must run on one host (peer-mapped GPU memory).
  bool (*usable)(std::string*);
  std::unique_ptr<AllToAll> (*create)(const Config&, Bootstrap&);
};

// Preference order for "auto".
std::vector<BackendEntry> backendTable() {
  return {
#ifdef EPCOMM_HAVE_NVLINK_BACKEND
      {"nvlink", true, true, &backends::nvlinkUsable, &backends::createNvlink},
#else
      {"nvlink", false, true, nullptr, nullptr},
#endif
#ifdef EPCOMM_HAVE_NVSHMEM_BACKEND
      {"nvshmem", true, false, &backends::nvshmemUsable, &backends::createNvshmem},
#else
      {"nvshmem", false, false, nullptr, nullptr},
#endif
#ifdef EPCOMM_HAVE_PROXY_BACKEND
      {"proxy", true, false, &backends::proxyUsable, &backends::createProxy},
#else
      {"proxy", false, false, nullptr, nullptr},
#endif
#ifdef EPCOMM_HAVE_HOST_BACKEND
      {"host", true, false, &backends::hostUsable, &backends::createHost},
#else
      {"host", false, false, nullptr, nullptr},
#endif
  };
}

// Collective: true iff every rank can run the backend (and, for single-node backends, all ranks share one host);
// *whyNot names the first rank that cannot and why.
bool usableEverywhere(const BackendEntry& entry, Bootstrap& bootstrap, std::string* whyNot) {
  constexpr size_t kHostBytes = 64;
  constexpr size_t kBlobBytes = 256 + kHostBytes;  // [ok][reason ... ][hostname]
  std::string reason;
  bool ok = entry.usable(&reason);
  std::vector<char> mine(kBlobBytes, 0);
  mine[0] = ok ? 1 : 0;
  std::strncpy(mine.data() + 1, reason.c_str(), kBlobBytes - kHostBytes - 2);
  gethostname(mine.data() + kBlobBytes - kHostBytes, kHostBytes - 1);
  std::vector<char> all(kBlobBytes * bootstrap.worldSize());
  bootstrap.allGather(mine.data(), all.data(), kBlobBytes);
  std::vector<std::string> hosts;
  for (int r = 0; r < bootstrap.worldSize(); ++r) {
    const char* blob = all.data() + r * kBlobBytes;
    if (blob[0] == 0) {
      *whyNot = "rank " + std::to_string(r) + ": " + std::string(blob + 1);
      return false;
    }
    hosts.emplace_back(blob + kBlobBytes - kHostBytes);
  }
  return !entry.singleNode || detail::allOnOneHost(hosts, whyNot);
}

}  // namespace

namespace detail {
bool allOnOneHost(const std::vector<std::string>& hostOfRank, std::string* whyNot) {
  for (size_t r = 1; r < hostOfRank.size(); ++r) {
    if (hostOfRank[r] != hostOfRank[0]) {
      *whyNot = "ranks span several hosts (rank 0 on '" + hostOfRank[0] + "', rank " + std::to_string(r) + " on '" +
                hostOfRank[r] + "'); this backend needs all ranks on one node";
      return false;
    }
  }
  return true;
}
}  // namespace detail

std::vector<std::string> builtBackends() {
  std::vector<std::string> names;
  for (const BackendEntry& e : backendTable()) {
    if (e.built) names.emplace_back(e.name);
  }
  return names;
}

std::unique_ptr<AllToAll> createAllToAll(const Config& config, Bootstrap& bootstrap, const std::string& backend) {
  config.validate();
  EPCOMM_CHECK(
      static_cast<int>(config.worldSize) == bootstrap.worldSize(), kInvalidArgument,
      "config.worldSize = " << config.worldSize << " but the bootstrap has " << bootstrap.worldSize() << " ranks");
  EPCOMM_CHECK(static_cast<int>(config.rank) == bootstrap.rank(), kInvalidArgument,
               "config.rank = " << config.rank << " but the bootstrap says rank " << bootstrap.rank());
  setLogRank(bootstrap.rank());
  // Ranks whose configs differ would construct fine and then fail in the first round (or compute wrong results)
  // with errors that do not say why: compare them once, here, on every rank.
  checkSettingsAgree(bootstrap, "config", configSettings(config));
  std::string wanted = backend.empty() ? std::string("auto") : backend;
  if (wanted == "auto") wanted = env().backend;
  const std::vector<BackendEntry> table = backendTable();
  if (wanted == "auto") {
    std::string reasons;
    for (const BackendEntry& e : table) {
      if (!e.built) continue;
      std::string why;
      if (usableEverywhere(e, bootstrap, &why)) {
        EPCOMM_LOG(kInfo, "backend auto -> " << e.name);
        return e.create(config, bootstrap);
      }
      reasons += std::string(" ") + e.name + " (" + why + ");";
    }
    EPCOMM_THROW(kUnavailable, "no built backend can run here:" << reasons);
  }
  for (const BackendEntry& e : table) {
    if (wanted != e.name) continue;
    EPCOMM_CHECK(
        e.built, kNotBuilt, "backend '" << wanted << "' is not part of this build (built: " << [] {
          std::string s;
          for (const std::string& n : builtBackends()) s += (s.empty() ? "" : ", ") + n;
          return s.empty() ? std::string("none") : s;
        }() << ")");
    std::string why;
    EPCOMM_CHECK(usableEverywhere(e, bootstrap, &why), kUnavailable, "backend '" << wanted << "' cannot run: " << why);
    return e.create(config, bootstrap);
  }
  EPCOMM_THROW(kInvalidArgument, "unknown backend '" << wanted << "' (auto, nvlink, nvshmem, proxy, host)");
}

}  // namespace epcomm
