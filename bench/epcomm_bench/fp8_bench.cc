// epcomm-bench --fp8: the low-latency dispatch of DeepEP's use_fp8 (bf16 tokens in, fp8 e4m3 + fp32 scales per 128
// out), by the dispatch that casts (Config::dispatchCast: inside the nvlink kernel's send half) against a cast kernel
// followed by the dispatch of its fp8 output, on the same tokens, in the same run, interleaved sample by sample.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <vector>

#include "bench.hpp"
#include "bench_cuda.hpp"
#include "epcomm/error.hpp"
#include "epcomm/reference.hpp"
#include "fp8_cast.hpp"
#include "inputs.hpp"

namespace epcomm {
namespace bench {

namespace {

// bf16 bits of `count` token elements: random signs and mantissas, exponents from 2^-8 to 2^7 per 128-element block
// (so the blocks' scales differ), from `seed` (the DP group's: its ranks hold the same tokens).
std::vector<uint16_t> bf16Tokens(uint64_t count, uint64_t seed) {
  std::vector<uint16_t> out(count);
  uint64_t state = seed;
  auto next = [&state] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  uint32_t exponent = 127;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t r = next();
    if (i % 128 == 0) exponent = 119 + static_cast<uint32_t>(r % 16);
    out[i] = static_cast<uint16_t>(((r >> 8) & 0x8000u) | (exponent << 7) | ((r >> 24) & 0x7Fu));
  }
  return out;
}

// Bytes of a view's elements (the outputs here are contiguous).
uint64_t viewBytes(const TensorView& v) { return static_cast<uint64_t>(v.numel()) * dtypeSize(v.dtype); }

// The outputs of a dispatch are checked for equal bits only up to this size per rank (copied to the host).
constexpr uint64_t kCheckBytes = 1ull << 30;

}  // namespace

void Bench::runFp8Cast(const std::string& name, uint32_t T) {
  Config c = standardConfig(name, world_, rank_, o_.dp);
  c.maxNumTokens = std::max(T, o_.maxTokens);
  c.layout = o_.layout;
  if (c.hiddenDimBytes != c.hiddenDim || c.hiddenDim % kFp8CastBlock != 0) {
    if (rank_ == 0)
      std::cerr << "skip " << name << " T=" << T << ": --fp8 needs an fp8 configuration (decode, prefill)\n";
    return;
  }
  if (!gpu_ && !hostFits(name, c)) return;
  Config castConfig = c;
  castConfig.dispatchCast = DispatchCast::kFp8Blocks;
  std::string whyNot;
  std::unique_ptr<AllToAll> fused, plain;
  if (o_.fp8 != "separate") {
    fused = createOnAll(castConfig, bs_, o_.backend, &whyNot);
    if (fused == nullptr && rank_ == 0) std::cerr << "skip " << name << " T=" << T << " fused: " << whyNot << "\n";
  }
  if (o_.fp8 != "fused") {
    plain = createOnAll(c, bs_, o_.backend, &whyNot);
    if (plain == nullptr && rank_ == 0) std::cerr << "skip " << name << " T=" << T << " separate: " << whyNot << "\n";
  }
  if (fused == nullptr && plain == nullptr) return;
  const std::string backend = (fused != nullptr ? fused : plain)->backendName();
  EPCOMM_CHECK(
      !gpu_ || backend != "host", kInvalidArgument,
      "backend auto chose host on this GPU machine; run with --backend host (CPU tensors) or name a GPU backend");

  // The separate path's fp8 tokens and scales are Inputs' x and xScale (its cast writes them); its outputs and the
  // combine's tensors serve both paths.
  Inputs in(c, T, gpu_, stream_);
  const uint64_t H = c.hiddenDim, S = H / kFp8CastBlock;
  const std::vector<uint16_t> xh = bf16Tokens(static_cast<uint64_t>(T) * H, 4242 + c.dpGroup());
  std::shared_ptr<void> xb;
  if (gpu_) {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, std::max<uint64_t>(xh.size() * 2, 256)));
    xb.reset(p, [](void* q) { cudaFree(q); });
    BENCH_CUDA(cudaMemcpy(p, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
  } else {
    xb.reset(new uint16_t[std::max<size_t>(xh.size(), 1)], [](void* q) { delete[] static_cast<uint16_t*>(q); });
    std::memcpy(xb.get(), xh.data(), xh.size() * 2);
  }
  const MemoryKind mk = gpu_ ? MemoryKind::kCuda : MemoryKind::kHost;
  const TensorView bf16X = TensorView::contiguous(xb.get(), DType::kBf16, {T, static_cast<int64_t>(H)}, mk, device_);
  DispatchArgs dFused = in.dispatch, dSeparate = in.dispatch;
  dFused.x = bf16X;
  dFused.xScale = TensorView();
  auto cast = [&] {
    if (gpu_) {
      castFp8Blocks(stream_, static_cast<const uint16_t*>(xb.get()), static_cast<uint8_t*>(dSeparate.x.data),
                    static_cast<float*>(dSeparate.xScale.data), static_cast<int64_t>(S), T, static_cast<uint32_t>(H),
                    false);
    } else {
      reference::castFp8Blocks(bf16X, dSeparate.x, dSeparate.xScale);
    }
  };
  auto separate = [&] {
    cast();
    plain->dispatch(dSeparate);
  };

  // Both paths: one dispatch each from zeroed outputs, compared bit for bit (then its combine: the calls alternate).
  int sameBits = -1;
  const std::vector<TensorView> outs = {in.dispatch.outExpertNumTokens, in.dispatch.outExpertX,
                                        in.dispatch.outExpertXScale};
  uint64_t outBytes = 0;
  for (const TensorView& v : outs) outBytes += viewBytes(v);
  if (fused != nullptr && plain != nullptr && outBytes <= kCheckBytes) {
    auto snapshot = [&](AllToAll& a2a, const std::function<void()>& dispatch) {
      for (const TensorView& v : outs) {
        if (gpu_) {
          BENCH_CUDA(cudaMemsetAsync(v.data, 0, viewBytes(v), stream_));
        } else {
          std::memset(v.data, 0, viewBytes(v));
        }
      }
      dispatch();
      a2a.synchronize();
      std::vector<uint8_t> bytes;
      for (const TensorView& v : outs) {
        const size_t at = bytes.size();
        bytes.resize(at + viewBytes(v));
        if (gpu_) {
          BENCH_CUDA(cudaMemcpy(bytes.data() + at, v.data, viewBytes(v), cudaMemcpyDeviceToHost));
        } else {
          std::memcpy(bytes.data() + at, v.data, viewBytes(v));
        }
      }
      a2a.combine(in.combine);
      a2a.synchronize();
      return bytes;
    };
    int same = snapshot(*fused, [&] { fused->dispatch(dFused); }) == snapshot(*plain, separate) ? 1 : 0;
    std::vector<int> all(world_);
    bs_.allGather(&same, all.data(), sizeof(int));
    sameBits = *std::min_element(all.begin(), all.end());
  }

  Timer& tm = *timer_;
  const int iters = o_.iters, warm = o_.warmup;
  // Samples of both paths interleaved (dispatch, then its combine), so both see the same conditions.
  std::vector<std::function<void()>> calls;
  if (fused != nullptr) {
    calls.push_back([&] { fused->dispatch(dFused); });
    calls.push_back([&] { fused->combine(in.combine); });
  }
  if (plain != nullptr) {
    calls.push_back(separate);
    calls.push_back([&] { plain->combine(in.combine); });
  }
  std::vector<std::vector<double>> s, dev, graph;
  tm.interleaved(calls, iters, warm, false, &s);
  if (gpu_) tm.interleaved(calls, iters, warm, true, &dev);
  std::vector<double> castAlone;
  if (plain != nullptr) castAlone = tm.samples(cast, iters, warm);
  if (gpu_) {
    // Each call captured into a graph of its own (the separate dispatch: the cast and the dispatch in one graph).
    std::vector<cudaGraphExec_t> execs;
    for (const std::function<void()>& call : calls) {
      cudaGraph_t g;
      cudaGraphExec_t x;
      BENCH_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      call();
      BENCH_CUDA(cudaStreamEndCapture(stream_, &g));
      BENCH_CUDA(cudaGraphInstantiate(&x, g, 0));
      BENCH_CUDA(cudaGraphDestroy(g));
      execs.push_back(x);
    }
    std::vector<std::function<void()>> replays;
    for (cudaGraphExec_t x : execs) replays.push_back([this, x] { BENCH_CUDA(cudaGraphLaunch(x, stream_)); });
    tm.interleaved(replays, iters, warm, false, &graph);
    for (cudaGraphExec_t x : execs) cudaGraphExecDestroy(x);
  }
  const double castUs = plain != nullptr ? tm.agree(castAlone) : -1;

  std::vector<Fp8Row> rows;
  for (size_t path = 0; path < calls.size() / 2; ++path) {
    Fp8Row r;
    r.backend = backend;
    r.config = name;
    r.c = c;
    r.tokens = T;
    r.mode = fused != nullptr && path == 0 ? "fused" : "separate";
    r.dispatch = tm.agree(s[2 * path]);
    r.combine = tm.agree(s[2 * path + 1]);
    if (gpu_) {
      r.dispatchDev = tm.agree(dev[2 * path]);
      r.graph = tm.agree(graph[2 * path]);
    }
    if (r.mode == "separate") r.cast = castUs;
    r.sameBits = sameBits;
    rows.push_back(r);
  }
  if (report_) {
    for (const Fp8Row& r : rows) report_->fp8Row(r);
    if (rows.size() == 2) {
      // What the cast inside the dispatch saves per dispatch (separate minus fused), for each timing measured.
      std::string saves = name + " T=" + std::to_string(T) + ": the cast inside the dispatch saves";
      const char* what[] = {"eager", "device-only", "in a graph"};
      const double d[] = {rows[1].dispatch - rows[0].dispatch, rows[1].dispatchDev - rows[0].dispatchDev,
                          rows[1].graph - rows[0].graph};
      const bool measured[] = {true, gpu_, gpu_};
      for (int k = 0; k < 3; ++k) {
        if (!measured[k]) continue;
        char part[64];
        std::snprintf(part, sizeof(part), "%s %.1f us %s", k > 0 ? "," : "", d[k], what[k]);
        saves += part;
      }
      std::printf("#   %s\n", saves.c_str());
      std::fflush(stdout);
    }
  }
  if (fused != nullptr) fused->synchronize();
  if (plain != nullptr) plain->synchronize();
}

}  // namespace bench
}  // namespace epcomm
