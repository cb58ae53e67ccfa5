#include "support/fabric_probe.hpp"

#include <unistd.h>

#include <map>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace test {

bool providerAvailable(const std::string& provider) {
  static std::map<std::string, bool> cache;
  auto it = cache.find(provider);
  if (it != cache.end()) return it->second;
  RunResult r = runProcesses(1, [&](int) {
    fabric::EngineOptions eo;
    eo.provider = provider;
    try {
      fabric::TransferEngine::create(eo);
    } catch (const Error&) {
      _exit(3);
    }
  });
  return cache[provider] = r.allOk();
}

}  // namespace test
}  // namespace epcomm
