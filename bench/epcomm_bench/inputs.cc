#include "inputs.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include "bench_cuda.hpp"
#include "epcomm/reference.hpp"
#include "fill.hpp"
#include "kernels.hpp"

namespace epcomm {
namespace bench {
namespace {

// Seed of DP group g's routing: the ranks of one group route alike, the groups differently.
uint64_t routingSeed(uint32_t group) { return 12345 + group; }

}  // namespace

void* Inputs::alloc(size_t bytes) {
  void* p = nullptr;
  bytes = (std::max<size_t>(bytes, 256) + 255) / 256 * 256;
  if (device_) {
    BENCH_CUDA(cudaMalloc(&p, bytes));
  } else {
    p = std::aligned_alloc(256, bytes);
    EPCOMM_CHECK(p != nullptr, kSystem, "out of host memory for " << bytes << " bytes of benchmark tensors");
  }
  owned_.push_back(p);
  return p;
}

void Inputs::upload(void* dst, const void* src, size_t bytes) {
  if (device_) {
    BENCH_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  } else {
    std::memcpy(dst, src, bytes);
  }
}

Inputs::~Inputs() {
  for (void* p : owned_) {
    if (device_) {
      cudaFree(p);
    } else {
      std::free(p);
    }
  }
}

Inputs::Inputs(const Config& c, uint32_t T, bool device, cudaStream_t stream) : device_(device), tokens_(T) {
  const MemoryKind mk = device ? MemoryKind::kCuda : MemoryKind::kHost;
  int dev = -1;
  if (device) BENCH_CUDA(cudaGetDevice(&dev));
  const int64_t K = c.expertsPerToken, L = c.numLocalExperts(), H = c.hiddenDim, S = c.hiddenDimScaleBytes / 4;
  const bool batched = c.layout == Layout::kBatched;
  const int64_t R = static_cast<int64_t>(c.batchedRowsPerExpert());
  // Batched: L * R rows in all (expertRows() is the rows of one expert there).
  const int64_t rows = batched ? L * R : static_cast<int64_t>(c.expertRows());
  const DType xType = c.hiddenDimBytes == c.hiddenDim ? DType::kFp8E4M3 : DType::kBf16;
  const int64_t xCols = c.hiddenDimBytes / dtypeSize(xType);
  // One DP group's tokens are identical on its ranks.
  const uint32_t group = c.dpGroup();
  indices = reference::randomIndices(c, T, routingSeed(group));
  std::mt19937 rng(777 + group);
  std::vector<uint8_t> xh(static_cast<size_t>(T) * c.hiddenDimBytes);
  for (auto& b : xh) b = static_cast<uint8_t>(rng() & 0x7f);
  std::vector<float> sh(static_cast<size_t>(T) * S + 1, 1.0f), wh(static_cast<size_t>(T) * K, 1.0f / K);
  void* x = alloc(xh.size());
  upload(x, xh.data(), xh.size());
  void* xs = S ? alloc(sh.size() * 4) : nullptr;
  if (xs) upload(xs, sh.data(), sh.size() * 4);
  void* ind = alloc(indices.size() * 4);
  upload(ind, indices.data(), indices.size() * 4);
  void* w = alloc(wh.size() * 4);
  upload(w, wh.data(), wh.size() * 4);
  // expertY (prefill: 15 GB) is generated in place, on the GPU or the host, the same values (fill.hpp).
  const uint64_t yElems = static_cast<uint64_t>(rows) * H, ySeed = 999 + group;
  void* y = alloc(yElems * 2);
  if (!device) {
    uint16_t* yp = static_cast<uint16_t*>(y);
    for (uint64_t i = 0; i < yElems; ++i) yp[i] = epcommBenchNearOne(ySeed, i);
  } else {
    epcommBenchFillNearOne(stream, static_cast<uint16_t*>(y), yElems, ySeed);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    BENCH_CUDA(cudaGetLastError());
  }
  void* counts = alloc(L * 4);
  void* ox = alloc(static_cast<size_t>(rows) * c.hiddenDimBytes);
  void* os = S ? alloc(static_cast<size_t>(rows) * S * 4) : nullptr;
  void* out = alloc(static_cast<size_t>(T) * H * 2);
  auto expert = [&](void* p, DType t, int64_t cols) {
    return batched ? TensorView::contiguous(p, t, {L, R, cols}, mk, dev)
                   : TensorView::contiguous(p, t, {rows, cols}, mk, dev);
  };
  DispatchArgs& d = dispatch;
  d.outExpertNumTokens = TensorView::contiguous(counts, DType::kI32, {L}, mk, dev);
  d.outExpertX = expert(ox, xType, xCols);
  if (S) {
    d.outExpertXScale = expert(os, DType::kF32, S);
    d.xScale = TensorView::contiguous(xs, DType::kF32, {T, S}, mk, dev);
  }
  d.x = TensorView::contiguous(x, xType, {T, xCols}, mk, dev);
  d.indices = TensorView::contiguous(ind, DType::kI32, {T, K}, mk, dev);
  d.stream = stream;
  CombineArgs& cb = combine;
  cb.outTokens = TensorView::contiguous(out, DType::kBf16, {T, H}, mk, dev);
  cb.indices = d.indices;
  cb.weights = TensorView::contiguous(w, DType::kF32, {T, K}, mk, dev);
  cb.expertY = expert(y, DType::kBf16, H);
  cb.stream = stream;
}

std::vector<uint64_t> Inputs::bytesPerPeer(const Config& c, bool perExpert) const {
  const uint32_t W = c.worldSize, K = c.expertsPerToken, L = c.numLocalExperts(), rank = c.rank;
  const uint64_t tokBytes = c.hiddenDimBytes + c.hiddenDimScaleBytes;
  std::vector<uint64_t> out(W, 0);
  for (uint32_t t = 0; t < tokens_; ++t) {
    if (t % c.dpSize != rank % c.dpSize) continue;  // the DP group member that sends token t
    std::vector<bool> seen(W, false);
    for (uint32_t k = 0; k < K; ++k) {
      const uint32_t owner = static_cast<uint32_t>(indices[static_cast<size_t>(t) * K + k]) / L;
      if (owner == rank) continue;
      if (perExpert || !seen[owner]) out[owner] += tokBytes;
      seen[owner] = true;
    }
  }
  return out;
}

std::vector<uint64_t> Inputs::combineBytesPerPeer(const Config& c, uint64_t elemBytes) const {
  const uint32_t W = c.worldSize, K = c.expertsPerToken, L = c.numLocalExperts(), D = c.dpSize, rank = c.rank;
  const uint64_t rowBytes = static_cast<uint64_t>(c.hiddenDim) * elemBytes;
  std::vector<uint64_t> out(W, 0);
  for (uint32_t g = 0; g < c.numDpGroups(); ++g) {
    // Group g's routing as its ranks generate it (this rank's group: the indices at hand).
    const std::vector<int32_t> idx = g == c.dpGroup() ? indices : reference::randomIndices(c, tokens_, routingSeed(g));
    uint64_t rows = 0;
    for (size_t i = 0; i < static_cast<size_t>(tokens_) * K; ++i) rows += static_cast<uint32_t>(idx[i]) / L == rank;
    for (uint32_t q = g * D; q < (g + 1) * D; ++q) out[q] = q == rank ? 0 : rows * rowBytes;
  }
  return out;
}

}  // namespace bench
}  // namespace epcomm
