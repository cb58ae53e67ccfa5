#pragma once

#define EPCOMM_VERSION_MAJOR 0
#define EPCOMM_VERSION_MINOR 1
#define EPCOMM_VERSION_PATCH 0

namespace epcomm {
/// "0.1.0"
const char* versionString();
}  // namespace epcomm
