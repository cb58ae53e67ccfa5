// Test helper: runs a callable and checks it throws epcomm::Error with a code and message fragments.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "epcomm/error.hpp"

namespace epcomm {
namespace testing {

/// Expects `fn()` to throw Error with `code` whose message contains every string of `parts`.
template <typename Fn>
void expectError(Fn&& fn, ErrorCode code, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code))
        << "got " << errorCodeName(e.code()) << ", expected " << errorCodeName(code) << ": " << e.what();
    for (const std::string& p : parts) {
      EXPECT_NE(e.message().find(p), std::string::npos) << "message '" << e.message() << "' lacks '" << p << "'";
    }
    return;
  }
  ADD_FAILURE() << "no epcomm::Error thrown (expected " << errorCodeName(code) << ")";
}

}  // namespace testing
}  // namespace epcomm
