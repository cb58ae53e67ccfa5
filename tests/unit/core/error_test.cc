// Errors carry the throw site relative to the project, not the build machine's absolute path.
#include "epcomm/error.hpp"

#include <gtest/gtest.h>

#include <string>

#include "epcomm/config.hpp"

namespace epcomm {
namespace {

TEST(Error, ThrowSiteIsRelativeToTheProject) {
  try {
    EPCOMM_THROW(kInvalidArgument, "x has " << 3 << " rows");
  } catch (const Error& e) {
    EXPECT_STREQ(e.file(), "tests/unit/core/error_test.cc");
    EXPECT_EQ(e.message(), "x has 3 rows");
    EXPECT_EQ(std::string(e.what()).rfind("epcomm invalid_argument at tests/unit/core/error_test.cc:", 0), 0u)
        << e.what();
  }
  // Thrown inside the library.
  try {
    Config c;
    c.validate();
    ADD_FAILURE() << "an empty config validated";
  } catch (const Error& e) {
    EXPECT_STREQ(e.file(), "src/core/config.cc");
    EXPECT_NE(std::string(e.what()).find(" at src/core/config.cc:"), std::string::npos) << e.what();
  }
  // A path outside the project stays as given.
  const Error outside(ErrorCode::kInternal, "m", "/elsewhere/file.cc", 7);
  EXPECT_STREQ(outside.file(), "/elsewhere/file.cc");
}

}  // namespace
}  // namespace epcomm
