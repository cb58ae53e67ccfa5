// Owners of CUDA resources (device and pinned memory, IPC mappings, streams, events, graph executables): each releases
// what it holds when it goes out of scope, so an object whose setup throws half-way (a peer that never joins) leaks
// nothing, and the backend classes need no hand-written teardown of their buffers. LaunchMarks: an object's own
// outstanding work, for a synchronize() that waits for it and not for the whole device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/cuda_check.hpp"

namespace epcomm {
namespace cuda {

/// Sole owner of one CUDA handle, released with `Release` (its error ignored: a destructor cannot report it, and after
/// a device error every release fails the same way). Movable, not copyable; a null handle owns nothing.
template <typename Handle, cudaError_t (*Release)(Handle)>
class CudaOwner {
 public:
  CudaOwner() = default;
  explicit CudaOwner(Handle h) : h_(h) {}
  ~CudaOwner() { reset(); }
  CudaOwner(CudaOwner&& o) noexcept : h_(std::exchange(o.h_, Handle{})) {}
  CudaOwner& operator=(CudaOwner&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, Handle{});
    }
    return *this;
  }
  CudaOwner(const CudaOwner&) = delete;
  CudaOwner& operator=(const CudaOwner&) = delete;

  Handle get() const { return h_; }
  explicit operator bool() const { return h_ != Handle{}; }
  /// Releases the handle now (if any).
  void reset() {
    if (h_ != Handle{}) Release(std::exchange(h_, Handle{}));
  }

 private:
  Handle h_{};
};

using DeviceMemory = CudaOwner<void*, cudaFree>;             ///< cudaMalloc'd memory
using PinnedMemory = CudaOwner<void*, cudaFreeHost>;         ///< cudaHostAlloc'd memory
using IpcMapping = CudaOwner<void*, cudaIpcCloseMemHandle>;  ///< a peer's memory opened with cudaIpcOpenMemHandle
using Stream = CudaOwner<cudaStream_t, cudaStreamDestroy>;
using Event = CudaOwner<cudaEvent_t, cudaEventDestroy>;
using GraphExec = CudaOwner<cudaGraphExec_t, cudaGraphExecDestroy>;

/// `bytes` of device memory on the current device. Throws Error(kCuda).
inline DeviceMemory allocDevice(size_t bytes) {
  void* p = nullptr;
  EPCOMM_CHECK_CUDA(cudaMalloc(&p, bytes));
  return DeviceMemory(p);
}

/// `bytes` of pinned host memory, mapped into the device's address space (cudaHostGetDevicePointer). Throws.
inline PinnedMemory allocPinnedMapped(size_t bytes) {
  void* p = nullptr;
  EPCOMM_CHECK_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocMapped));
  return PinnedMemory(p);
}

/// Host memory registered with CUDA (cudaHostRegister), unregistered on release.
using HostRegistration = CudaOwner<void*, cudaHostUnregister>;

/// Registers `bytes` at `p` (page-aligned host memory the caller owns, e.g. a shared memory mapping) as pinned and
/// mapped into the device's address space (cudaHostGetDevicePointer); unregistered when the owner goes. Throws.
inline HostRegistration registerMapped(void* p, size_t bytes) {
  EPCOMM_CHECK_CUDA(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  return HostRegistration(p);
}

/// A stream that does not synchronise with the legacy default stream. Throws.
inline Stream makeStream() {
  cudaStream_t s = nullptr;
  EPCOMM_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(s);
}

/// Whether `stream` is capturing a CUDA graph (or cannot be asked: treated as capturing, so nothing is recorded on it).
inline bool isCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return capture != cudaStreamCaptureStatusNone;
}

/// An object's outstanding work: per stream it launched on, an event recorded after its last launch there. Waiting for
/// them waits for the object's own kernels (and what preceded them on those streams), not for the whole device.
/// Events rather than remembered streams: the caller may destroy a stream before the object waits.
class LaunchMarks {
 public:
  /// Records the mark of a launch just made on `stream` (not a capturing one: that launch is a node of the caller's
  /// graph, which the caller runs and waits for). Returns the cudaError_t.
  cudaError_t mark(cudaStream_t stream) {
    Mark* m = nullptr;
    for (Mark& x : marks_) {
      if (x.stream == stream) m = &x;
    }
    cudaError_t e = cudaSuccess;
    if (m == nullptr) m = reuseOrAdd(stream, e);
    if (m == nullptr) return e;
    e = cudaEventRecord(m->event.get(), stream);
    m->pending = e == cudaSuccess;
    return e;
  }

  /// mark() for a launch just made on `stream`, unless the stream is capturing a graph. Throws Error(kCuda)
  /// "<prefix>rank <rank>: recording the <what> kernel's completion event failed: ...".
  void markLaunch(cudaStream_t stream, const char* prefix, uint32_t rank, const char* what) {
    if (isCapturing(stream)) return;
    const cudaError_t e = mark(stream);
    EPCOMM_CHECK(e == cudaSuccess, kCuda,
                 prefix << "rank " << rank << ": recording the " << what
                        << " kernel's completion event failed: " << cudaGetErrorString(e));
  }

  /// Blocks until every marked launch completed; returns the first error (a failed kernel's, for instance).
  cudaError_t wait() {
    cudaError_t first = cudaSuccess;
    for (Mark& m : marks_) {
      if (!m.pending) continue;
      const cudaError_t e = cudaEventSynchronize(m.event.get());
      if (first == cudaSuccess) first = e;
      m.pending = false;
    }
    return first;
  }

 private:
  struct Mark {
    cudaStream_t stream;
    Event event;
    bool pending;
  };
  // Marks of more streams than this are reclaimed once their launches completed (a caller that rotates through a
  // pool of streams), so the list follows the streams with work in flight.
  static constexpr size_t kReclaimAbove = 8;

  // A mark for `stream`: a completed one reclaimed, or a new one (null, with `err` set, if no event could be made).
  Mark* reuseOrAdd(cudaStream_t stream, cudaError_t& err) {
    if (marks_.size() >= kReclaimAbove) {
      for (Mark& x : marks_) {
        const cudaError_t e = x.pending ? cudaEventQuery(x.event.get()) : cudaSuccess;
        if (e == cudaErrorNotReady) cudaGetLastError();  // not an error; leave no trace of it for the caller
        if (e != cudaSuccess) continue;
        x.stream = stream;
        x.pending = false;
        return &x;
      }
    }
    cudaEvent_t ev = nullptr;
    err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (err != cudaSuccess) return nullptr;
    marks_.push_back(Mark{stream, Event(ev), false});
    return &marks_.back();
  }

  std::vector<Mark> marks_;
};

}  // namespace cuda
}  // namespace epcomm
