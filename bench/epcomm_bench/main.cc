// epcomm-bench: dispatch / combine times of any backend beside NCCL's all-to-all of the same bytes (and, for
// backends built on a fabric, beside a dense all-to-all over the same provider). `epcomm-bench --help` and
// bench/README.md describe the options and the method.
//
// The binary is both the launcher (started by the user: options.cc, launcher.cc) and every rank (started by the
// launcher with EPBENCH_CHILD set: bench.cc, with timing.cc, baselines.cc and report.cc).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "bench.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "launcher.hpp"
#include "options.hpp"

int main(int argc, char** argv) {
  const bool child = std::getenv("EPBENCH_CHILD") != nullptr;
  try {
    epcomm::bench::Options o = epcomm::bench::parseOptions(argc, argv);
    if (o.help) {
      std::cout << epcomm::bench::usage();
      return 0;
    }
    if (o.listBackends) {
      for (const std::string& b : epcomm::builtBackends()) std::cout << b << "\n";
      return 0;
    }
    if (!child) return epcomm::bench::launchRanks(argc, argv, o);
    std::unique_ptr<epcomm::Bootstrap> bs = epcomm::createBootstrapFromEnv();
    epcomm::bench::Bench(o, *bs).run();
    return 0;
  } catch (const std::exception& e) {
    // A rank started by the launcher hands its message to the launcher, which prints it with the rank's fate.
    std::string msg = std::string(e.what()) + "\n";
    const char* errFd = std::getenv("EPBENCH_ERR_FD");
    if (child && errFd != nullptr) {
      if (msg.size() > 16000) msg = msg.substr(0, 16000) + "...\n";  // stays below the pipe's capacity
      if (write(std::atoi(errFd), msg.data(), msg.size()) == static_cast<ssize_t>(msg.size())) return 1;
    }
    const char* rank = std::getenv("EPCOMM_RANK");
    if (child && rank != nullptr) msg = "rank " + std::string(rank) + ": " + msg;
    std::cerr << "epcomm-bench: " << msg;
    return 1;
  }
}
