#include "gpu_harness.hpp"

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "core/cuda_check.hpp"
#include "core/dtype_convert.hpp"
#include "core/layout.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace gputest {

using reference::HostTensor;

int gpuCount() {
  static int cached = -1;
  if (cached >= 0) return cached;
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 100 ? 100 : n);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) {
    cached = 0;
  } else {
    cached = WEXITSTATUS(status);
  }
  return cached;
}

int useRankDevice(int rank) {
  int count = 0;
  EPCOMM_CHECK_CUDA(cudaGetDeviceCount(&count));
  EPCOMM_CHECK(count > 0, kCuda, "no CUDA device");
  EPCOMM_CHECK_CUDA(cudaSetDevice(rank % count));
  return rank % count;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  EPCOMM_CHECK_CUDA(cudaMalloc(&p_, bytes < 256 ? 256 : bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (p_ != nullptr) cudaFree(p_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (p_ != nullptr) cudaFree(p_);
    p_ = o.p_;
    bytes_ = o.bytes_;
    o.p_ = nullptr;
  }
  return *this;
}

void DeviceBuffer::upload(const void* src, size_t n) {
  if (n > 0) EPCOMM_CHECK_CUDA(cudaMemcpy(p_, src, n, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* dst, size_t n) const {
  if (n > 0) EPCOMM_CHECK_CUDA(cudaMemcpy(dst, p_, n, cudaMemcpyDeviceToHost));
}

Config scenarioConfig(const Scenario& s, uint32_t rank) {
  Config c;
  c.maxNumTokens = s.maxTokens;
  c.numExperts = s.experts;
  c.expertsPerToken = s.topK;
  c.worldSize = s.world;
  c.rank = rank;
  c.dpSize = s.dp;
  c.hiddenDim = s.hidden;
  c.hiddenDimBytes = s.hidden * dtypeSize(s.xType);
  c.hiddenDimScaleBytes = s.scales ? s.hidden / 64 * 4 : 0;
  c.expertPadding = s.padding;
  c.layout = s.layout;
  return c;
}

namespace {

uint32_t scaleCols(const Scenario& s) { return s.scales ? s.hidden / 64 : 0; }

// Shapes shared by host and device tensors of one rank.
struct Shapes {
  uint32_t L, R, P, S, K, H, xCols;
  uint64_t rows;        // rows of outExpertX / expertY
  uint64_t scaleElems;  // elements of the strided outExpertXScale allocation
};

Shapes shapesOf(const Scenario& s) {
  Config c = scenarioConfig(s, 0);
  Shapes sh{};
  sh.L = c.numLocalExperts();
  sh.R = static_cast<uint32_t>(c.batchedRowsPerExpert());
  sh.P = static_cast<uint32_t>(c.packedRows());
  sh.S = scaleCols(s);
  sh.K = s.topK;
  sh.H = s.hidden;
  sh.xCols = s.hidden;
  sh.rows = c.layout == Layout::kBatched ? static_cast<uint64_t>(sh.L) * sh.R : sh.P;
  sh.scaleElems = sh.rows * (sh.S + 1);
  return sh;
}

TensorView expertView(const Scenario& s, const Shapes& sh, void* data, DType dtype, int64_t cols, MemoryKind mem,
                      int dev) {
  if (s.layout == Layout::kBatched) return TensorView::contiguous(data, dtype, {sh.L, sh.R, cols}, mem, dev);
  return TensorView::contiguous(data, dtype, {sh.P, cols}, mem, dev);
}

TensorView scaleOutView(const Scenario& s, const Shapes& sh, void* data, MemoryKind mem, int dev) {
  const int64_t rs = sh.S + 1;  // one spare column per row: any strides must work
  if (s.layout == Layout::kBatched) {
    return TensorView::strided(data, DType::kF32, {sh.L, sh.R, sh.S}, {sh.R * rs, rs, 1}, mem, dev);
  }
  return TensorView::strided(data, DType::kF32, {sh.P, sh.S}, {rs, 1}, mem, dev);
}

TensorView xScaleView(const Shapes& sh, void* data, int64_t m, MemoryKind mem, int dev) {
  // Transposed storage: element (t, c) at c * m + t.
  return TensorView::strided(data, DType::kF32, {m, sh.S}, {1, m > 0 ? m : 1}, mem, dev);
}

// The rows of outExpertX / expertY that hold a token, as (first row, count) per local expert, from the counts of a
// dispatch: batched, expert le's rows start at le * R; packed, at the padded prefix sum of the earlier counts.
std::vector<std::pair<uint64_t, uint64_t>> usedRows(const Scenario& s, const Shapes& sh, const int32_t* counts) {
  std::vector<std::pair<uint64_t, uint64_t>> rows;
  uint64_t packedBase = 0;
  for (uint32_t le = 0; le < sh.L; ++le) {
    const uint64_t n = static_cast<uint64_t>(counts[le]);
    rows.emplace_back(s.layout == Layout::kBatched ? static_cast<uint64_t>(le) * sh.R : packedBase, n);
    packedBase += roundUpPow2(n, s.padding);
  }
  return rows;
}

}  // namespace

struct RoundData {
  Scenario s;
  Shapes sh;
  Config config;
  std::vector<int64_t> m;      // per rank
  std::vector<int32_t> bound;  // per rank
  std::vector<HostTensor> x, xScale, indices, weights, outCounts, outX, outXScale, expertY, outInit, outTokens,
      absTokens;
  std::vector<HostTensor> uploadIndices;  // Scenario::active: the indices as generated (`indices` has the mask's drops)
  std::vector<uint64_t> dropped;          // Scenario::active: combine positions (t < bound) the mask drops, per rank
  std::vector<uint8_t> poisonScale;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> used;  // per rank: usedRows() of the expected counts
};

Round::Round(const Scenario& s, uint64_t seed) : d_(new RoundData) {
  RoundData& d = *d_;
  d.s = s;
  d.sh = shapesOf(s);
  d.config = scenarioConfig(s, 0);
  const Shapes& sh = d.sh;
  const uint32_t W = s.world, G = s.world / s.dp;
  std::mt19937_64 rng(seed * 7919 + 17);
  std::uniform_real_distribution<float> uni(-1.f, 1.f), pos(0.f, 1.f);
  // Per DP group: token count, bound, and the token-level inputs shared by the group's ranks.
  std::vector<int64_t> gm(G);
  std::vector<int32_t> gb(G);
  for (uint32_t g = 0; g < G; ++g) {
    gm[g] = s.ragged ? static_cast<int64_t>(rng() % (s.maxTokens + 1)) : s.maxTokens;
    gb[g] = s.deviceBound ? static_cast<int32_t>(rng() % (gm[g] + 1)) : static_cast<int32_t>(gm[g]);
  }
  const int64_t xBytes = static_cast<int64_t>(s.hidden) * dtypeSize(s.xType);
  for (uint32_t r = 0; r < W; ++r) {
    const uint32_t g = r / s.dp;
    const int64_t m = gm[g];
    d.m.push_back(m);
    d.bound.push_back(gb[g]);
    // Same generator seed for every rank of a group: identical tokens.
    std::mt19937_64 gr(seed * 104729 + g);
    HostTensor x(s.xType, {m, static_cast<int64_t>(sh.xCols)});
    for (int64_t i = 0; i < m * xBytes; ++i) x.data<uint8_t>()[i] = static_cast<uint8_t>(gr());
    HostTensor xs(DType::kF32, {m > 0 ? m * sh.S : 1});
    for (int64_t i = 0; i < m * sh.S; ++i) xs.data<float>()[i] = uni(gr);
    std::vector<int32_t> idx = reference::randomIndices(d.config, static_cast<uint32_t>(m), seed * 31 + g);
    if (s.ownExperts) {
      const int32_t L = static_cast<int32_t>(s.experts / W);
      for (int32_t& e : idx) e = e % L + static_cast<int32_t>(r) * L;  // may repeat an expert, as masked does
    }
    if (s.masked) {
      for (int64_t t = 0; t < m; ++t) {
        const uint64_t v = gr();
        if (v % 4 == 0) idx[t * s.topK + (v >> 8) % s.topK] = -1;
        if (v % 4 == 1 && s.topK > 1) {
          const uint32_t k2 = 1 + (v >> 8) % (s.topK - 1);
          idx[t * s.topK + k2] = idx[t * s.topK + (v >> 16) % k2];
        }
        if (v % 16 == 2) {
          for (uint32_t k = 0; k < s.topK; ++k) idx[t * s.topK + k] = -1;  // fully masked token
        }
      }
    }
    auto indexTensor = [&](const std::vector<int32_t>& v) {
      HostTensor t(s.indexType, {m, static_cast<int64_t>(s.topK)});
      for (int64_t i = 0; i < m * s.topK; ++i) {
        if (s.indexType == DType::kI64) {
          t.data<int64_t>()[i] = v[i];
        } else {
          t.data<int32_t>()[i] = v[i];  // -1 is 0xFFFFFFFF for uint32
        }
      }
      return t;
    };
    if (!s.active.empty()) {
      // Elastic ranks: the device gets the indices as generated, the reference the same with the mask's drops.
      d.uploadIndices.push_back(indexTensor(idx));
      uint64_t dropped = 0;
      const uint32_t L = s.experts / W;
      for (int64_t t = 0; t < m; ++t) {
        const bool senderActive = s.active[g * s.dp + static_cast<uint32_t>(t) % s.dp] != 0;
        for (uint32_t k = 0; k < s.topK; ++k) {
          int32_t& e = idx[t * s.topK + k];
          if (e < 0 || (senderActive && s.active[static_cast<uint32_t>(e) / L] != 0)) continue;
          e = -1;
          if (t < gb[g]) ++dropped;
        }
      }
      d.dropped.push_back(dropped);
    }
    HostTensor ind = indexTensor(idx);
    HostTensor w(DType::kF32, {m, static_cast<int64_t>(s.topK)});
    for (int64_t i = 0; i < m * s.topK; ++i) w.data<float>()[i] = pos(gr);
    d.x.push_back(std::move(x));
    d.xScale.push_back(std::move(xs));
    d.indices.push_back(std::move(ind));
    d.weights.push_back(std::move(w));
  }
  // Outputs, poisoned so that rows nobody should write are checked too (outExpertX: poisoned on the device, and the
  // expected rows outside usedRows() are checked for the poison byte, so the host never touches them).
  d.poisonScale.assign(sh.scaleElems * 4, 0xA5);
  for (uint32_t r = 0; r < W; ++r) {
    HostTensor counts(DType::kI32, {sh.L});
    std::memset(counts.data<void>(), 0xA5, counts.bytes());
    HostTensor ox(s.xType, {static_cast<int64_t>(sh.rows * sh.xCols)});
    HostTensor os(DType::kF32, {static_cast<int64_t>(sh.scaleElems > 0 ? sh.scaleElems : 1)});
    std::memcpy(os.data<void>(), d.poisonScale.data(), d.poisonScale.size());
    std::mt19937_64 yr(seed * 15485863 + r);
    const int64_t m = d.m[r];
    HostTensor init(s.outType, {m, static_cast<int64_t>(sh.H)});
    for (int64_t i = 0; i < m * sh.H; ++i) {
      if (s.accumulate) {
        storeFromFloat(s.outType, init.data<void>(), i, uni(yr));
      } else {
        std::memset(static_cast<uint8_t*>(init.data<void>()) + i * dtypeSize(s.outType), 0x7B, dtypeSize(s.outType));
      }
    }
    d.outCounts.push_back(std::move(counts));
    d.outX.push_back(std::move(ox));
    d.outXScale.push_back(std::move(os));
    d.outInit.push_back(std::move(init));
  }
  // Reference dispatch.
  std::vector<DispatchArgs> da(W);
  for (uint32_t r = 0; r < W; ++r) {
    DispatchArgs& a = da[r];
    a.outExpertNumTokens = d.outCounts[r].view();
    a.outExpertX = expertView(s, sh, d.outX[r].data<void>(), s.xType, sh.xCols, MemoryKind::kHost, -1);
    if (s.scales) {
      a.outExpertXScale = scaleOutView(s, sh, d.outXScale[r].data<void>(), MemoryKind::kHost, -1);
      a.xScale = xScaleView(sh, d.xScale[r].data<void>(), d.m[r], MemoryKind::kHost, -1);
    }
    a.x = d.x[r].view();
    a.indices = d.indices[r].view();
    a.boundM = &d.bound[r];
  }
  reference::dispatch(d.config, da);
  // Expert outputs: random values in the rows that hold a token (known from the reference dispatch's counts); the
  // device copy has NaN (all bytes 0xFF, in every float type) in the others (upload), so a combine that reads a row
  // nobody dispatched to fails. The host copy leaves those rows untouched (zero pages; the reference never reads them).
  // Filling every row made the large scenarios spend most of their time here (e.g. 300 M elements per rank per
  // round for 1300 tokens of 7168 with 16 local experts).
  for (uint32_t r = 0; r < W; ++r) {
    d.used.push_back(usedRows(s, sh, d.outCounts[r].data<int32_t>()));
    HostTensor y(s.yType, {static_cast<int64_t>(sh.rows * sh.H)});
    std::mt19937_64 yr(seed * 15485863 + 7 * r + 1);
    for (const auto& [first, count] : d.used[r]) {
      for (uint64_t i = first * sh.H; i < (first + count) * sh.H; ++i)
        storeFromFloat(s.yType, y.data<void>(), i, uni(yr));
    }
    d.expertY.push_back(std::move(y));
  }
  // Reference combine, and the same with |w| and |y| in fp32: the magnitude that bounds the rounding error.
  std::vector<CombineArgs> ca(W), cabs(W);
  std::vector<HostTensor> absW, absY;
  for (uint32_t r = 0; r < W; ++r) {
    const int64_t m = d.m[r];
    HostTensor out(s.outType, {m, static_cast<int64_t>(sh.H)});
    std::memcpy(out.data<void>(), d.outInit[r].data<void>(), out.bytes());
    d.outTokens.push_back(std::move(out));
    HostTensor aw(DType::kF32, {m, static_cast<int64_t>(s.topK)});
    for (int64_t i = 0; i < m * s.topK; ++i) aw.data<float>()[i] = std::fabs(d.weights[r].data<float>()[i]);
    HostTensor ay(DType::kF32, {static_cast<int64_t>(sh.rows * sh.H)});  // unused rows are never read
    for (const auto& [first, count] : d.used[r]) {
      for (uint64_t i = first * sh.H; i < (first + count) * sh.H; ++i) {
        ay.data<float>()[i] = std::fabs(loadAsFloat(s.yType, d.expertY[r].data<void>(), i));
      }
    }
    absW.push_back(std::move(aw));
    absY.push_back(std::move(ay));
    HostTensor at(DType::kF32, {m, static_cast<int64_t>(sh.H)});
    d.absTokens.push_back(std::move(at));
  }
  for (uint32_t r = 0; r < W; ++r) {
    CombineArgs& a = ca[r];
    a.outTokens = d.outTokens[r].view();
    a.indices = d.indices[r].view();
    a.weights = d.weights[r].view();
    a.expertY = expertView(s, sh, d.expertY[r].data<void>(), s.yType, sh.H, MemoryKind::kHost, -1);
    a.boundM = &d.bound[r];
    a.accumulate = s.accumulate;
    CombineArgs& b = cabs[r];
    b = a;
    b.outTokens = d.absTokens[r].view();
    b.weights = absW[r].view();
    b.expertY = expertView(s, sh, absY[r].data<void>(), DType::kF32, sh.H, MemoryKind::kHost, -1);
    b.accumulate = false;
  }
  reference::combine(d.config, ca);
  reference::combine(d.config, cabs);
}

Round::~Round() { delete d_; }

uint64_t Round::dropped(uint32_t rank) const { return d_->dropped.empty() ? 0 : d_->dropped[rank]; }

void allocateDevice(const Scenario& s, uint32_t rank, DeviceTensors& dev) {
  const Shapes sh = shapesOf(s);
  int device = 0;
  EPCOMM_CHECK_CUDA(cudaGetDevice(&device));
  const MemoryKind kc = MemoryKind::kCuda;
  const int64_t T = s.maxTokens;
  dev.x = DeviceBuffer(T * s.hidden * dtypeSize(s.xType));
  dev.xScale = DeviceBuffer(T * sh.S * 4);
  dev.indices = DeviceBuffer(T * s.topK * dtypeSize(s.indexType));
  dev.weights = DeviceBuffer(T * s.topK * 4);
  dev.boundM = DeviceBuffer(4);
  dev.outCounts = DeviceBuffer(sh.L * 4);
  dev.outX = DeviceBuffer(sh.rows * s.hidden * dtypeSize(s.xType));
  dev.outXScale = DeviceBuffer(sh.scaleElems * 4);
  dev.expertY = DeviceBuffer(sh.rows * s.hidden * dtypeSize(s.yType));
  dev.outTokens = DeviceBuffer(T * s.hidden * dtypeSize(s.outType));
  (void)rank;
  (void)device;
  (void)kc;
}

namespace {

// Fills the argument views for this round's m (the tensors' first dimension is m; the pointers stay fixed).
void bindArgs(const Scenario& s, const Shapes& sh, int64_t m, DeviceTensors& dev) {
  int device = 0;
  EPCOMM_CHECK_CUDA(cudaGetDevice(&device));
  const MemoryKind kc = MemoryKind::kCuda;
  DispatchArgs& a = dev.dispatch;
  a = DispatchArgs{};
  a.outExpertNumTokens = TensorView::contiguous(dev.outCounts.get(), DType::kI32, {sh.L}, kc, device);
  a.outExpertX = expertView(s, sh, dev.outX.get(), s.xType, sh.xCols, kc, device);
  if (s.scales) {
    a.outExpertXScale = scaleOutView(s, sh, dev.outXScale.get(), kc, device);
    a.xScale = xScaleView(sh, dev.xScale.get(), m, kc, device);
  }
  a.x = TensorView::contiguous(dev.x.get(), s.xType, {m, static_cast<int64_t>(sh.xCols)}, kc, device);
  a.indices = TensorView::contiguous(dev.indices.get(), s.indexType, {m, static_cast<int64_t>(s.topK)}, kc, device);
  a.boundM = s.deviceBound ? static_cast<const int32_t*>(dev.boundM.get()) : nullptr;
  CombineArgs& c = dev.combine;
  c = CombineArgs{};
  c.outTokens = TensorView::contiguous(dev.outTokens.get(), s.outType, {m, static_cast<int64_t>(sh.H)}, kc, device);
  c.indices = a.indices;
  c.weights = TensorView::contiguous(dev.weights.get(), DType::kF32, {m, static_cast<int64_t>(s.topK)}, kc, device);
  c.expertY = expertView(s, sh, dev.expertY.get(), s.yType, sh.H, kc, device);
  c.boundM = a.boundM;
  c.accumulate = s.accumulate;
}

// Half the spacing of `t`'s values around magnitude `mag`: the largest error of one round-to-nearest into `t`
// (subnormals included).
double halfUlp(DType t, double mag) {
  const int man = t == DType::kBf16 ? 7 : t == DType::kF16 ? 10 : 23;
  const int emin = t == DType::kF16 ? -14 : -126;
  const int e = std::max(static_cast<int>(std::floor(std::log2(std::max(mag, 1e-300)))), emin);
  return std::ldexp(0.5, e - man);
}

float epsOf(DType t) {
  switch (t) {
    case DType::kBf16:
      return 1.f / 128;
    case DType::kF16:
      return 1.f / 1024;
    default:
      return 1e-6f;
  }
}

}  // namespace

void Round::upload(uint32_t rank, DeviceTensors& dev) const {
  const RoundData& d = *d_;
  const Scenario& s = d.s;
  bindArgs(s, d.sh, d.m[rank], dev);
  dev.x.upload(d.x[rank].data<void>(), d.x[rank].bytes());
  if (s.scales) dev.xScale.upload(d.xScale[rank].data<void>(), d.m[rank] * d.sh.S * 4);
  const HostTensor& indices = d.uploadIndices.empty() ? d.indices[rank] : d.uploadIndices[rank];
  dev.indices.upload(indices.data<void>(), indices.bytes());
  dev.weights.upload(d.weights[rank].data<void>(), d.weights[rank].bytes());
  dev.boundM.upload(&d.bound[rank], 4);
  std::vector<uint8_t> poison(d.sh.L * 4, 0xA5);
  dev.outCounts.upload(poison.data(), poison.size());
  EPCOMM_CHECK_CUDA(cudaMemset(dev.outX.get(), 0xA5, dev.outX.bytes()));
  dev.outXScale.upload(d.poisonScale.data(), d.poisonScale.size());
  // expertY: NaN (0xFF bytes, in every float type) in the rows that hold no token, the reference's values in the
  // others.
  EPCOMM_CHECK_CUDA(cudaMemset(dev.expertY.get(), 0xFF, dev.expertY.bytes()));
  const size_t yRow = static_cast<size_t>(d.sh.H) * dtypeSize(d.s.yType);
  for (const auto& [first, count] : d.used[rank]) {
    if (count > 0) {
      EPCOMM_CHECK_CUDA(cudaMemcpy(static_cast<uint8_t*>(dev.expertY.get()) + first * yRow,
                                   d.expertY[rank].data<uint8_t>() + first * yRow, count * yRow,
                                   cudaMemcpyHostToDevice));
    }
  }
  dev.outTokens.upload(d.outInit[rank].data<void>(), d.outInit[rank].bytes());
  // The copies and memsets above run on the legacy default stream, which the backends' non-blocking streams do not
  // wait for (and a pageable upload may return before its DMA lands): finish them before the round is launched.
  EPCOMM_CHECK_CUDA(cudaDeviceSynchronize());
}

std::string Round::check(uint32_t rank, const DeviceTensors& dev) const {
  const RoundData& d = *d_;
  const Scenario& s = d.s;
  const Shapes& sh = d.sh;
  std::ostringstream err;
  int problems = 0;
  auto note = [&](const std::string& what) {
    if (problems++ < 8) err << what << "\n";
  };
  std::vector<int32_t> counts(sh.L);
  dev.outCounts.download(counts.data(), sh.L * 4);
  for (uint32_t le = 0; le < sh.L; ++le) {
    if (counts[le] != d.outCounts[rank].data<int32_t>()[le]) {
      note("count of local expert " + std::to_string(le) + ": got " + std::to_string(counts[le]) + ", expected " +
           std::to_string(d.outCounts[rank].data<int32_t>()[le]));
    }
  }
  const size_t rowBytes = static_cast<size_t>(s.hidden) * dtypeSize(s.xType);
  std::vector<uint8_t> ox(sh.rows * rowBytes);
  dev.outX.download(ox.data(), ox.size());
  std::vector<bool> isUsed(sh.rows, false);
  for (const auto& [first, count] : d.used[rank]) {
    for (uint64_t row = first; row < first + count; ++row) isUsed[row] = true;
  }
  const std::vector<uint8_t> poisonRow(rowBytes, 0xA5);
  for (uint64_t row = 0; row < sh.rows; ++row) {
    const uint8_t* want = isUsed[row] ? d.outX[rank].data<uint8_t>() + row * rowBytes : poisonRow.data();
    if (std::memcmp(ox.data() + row * rowBytes, want, rowBytes) != 0) {
      note("outExpertX row " + std::to_string(row) + (isUsed[row] ? " differs" : " holds no token but was written"));
    }
  }
  if (s.scales) {
    std::vector<uint8_t> os(sh.scaleElems * 4);
    dev.outXScale.download(os.data(), os.size());
    if (std::memcmp(os.data(), d.outXScale[rank].data<uint8_t>(), os.size()) != 0) note("outExpertXScale differs");
  }
  const int64_t m = d.m[rank];
  const size_t item = dtypeSize(s.outType);
  std::vector<uint8_t> out(m * sh.H * item);
  dev.outTokens.download(out.data(), out.size());
  const float tolRel = epsOf(s.yType) + epsOf(s.outType) + 1e-5f;
  // oneRounding: the exact sum of the token's n terms (w * y is exact in fp64; accumulate's outTokens is a term too)
  // against the bound of one rounding of an fp32 sum of them: each term's multiply-add and each add of a partial
  // round once in fp32, at most 2n roundings of at most 2^-24 times the sum of the terms' magnitudes (one more to
  // spare), then half an ulp of the output dtype at the result (one_rounding_bound in tests/python/_numerics.py).
  std::vector<reference::Routing::Slot> slots;
  if (s.oneRounding) {
    std::vector<TensorView> indices(s.world);
    for (uint32_t r = 0; r < s.world; ++r) indices[r] = d.indices[r].view();
    slots = reference::buildRouting(d.config, indices, d.bound).slot[rank];
  }
  for (int64_t t = 0; t < m; ++t) {
    for (uint32_t h = 0; h < sh.H; ++h) {
      const int64_t i = t * sh.H + h;
      if (t >= d.bound[rank]) {
        if (std::memcmp(out.data() + i * item, d.outInit[rank].data<uint8_t>() + i * item, item) != 0) {
          note("outTokens row " + std::to_string(t) + " >= boundM " + std::to_string(d.bound[rank]) + " was written");
          break;
        }
        continue;
      }
      const float got = loadAsFloat(s.outType, out.data(), i);
      if (s.oneRounding) {
        double exact = 0, absSum = 0;
        int terms = 0;
        if (s.accumulate) {
          exact = loadAsFloat(s.outType, d.outInit[rank].data<void>(), i);
          absSum = std::fabs(exact);
          ++terms;
        }
        for (uint32_t k = 0; k < s.topK; ++k) {
          const reference::Routing::Slot& slot = slots[t * s.topK + k];
          if (slot.owner < 0) continue;
          const double term =
              static_cast<double>(d.weights[rank].data<float>()[t * s.topK + k]) *
              loadAsFloat(s.yType, d.expertY[slot.owner].data<void>(), static_cast<int64_t>(slot.row) * sh.H + h);
          exact += term;
          absSum += std::fabs(term);
          ++terms;
        }
        const double fp32 = (2 * terms + 1) * std::ldexp(absSum, -24);
        const double bound = halfUlp(s.outType, std::fabs(exact) + fp32) + fp32;
        if (!(std::fabs(got - exact) <= bound)) {
          std::ostringstream o;
          o << "outTokens[" << t << ", " << h << "] = " << got << ", exact sum " << exact
            << ": error beyond one final rounding of an fp32 sum (" << std::fabs(got - exact) << " > " << bound << ")";
          note(o.str());
        }
        continue;
      }
      const float want = loadAsFloat(s.outType, d.outTokens[rank].data<void>(), i);
      float mag = d.absTokens[rank].data<float>()[i];
      if (s.accumulate) mag += std::fabs(loadAsFloat(s.outType, d.outInit[rank].data<void>(), i));
      const float tol = tolRel * mag + 1e-6f;
      if (!(std::fabs(got - want) <= tol)) {
        std::ostringstream o;
        o << "outTokens[" << t << ", " << h << "] = " << got << ", expected " << want << " (tol " << tol << ")";
        note(o.str());
      }
    }
  }
  if (problems > 8) err << "... " << problems << " problems in all\n";
  return err.str();
}

std::vector<uint8_t> Round::snapshot(const DeviceTensors& dev) {
  std::vector<uint8_t> all;
  for (const DeviceBuffer* b : {&dev.outCounts, &dev.outX, &dev.outXScale, &dev.outTokens}) {
    std::vector<uint8_t> v(b->bytes());
    b->download(v.data(), v.size());
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

std::string runScenario(const Scenario& s, uint32_t rank, Bootstrap& bootstrap) {
  return runScenario(s, rank, bootstrap, "nvlink");
}

std::string runScenario(const Scenario& s, uint32_t rank, Bootstrap& bootstrap, const std::string& backend) {
  int count = 0;
  EPCOMM_CHECK_CUDA(cudaGetDeviceCount(&count));
  EPCOMM_CHECK_CUDA(cudaSetDevice(static_cast<int>(rank) % count));
  const Config config = scenarioConfig(s, rank);
  std::unique_ptr<AllToAll> a2a = createAllToAll(config, bootstrap, backend);
  DeviceTensors dev;
  allocateDevice(s, rank, dev);
  cudaStream_t stream = nullptr;
  EPCOMM_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer scratch(1 << 20);
  std::vector<uint8_t> first;
  std::string result;
  for (int round = 0; round < s.rounds && result.empty(); ++round) {
    const uint64_t seed = s.seed * 1000 + (round == 1 ? 0 : round);
    Round rd(s, seed);
    rd.upload(rank, dev);
    dev.dispatch.stream = stream;
    dev.combine.stream = stream;
    if (s.split || (s.splitOddRanks && rank % 2 == 1)) {
      // Between the halves the caller's work runs on the same stream.
      const auto [send, recv] = halves(dev.dispatch);
      a2a->dispatch(send);
      EPCOMM_CHECK_CUDA(cudaMemsetAsync(scratch.get(), round, scratch.bytes(), stream));
      a2a->dispatch(recv);
      const auto [csend, crecv] = halves(dev.combine);
      a2a->combine(csend);
      EPCOMM_CHECK_CUDA(cudaMemsetAsync(scratch.get(), round + 1, scratch.bytes(), stream));
      a2a->combine(crecv);
    } else {
      a2a->dispatch(dev.dispatch);
      a2a->combine(dev.combine);
    }
    a2a->synchronize();
    std::string err = rd.check(rank, dev);
    if (!err.empty()) {
      result = "rank " + std::to_string(rank) + " round " + std::to_string(round) + ":\n" + err;
      break;
    }
    if (round == 0) first = Round::snapshot(dev);
    if (round == 1 && Round::snapshot(dev) != first) {
      result = "rank " + std::to_string(rank) + ": round 1 repeated round 0's inputs but the outputs differ bitwise";
    }
  }
  cudaStreamDestroy(stream);
  return result;
}

}  // namespace gputest
}  // namespace epcomm
