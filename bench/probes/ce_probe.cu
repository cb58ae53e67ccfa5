// ce-probe: can the copy engine carry the decode dispatch's payload and its flag sooner than SM stores and a fence?
//
//   ce-probe [iters (default 200)] [tokens (default 128)]
//
// One process, two GPUs with peer access, one host thread per GPU; both threads meet at a spin barrier before each
// iteration and time it the benchmark's way (device synchronize, barrier, event, one graph launch, event). Every
// graph moves `tokens` decode tokens (7168 payload bytes + 224 scale bytes, one 7392-byte staging slot each) from
// this GPU to the other one and waits, on this GPU, until the other GPU's tokens and flag have arrived:
//   empty       one kernel node (66 x 512 threads) that does nothing: the floor
//   sm push     one kernel node: blocks [0, 33) store the slots into the peer's staging with 16-byte stores, then
//               fence.acq_rel.sys + one relaxed system-scope add on the peer's flag (the backend's pattern); every
//               block waits until its own flag counts 33 adds (ld.acquire.sys; every wait gives up after 1 s, and
//               the mode is then reported as failed)
//   ce 1d       a copy-engine memcpy of the slots (one contiguous run) then cuStreamWriteValue32(peer flag, 1), on a
//               branch beside a kernel node whose blocks wait until their own flag is 1
//   ce 2d       as ce 1d, but the payload and the scales as two pitched copies (7168 of 7168 bytes per row and 224 of
//               224 into 7392-byte slots), as a strided x and xScale would need
//   ce 2d only  the two pitched copies and the flag write without the kernel (the sender's side alone)
// The waiting kernels' last block resets the flag to 0 (the next round's writes follow the next barrier). After each
// mode the staging of GPU 1 is compared with GPU 0's source bytes. Prints per mode the median over iterations of the
// slower GPU's event time, in us. Never asserts a time: exits 77 without two peer GPUs.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "probe_check.hpp"

namespace {

constexpr uint32_t kThreads = 512, kBlocks = 66, kSenders = 33;
constexpr uint32_t kHidden = 7168, kScaleBytes = 224, kSlot = kHidden + kScaleBytes;

struct Side {
  int dev = 0;
  char* x = nullptr;            // [tokens][kHidden]
  char* scales = nullptr;       // [tokens][kScaleBytes]
  char* slots = nullptr;        // [tokens][kSlot], packed source for the 1d and sm modes
  char* staging = nullptr;      // [tokens][kSlot], written by the other GPU
  uint64_t* flag = nullptr;     // written by the other GPU
  uint32_t* done = nullptr;     // blocks that saw the flag this round
  uint32_t* expired = nullptr;  // waits that gave up (waitFlagBounded)
  cudaStream_t s = nullptr, s2 = nullptr;
};

__global__ void __launch_bounds__(kThreads, 1) emptyKernel() {}

// Every block waits until `flag` reaches `want` (at most 1 s); the last block to get there resets the flag and the
// count.
__device__ void waitAndReset(uint64_t* flag, uint64_t want, uint32_t* done, uint32_t* expired) {
  if (threadIdx.x == 0) {
    probe::waitFlagBounded(flag, want, expired);
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      *flag = 0;
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1)
    smPush(const int4* src, int4* peerStaging, uint64_t* peerFlag, uint64_t vecs, uint64_t* flag, uint32_t* done,
           uint32_t* expired) {
  if (blockIdx.x < kSenders) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(kThreads) + threadIdx.x; i < vecs;
         i += static_cast<uint64_t>(kSenders) * kThreads) {
      peerStaging[i] = src[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      epcomm::device::fenceAcqRelSys();
      epcomm::device::redAddRelaxedSys(peerFlag, 1);
    }
  }
  waitAndReset(flag, kSenders, done, expired);
}

__global__ void __launch_bounds__(kThreads, 1) waitKernel(uint64_t* flag, uint32_t* done, uint32_t* expired) {
  waitAndReset(flag, 1, done, expired);
}

enum Mode { kEmpty, kSmPush, kCe1d, kCe2d, kCe2dOnly, kModes };
const char* kNames[kModes] = {"empty", "sm push", "ce 1d", "ce 2d", "ce 2d only"};

#define CU_OK(call)                                                                      \
  do {                                                                                   \
    const CUresult r_ = (call);                                                          \
    if (r_ != CUDA_SUCCESS) {                                                            \
      const char* m_ = nullptr;                                                          \
      cuGetErrorString(r_, &m_);                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, m_ ? m_ : "?"); \
      return false;                                                                      \
    }                                                                                    \
  } while (0)

// The copies of one side into the other's staging, then the flag write (stream s2).
bool enqueueCopies(const Side& me, const Side& peer, uint32_t tokens, bool twoD) {
  if (twoD) {
    PROBE_OK(cudaMemcpy2DAsync(peer.staging, kSlot, me.x, kHidden, kHidden, tokens, cudaMemcpyDeviceToDevice, me.s2));
    PROBE_OK(cudaMemcpy2DAsync(peer.staging + kHidden, kSlot, me.scales, kScaleBytes, kScaleBytes, tokens,
                               cudaMemcpyDeviceToDevice, me.s2));
  } else {
    PROBE_OK(
        cudaMemcpyAsync(peer.staging, me.slots, static_cast<size_t>(tokens) * kSlot, cudaMemcpyDeviceToDevice, me.s2));
  }
  // The flag's low word (little endian; the high word stays 0): the 32-bit write the results were measured with.
  CU_OK(cuStreamWriteValue32(reinterpret_cast<CUstream>(me.s2), reinterpret_cast<CUdeviceptr>(peer.flag), 1,
                             CU_STREAM_WRITE_VALUE_DEFAULT));
  return true;
}

bool buildGraph(const Side& me, const Side& peer, uint32_t tokens, Mode mode, cudaGraphExec_t& exec) {
  PROBE_OK(cudaSetDevice(me.dev));
  cudaGraph_t g = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  PROBE_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  PROBE_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  PROBE_OK(cudaStreamBeginCapture(me.s, cudaStreamCaptureModeThreadLocal));
  const bool ce = mode == kCe1d || mode == kCe2d || mode == kCe2dOnly;
  if (ce) {
    PROBE_OK(cudaEventRecord(fork, me.s));
    PROBE_OK(cudaStreamWaitEvent(me.s2, fork, 0));
    if (!enqueueCopies(me, peer, tokens, mode != kCe1d)) return false;
    PROBE_OK(cudaEventRecord(join, me.s2));
  }
  switch (mode) {
    case kEmpty:
      emptyKernel<<<kBlocks, kThreads, 0, me.s>>>();
      break;
    case kSmPush:
      smPush<<<kBlocks, kThreads, 0, me.s>>>(reinterpret_cast<const int4*>(me.slots),
                                             reinterpret_cast<int4*>(peer.staging), peer.flag,
                                             static_cast<uint64_t>(tokens) * kSlot / 16, me.flag, me.done, me.expired);
      break;
    case kCe1d:
    case kCe2d:
      waitKernel<<<kBlocks, kThreads, 0, me.s>>>(me.flag, me.done, me.expired);
      break;
    default:
      break;
  }
  if (ce) PROBE_OK(cudaStreamWaitEvent(me.s, join, 0));
  PROBE_OK(cudaStreamEndCapture(me.s, &g));
  PROBE_OK(cudaGraphInstantiate(&exec, g, 0));
  PROBE_OK(cudaGraphDestroy(g));
  PROBE_OK(cudaEventDestroy(fork));
  PROBE_OK(cudaEventDestroy(join));
  return true;
}

// One side's loop for one mode: `us` gets this GPU's event time per iteration (warm-up dropped).
bool sideLoop(Side& me, const Side& peer, uint32_t tokens, Mode mode, int iters, probe::PairBarrier& bar,
              std::vector<double>& us) {
  cudaGraphExec_t exec = nullptr;
  if (!buildGraph(me, peer, tokens, mode, exec)) return false;
  cudaEvent_t e0, e1;
  PROBE_OK(cudaEventCreate(&e0));
  PROBE_OK(cudaEventCreate(&e1));
  for (int i = 0; i < iters + 20; ++i) {
    PROBE_OK(cudaDeviceSynchronize());
    bar.arrive();
    PROBE_OK(cudaEventRecord(e0, me.s));
    PROBE_OK(cudaGraphLaunch(exec, me.s));
    PROBE_OK(cudaEventRecord(e1, me.s));
    PROBE_OK(cudaEventSynchronize(e1));
    float ms = 0;
    PROBE_OK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 20) us.push_back(ms * 1e3);
  }
  // A kCe2dOnly round leaves the flag at 1 (nobody waits for it): clear it for the next mode.
  PROBE_OK(cudaDeviceSynchronize());
  bar.arrive();
  PROBE_OK(cudaMemset(me.flag, 0, sizeof(uint64_t)));
  PROBE_OK(cudaDeviceSynchronize());
  bar.arrive();
  PROBE_OK(cudaGraphExecDestroy(exec));
  PROBE_OK(cudaEventDestroy(e0));
  PROBE_OK(cudaEventDestroy(e1));
  return probe::noExpiredWaits("ce-probe", me.dev, me.expired);
}

void runSide(Side& me, const Side& peer, uint32_t tokens, Mode mode, int iters, probe::PairBarrier& bar,
             std::vector<double>& us, bool& ok) {
  ok = sideLoop(me, peer, tokens, mode, iters, bar, us);
  if (!ok) bar.broken.store(true);
}

bool setup(Side& side, int dev, uint32_t tokens) {
  side.dev = dev;
  PROBE_OK(cudaSetDevice(dev));
  PROBE_OK(cudaDeviceEnablePeerAccess(1 - dev, 0));
  PROBE_OK(cudaMalloc(&side.x, static_cast<size_t>(tokens) * kHidden));
  PROBE_OK(cudaMalloc(&side.scales, static_cast<size_t>(tokens) * kScaleBytes));
  PROBE_OK(cudaMalloc(&side.slots, static_cast<size_t>(tokens) * kSlot));
  PROBE_OK(cudaMalloc(&side.staging, static_cast<size_t>(tokens) * kSlot));
  PROBE_OK(cudaMalloc(&side.flag, sizeof(uint64_t)));
  PROBE_OK(cudaMalloc(&side.done, sizeof(uint32_t)));
  PROBE_OK(cudaMalloc(&side.expired, sizeof(uint32_t)));
  PROBE_OK(cudaMemset(side.flag, 0, sizeof(uint64_t)));
  PROBE_OK(cudaMemset(side.done, 0, sizeof(uint32_t)));
  PROBE_OK(cudaMemset(side.expired, 0, sizeof(uint32_t)));
  PROBE_OK(cudaMemset(side.staging, 0, static_cast<size_t>(tokens) * kSlot));
  std::vector<unsigned char> h(static_cast<size_t>(tokens) * kSlot);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<unsigned char>((i * 131 + dev * 7 + 3) & 0xff);
  PROBE_OK(cudaMemcpy(side.slots, h.data(), h.size(), cudaMemcpyHostToDevice));
  // x and scales hold the same bytes as the slots, so every mode's staging must equal `slots`.
  PROBE_OK(cudaMemcpy2D(side.x, kHidden, side.slots, kSlot, kHidden, tokens, cudaMemcpyDeviceToDevice));
  PROBE_OK(cudaMemcpy2D(side.scales, kScaleBytes, side.slots + kHidden, kSlot, kScaleBytes, tokens,
                        cudaMemcpyDeviceToDevice));
  PROBE_OK(cudaStreamCreateWithFlags(&side.s, cudaStreamNonBlocking));
  PROBE_OK(cudaStreamCreateWithFlags(&side.s2, cudaStreamNonBlocking));
  return true;
}

// Whether GPU `to`'s staging holds GPU `from`'s slots.
bool stagingMatches(const Side& from, const Side& to, uint32_t tokens) {
  std::vector<unsigned char> a(static_cast<size_t>(tokens) * kSlot), b(a.size());
  PROBE_OK(cudaSetDevice(from.dev));
  PROBE_OK(cudaMemcpy(a.data(), from.slots, a.size(), cudaMemcpyDeviceToHost));
  PROBE_OK(cudaSetDevice(to.dev));
  PROBE_OK(cudaMemcpy(b.data(), to.staging, b.size(), cudaMemcpyDeviceToHost));
  PROBE_OK(cudaMemset(to.staging, 0, b.size()));
  return std::memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 200;
  const uint32_t tokens = argc > 2 ? static_cast<uint32_t>(std::max(1, std::atoi(argv[2]))) : 128;
  if (const int skip = probe::twoPeerGpus("ce-probe")) return skip;
  if (cuInit(0) != CUDA_SUCCESS) return 2;
  Side side[2];
  for (int d = 0; d < 2; ++d) {
    if (!setup(side[d], d, tokens)) return 2;
  }
  std::printf("ce-probe: %u tokens of %u bytes per direction (%.2f MB), %d iterations, median of the slower GPU (us)\n",
              tokens, kSlot, tokens * kSlot / 1e6, iters);
  std::printf("%-12s %9s %9s %9s %s\n", "mode", "max", "gpu0", "gpu1", "staging");
  int status = 0;
  for (int m = 0; m < kModes; ++m) {
    const Mode mode = static_cast<Mode>(m);
    probe::PairBarrier bar;
    std::vector<double> us[2];
    bool ok[2] = {false, false};
    std::thread t1([&] { runSide(side[1], side[0], tokens, mode, iters, bar, us[1], ok[1]); });
    runSide(side[0], side[1], tokens, mode, iters, bar, us[0], ok[0]);
    t1.join();
    if (!ok[0] || !ok[1]) {
      std::printf("%-12s failed\n", kNames[m]);
      status = 1;
      continue;
    }
    std::vector<double> mx(us[0].size());
    for (size_t i = 0; i < mx.size(); ++i) mx[i] = std::max(us[0][i], us[1][i]);
    const bool moved = mode != kEmpty;
    const bool match = !moved || (stagingMatches(side[0], side[1], tokens) && stagingMatches(side[1], side[0], tokens));
    if (!match) status = 1;
    std::printf("%-12s %9.2f %9.2f %9.2f %s\n", kNames[m], probe::median(mx), probe::median(us[0]),
                probe::median(us[1]), moved ? (match ? "matches" : "WRONG") : "-");
  }
  return status;
}
