// Uses only the installed public headers and library: builds the standard "decode" configuration, validates it,
// prints it, and checks that errors arrive as epcomm::Error.
#include <epcomm/epcomm.hpp>

#include <iostream>

int main() {
  epcomm::Config config = epcomm::standardConfig("decode", /*worldSize=*/8, /*rank=*/0);
  config.validate();
  std::cout << "epcomm " << epcomm::versionString() << " decode: " << config.toString() << "\n";

  epcomm::Config bad = config;
  bad.worldSize = 3;  // 256 experts do not split over 3 ranks.
  try {
    bad.validate();
    std::cerr << "error: an invalid config was accepted\n";
    return 1;
  } catch (const epcomm::Error& e) {
    std::cout << "invalid config rejected: " << e.message() << "\n";
  }

  std::unique_ptr<epcomm::Bootstrap> self = epcomm::createSelfBootstrap();
  int mine = 7, all = 0;
  self->allGather(&mine, &all, sizeof(int));
  if (all != 7) {
    std::cerr << "error: self bootstrap allGather returned " << all << "\n";
    return 1;
  }
  std::cout << "consumer ok\n";
  return 0;
}
