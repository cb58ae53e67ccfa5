// NVSHMEM itself, once per process: initialised from epcomm's bootstrap through NVSHMEM's unique-ID path (no MPI, no
// PMI) by the first AllToAll object, and shared by every later one. No NVSHMEM headers here.
#pragma once

#include <cstdint>
#include <string>

#include "epcomm/bootstrap.hpp"

namespace epcomm {
namespace nvshmem {

/// Collective over `bootstrap`. The first call in the process sets NVSHMEM_SYMMETRIC_SIZE to `heapBytes` unless the
/// user set it, shares rank 0's unique ID over the bootstrap and initialises NVSHMEM with this process as PE
/// bootstrap.rank() of bootstrap.worldSize() on CUDA device `device` (the current device). Later calls check that they
/// ask for the same ranks and device (NVSHMEM cannot be initialised twice in a process) and take a reference.
/// Throws kUnavailable naming what failed.
void acquireRuntime(Bootstrap& bootstrap, int device, uint64_t heapBytes);

/// Drops a reference. NVSHMEM stays initialised until the process exits: nvshmem_init after nvshmem_finalize is
/// undefined behaviour, and a later object in the process reuses it.
void releaseRuntime();

/// Collective (nvshmem_malloc): `bytes` of the symmetric heap, the same size on every PE. Throws kUnavailable naming
/// NVSHMEM_SYMMETRIC_SIZE when the heap is too small.
void* symmetricAlloc(uint64_t bytes, uint32_t rank);

/// Collective (nvshmem_free).
void symmetricFree(void* p);

/// The symmetric heap size NVSHMEM uses (the environment's NVSHMEM_SYMMETRIC_SIZE as the user or the first object set
/// it), for messages.
std::string heapSizeSetting();

/// Whether NVSHMEM can start here: its unique-ID bootstrap plugin is found (beside libnvshmem_host.so.3, or named by
/// NVSHMEM_BOOTSTRAP_UID_PLUGIN). On false, *whyNot says why.
bool runtimeUsable(std::string* whyNot);

}  // namespace nvshmem
}  // namespace epcomm
