// TransferEngine::create / probe: picks the libfabric or the libibverbs engine by provider name.
#include "epcomm/fabric/transfer_engine.hpp"

#include "core/env.hpp"
#include "core/log.hpp"
#include "epcomm/error.hpp"
#ifdef EPCOMM_HAVE_LIBFABRIC
#include "fabric/libfabric_engine.hpp"
#endif
#ifdef EPCOMM_HAVE_VERBS
#include "fabric/verbs_engine.hpp"
#endif

namespace epcomm {
namespace fabric {

namespace {
std::unique_ptr<TransferEngine> createNamed(const EngineOptions& options) {
  if (options.provider == "ibverbs") {
#ifdef EPCOMM_HAVE_VERBS
    return std::make_unique<VerbsEngine>(options);
#else
    EPCOMM_THROW(kNotBuilt, "the libibverbs TransferEngine was not built (libibverbs-dev missing at build time)");
#endif
  }
#ifdef EPCOMM_HAVE_LIBFABRIC
  return std::make_unique<LibfabricEngine>(options);
#else
  EPCOMM_THROW(kNotBuilt,
               "the libfabric TransferEngine was not built (libfabric-dev missing at build time); "
               "provider '"
                   << options.provider << "' unavailable");
#endif
}
}  // namespace

std::unique_ptr<TransferEngine> TransferEngine::create(const EngineOptions& options) {
  EngineOptions o = options;
  if (o.provider.empty()) o.provider = env().fabricProvider;
  if (o.progressCpu < 0) o.progressCpu = env().proxyCpu;
  if (!o.provider.empty()) return createNamed(o);
  // Probe: the fastest transport first; shm only reaches this host, so it comes last.
  std::string tried;
  for (const char* name : {"efa", "verbs", "tcp", "shm"}) {
    o.provider = name;
    try {
      return createNamed(o);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnavailable) throw;
      tried += std::string(tried.empty() ? "" : "; ") + e.message();
    }
  }
  EPCOMM_THROW(kUnavailable, "no usable fabric provider: " << tried);
}

std::vector<std::string> TransferEngine::probe() {
  std::vector<std::string> out;
#ifdef EPCOMM_HAVE_LIBFABRIC
  for (const std::string& p : LibfabricEngine::probeProviders()) out.push_back(p);
#endif
#ifdef EPCOMM_HAVE_VERBS
  for (const std::string& d : VerbsEngine::probeDevices()) out.push_back("ibverbs:" + d);
#endif
  return out;
}

}  // namespace fabric
}  // namespace epcomm
