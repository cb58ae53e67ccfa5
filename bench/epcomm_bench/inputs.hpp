// One configuration's tensors on one rank, in device memory (GPU backends) or host memory (host backend), filled
// with the benchmark's inputs: uniform top-k routing without repeats, fixed seeds, the same on every rank of a DP
// group.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "epcomm/config.hpp"

namespace epcomm {
namespace bench {

/// The tensors of one dispatch + combine of `tokens` tokens (the routing is reference::randomIndices', so tests and
/// benchmark route alike), owned (freed on destruction).
class Inputs {
 public:
  /// `device`: cudaMalloc on the current device, filled through `stream`; else aligned host memory.
  Inputs(const Config& c, uint32_t tokens, bool device, cudaStream_t stream);
  ~Inputs();
  Inputs(const Inputs&) = delete;
  Inputs& operator=(const Inputs&) = delete;

  DispatchArgs dispatch;         ///< Every tensor set; stream = the constructor's.
  CombineArgs combine;           ///< Every tensor set; indices = dispatch.indices.
  std::vector<int32_t> indices;  ///< The host copy of dispatch.indices.

  /// Bytes this rank sends each peer in the dispatch: the tokens it sends with at least one expert there
  /// (`perExpert`: once per expert there, as pplx-kernels count).
  std::vector<uint64_t> bytesPerPeer(const Config& c, bool perExpert) const;
  /// Bytes this rank sends each peer in the combine, as the host and proxy backends send them (docs/protocol.md,
  /// combine-send): as an expert owner, to every rank of DP group g one row of hiddenDim elements of `elemBytes` per
  /// (token, expert) pair of g's tokens whose expert lives on this rank. Its own entry is 0 (no fabric traffic).
  std::vector<uint64_t> combineBytesPerPeer(const Config& c, uint64_t elemBytes) const;

 private:
  void* alloc(size_t bytes);
  void upload(void* dst, const void* src, size_t bytes);

  bool device_;
  uint32_t tokens_;
  std::vector<void*> owned_;
};

}  // namespace bench
}  // namespace epcomm
