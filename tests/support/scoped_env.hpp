// Environment variables in tests: ScopedEnv sets some for one scope and restores them afterwards (the previous value,
// or unset); envNumber reads a test's numeric knob. epcomm reads its variables once per process (core/env.hpp), so a
// test that forks ranks sets them before the fork, and a unit test calls readEnv() itself.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace epcomm {
namespace test {

class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& v : vars) {
      const char* old = std::getenv(v.first);
      saved_.emplace_back(v.first, old != nullptr ? std::make_unique<std::string>(old) : nullptr);
      setenv(v.first, v.second, 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& v : saved_) {
      if (v.second != nullptr) {
        setenv(v.first, v.second->c_str(), 1);
      } else {
        unsetenv(v.first);
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::vector<std::pair<const char*, std::unique_ptr<std::string>>> saved_;
};

/// The numeric value of environment variable `name`, or `fallback` when unset or empty.
inline uint64_t envNumber(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

}  // namespace test
}  // namespace epcomm
