#include "backends/nvlink/nvlink_launch.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/log.hpp"

namespace epcomm {
namespace nvlink {

namespace {

// FNV-1a over 8-byte words (the argument structs are a few hundred bytes, zero-filled, 8-byte aligned).
uint64_t hashArgs(const KernelLaunch& l, const void* args, size_t bytes) {
  uint64_t h = 1469598103934665603ull ^ reinterpret_cast<uintptr_t>(l.fn) ^ (static_cast<uint64_t>(l.smemBytes) << 32);
  const unsigned char* p = static_cast<const unsigned char*>(args);
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, std::min<size_t>(8, bytes - i));
    h = (h ^ w) * 1099511628211ull;
  }
  return h;
}

}  // namespace

GraphExec GraphLaunchCache::instantiate(const KernelLaunch& l, const void* args) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaKernelNodeParams p{};
  p.func = const_cast<void*>(l.fn);
  p.gridDim = dim3(l.blocks);
  p.blockDim = dim3(l.threads);
  p.sharedMemBytes = l.smemBytes;
  void* params[] = {const_cast<void*>(args)};
  p.kernelParams = params;
  cudaGraphNode_t node = nullptr;
  cudaError_t e = cudaGraphCreate(&graph, 0);
  if (e == cudaSuccess) e = cudaGraphAddKernelNode(&node, graph, nullptr, 0, &p);
  if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    cudaGetLastError();
    EPCOMM_LOG(kWarn, "nvlink: a cached launch graph could not be made ("
                          << cudaGetErrorString(e) << "); launching kernels plainly from now on");
    enabled_ = false;
    return GraphExec();
  }
  return GraphExec(exec);
}

bool GraphLaunchCache::matches(const Entry& e, const KernelLaunch& l, const void* args, size_t bytes) {
  return e.fn == l.fn && e.smemBytes == l.smemBytes && e.args.size() == bytes &&
         std::memcmp(e.args.data(), args, bytes) == 0;
}

int GraphLaunchCache::launchEntry(size_t i, cudaStream_t stream) {
  entries_[i].lastUse = clock_;
  // Move i to the front of recent_ (it may already be there).
  size_t carry = i;
  for (size_t& r : recent_) {
    std::swap(r, carry);
    if (carry == i) break;
  }
  ++graphLaunches_;
  return static_cast<int>(cudaGraphLaunch(entries_[i].exec.get(), stream));
}

int GraphLaunchCache::launch(const KernelLaunch& l, const void* args, size_t bytes, cudaStream_t stream) {
  if (!enabled_) return launchKernel(l, args, stream);
  if (isCapturing(stream)) return launchKernel(l, args, stream);
  ++clock_;
  for (size_t i : recent_) {
    if (i != kNone && matches(entries_[i], l, args, bytes)) return launchEntry(i, stream);
  }
  const uint64_t h = hashArgs(l, args, bytes);
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].hash == h && matches(entries_[i], l, args, bytes)) return launchEntry(i, stream);
  }
  // First sighting: remembered, launched plainly (arguments that never repeat cost no instantiation).
  if (std::find(seen_.begin(), seen_.end(), h) == seen_.end()) {
    seen_[seenNext_++ % kSeen] = h;
    return launchKernel(l, args, stream);
  }
  GraphExec exec = instantiate(l, args);
  if (!exec) return launchKernel(l, args, stream);
  if (entries_.size() == kEntries) {
    auto lru = std::min_element(entries_.begin(), entries_.end(),
                                [](const Entry& a, const Entry& b) { return a.lastUse < b.lastUse; });
    entries_.erase(lru);
    recent_.fill(kNone);  // the indices after the erased entry moved
  }
  const unsigned char* p = static_cast<const unsigned char*>(args);
  entries_.push_back(Entry{h, l.fn, l.smemBytes, std::vector<unsigned char>(p, p + bytes), std::move(exec), clock_});
  return launchEntry(entries_.size() - 1, stream);
}

}  // namespace nvlink
}  // namespace epcomm
