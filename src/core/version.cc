#include "epcomm/version.hpp"

namespace epcomm {
const char* versionString() { return "0.1.0"; }
}  // namespace epcomm
