// The CUDA resource owners the nvlink backend uses (core/cuda_resources.hpp), under the names its code uses.
#pragma once

#include "core/cuda_resources.hpp"

namespace epcomm {
namespace nvlink {

using cuda::allocDevice;
using cuda::allocPinnedMapped;
using cuda::CudaOwner;
using cuda::DeviceMemory;
using cuda::Event;
using cuda::GraphExec;
using cuda::HostRegistration;
using cuda::IpcMapping;
using cuda::isCapturing;
using cuda::LaunchMarks;
using cuda::makeStream;
using cuda::PinnedMemory;
using cuda::registerMapped;
using cuda::Stream;

}  // namespace nvlink
}  // namespace epcomm
