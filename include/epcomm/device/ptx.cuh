// PTX wrappers named for their memory semantics (acquire/release at system scope, relaxed vector copies).
// Used by kernels that talk to peer GPUs through peer-mapped memory over NVLink.
#pragma once

#include <cstdint>

namespace epcomm {
namespace device {

/// Loads a 64-bit flag with acquire semantics at system scope: later loads see what the releasing peer wrote
/// before its matching release.
__device__ __forceinline__ uint64_t ldAcquireSys(const uint64_t* addr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}

/// Loads a 32-bit value with acquire semantics at GPU scope (intra-GPU handshakes between blocks).
__device__ __forceinline__ int32_t ldAcquireGpu(const int32_t* addr) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

/// Relaxed (strong) 32-bit load at GPU scope, with no memory clobber: a kernel's first words (its round counters, the
/// device token bound), which nothing of its own wrote before, issued together with the loads around them.
__device__ __forceinline__ uint32_t ldRelaxedGpu(const void* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

/// Stores a 64-bit flag with release semantics at system scope.
__device__ __forceinline__ void stReleaseSys(uint64_t* addr, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

/// Adds to a 64-bit flag (possibly in a peer's memory) with release semantics at system scope. The flag is a
/// monotonically increasing counter, so it is never reset and a receiver waits for "value >= expected".
__device__ __forceinline__ void redAddReleaseSys(uint64_t* addr, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

/// Relaxed atomic add at system scope. After fenceAcqRelSys() it completes a release pattern (PTX memory model:
/// a fence.acq_rel followed by a strong write), without red.release's second, implicit fence.
__device__ __forceinline__ void redAddRelaxedSys(uint64_t* addr, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}

/// Relaxed (strong, single-copy atomic) 64-bit load and store at system scope: a value and a tag that travel in one
/// 8-byte word are seen together, with no fence or flag (the data-with-flag pattern of NCCL's LL protocol).
__device__ __forceinline__ uint64_t ldRelaxedSys(const uint64_t* addr) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void stRelaxedSys(uint64_t* addr, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}
/// Two such words in one 16-byte store (each element single-copy atomic on its own; 16-byte aligned).
__device__ __forceinline__ void stRelaxedSys2(uint64_t* addr, uint64_t v0, uint64_t v1) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(addr), "l"(v0), "l"(v1) : "memory");
}

/// Full fence at system scope: orders this thread's (and, by cumulativity, what it observed through a CTA
/// barrier) earlier memory operations before its later ones, as seen from peers and the host.
__device__ __forceinline__ void fenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

/// Nanoseconds from the global timer (coarse but monotonic; used only for timeouts).
__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// 16-byte global load that is not cached in L1 (data written by peers or earlier kernels).
__device__ __forceinline__ int4 ldGlobalNc16(const void* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/// 16-byte relaxed global load that bypasses L1 (reads of memory peers wrote; ordered by an earlier acquire).
__device__ __forceinline__ int4 ldVolatile16(const void* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

/// 16-byte global store (local or peer-mapped memory).
__device__ __forceinline__ void st16(void* p, int4 v) {
  asm volatile("st.global.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

/// Asks L2 to fetch [p, p + bytes) from memory: a hint (no registers, nothing to wait for), so a warp can start the
/// fetch of every row it will read before it reads the first. p 16-byte aligned, bytes a multiple of 16. sm_90's bulk
/// (TMA) prefetch; nothing on older GPUs.
__device__ __forceinline__ void prefetchL2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
#endif
}

/// Programmatic dependent launch (sm_90): a kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
/// may be scheduled while the kernel before it in the stream still runs. waitPreviousGrid() blocks until that kernel
/// has finished and its memory is visible; allowDependentGrids() lets the next kernel be scheduled once every block
/// of this one has called it or exited. Both do nothing for kernels launched without the attribute, and on older GPUs.
__device__ __forceinline__ void waitPreviousGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allowDependentGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Lanes below this one in the warp, as a mask.
__device__ __forceinline__ uint32_t laneMaskLt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace device
}  // namespace epcomm
