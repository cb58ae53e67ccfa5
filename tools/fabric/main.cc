// epcomm-fabric-probe: which TransferEngine providers work on this machine. For each candidate (libfabric efa,
// verbs, tcp, shm and the libibverbs engine) it opens an engine and reports the provider libfabric chose, or why
// it is unusable. Exit status 0 when at least one provider works.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"

int main(int argc, char** argv) {
  using epcomm::fabric::EngineOptions;
  using epcomm::fabric::TransferEngine;
  if (argc > 1 && (std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0)) {
    std::printf("usage: epcomm-fabric-probe\n  Lists usable libfabric providers (fi_getinfo) and verbs devices.\n");
    return 0;
  }
  std::printf("fi_getinfo / ibv_get_device_list report:\n");
  std::vector<std::string> names = TransferEngine::probe();
  if (names.empty()) std::printf("  (nothing)\n");
  for (const std::string& n : names) std::printf("  %s\n", n.c_str());
  std::printf("\nopening a TransferEngine per provider:\n");
  int usable = 0;
  for (const char* name : {"efa", "verbs", "tcp", "shm", "ibverbs"}) {
    EngineOptions o;
    o.provider = name;
    o.timeoutMs = 2000;
    try {
      auto engine = TransferEngine::create(o);
      std::printf("  %-8s usable   (%s, address %zu bytes)\n", name, engine->providerName().c_str(),
                  engine->address().size());
      ++usable;
    } catch (const epcomm::Error& e) {
      std::printf("  %-8s unusable (%s: %s)\n", name, epcomm::errorCodeName(e.code()), e.message().c_str());
    }
  }
  return usable > 0 ? 0 : 1;
}
