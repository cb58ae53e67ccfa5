// Umbrella header of the public C++ API.
#pragma once

#include "epcomm/all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "epcomm/config.hpp"
#include "epcomm/error.hpp"
#include "epcomm/tensor.hpp"
#include "epcomm/version.hpp"
