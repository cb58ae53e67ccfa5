// Whether a libfabric provider works on this machine, for tests that skip without it.
#pragma once

#include <string>

namespace epcomm {
namespace test {

/// True when a TransferEngine can be created on `provider` ("tcp", "shm", ...). Probed once per provider in a child
/// process (so the test process itself never initialises libfabric before forking ranks) and cached.
bool providerAvailable(const std::string& provider);

}  // namespace test
}  // namespace epcomm

/// Skips the current GoogleTest case when `provider` is not usable here.
#define SKIP_WITHOUT(provider)                      \
  if (!::epcomm::test::providerAvailable(provider)) \
  GTEST_SKIP() << "libfabric provider '" << provider << "' is not usable here"
