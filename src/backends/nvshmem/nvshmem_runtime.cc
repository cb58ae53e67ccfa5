#include "backends/nvshmem/nvshmem_runtime.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nvshmem_host.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "core/log.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace nvshmem {

namespace {

struct Runtime {
  std::mutex mu;
  bool initialized = false;
  int refs = 0;
  int rank = -1;
  int world = 0;
  int device = -1;
};

Runtime& runtime() {
  static Runtime* r = new Runtime;  // never destroyed: NVSHMEM outlives every static destructor
  return *r;
}

// What rank 0 broadcasts: whether it got a unique ID, and the ID.
struct UidMessage {
  int32_t status;
  int32_t reserved;
  nvshmemx_uniqueid_t uid;
};

// The directory of the loaded libnvshmem_host.so.3 ("" when dladdr cannot tell).
std::string hostLibraryDir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&nvshmemx_get_uniqueid), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

}  // namespace

bool runtimeUsable(std::string* whyNot) {
  const char* plugin = std::getenv("NVSHMEM_BOOTSTRAP_UID_PLUGIN");
  if (plugin != nullptr && plugin[0] != '\0') return true;
  // NVSHMEM dlopens "nvshmem_bootstrap_uid.so.3" from libnvshmem_host.so.3, whose RPATH is $ORIGIN: the wheel keeps
  // both in one directory.
  const std::string dir = hostLibraryDir();
  if (dir.empty()) return true;  // cannot tell; nvshmemx_get_uniqueid will say
  const std::string path = dir + "/nvshmem_bootstrap_uid.so.3";
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    if (whyNot != nullptr) {
      *whyNot = "NVSHMEM's bootstrap plugin " + path +
                " is missing (set NVSHMEM_BOOTSTRAP_UID_PLUGIN to the path of nvshmem_bootstrap_uid.so.3)";
    }
    return false;
  }
  return true;
}

std::string heapSizeSetting() {
  const char* v = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  return v != nullptr ? std::string(v) : std::string("NVSHMEM's default (1 GiB)");
}

void acquireRuntime(Bootstrap& bootstrap, int device, uint64_t heapBytes) {
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  const int rank = bootstrap.rank(), world = bootstrap.worldSize();
  if (r.initialized) {
    EPCOMM_CHECK(r.rank == rank && r.world == world && r.device == device, kUnavailable,
                 "NVSHMEM is initialised once per process and this process is PE "
                     << r.rank << " of " << r.world << " on CUDA device " << r.device << "; a new object asks for rank "
                     << rank << " of " << world << " on device " << device
                     << " (every nvshmem AllToAll of a process must use the same ranks and device)");
    ++r.refs;
    return;
  }
  // Every rank decides the same way: the variable is either set for the whole job or not at all.
  const char* userHeap = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  if (userHeap == nullptr || userHeap[0] == '\0') {
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heapBytes).c_str(), 1);
  }
  UidMessage msg{};
  if (rank == 0) {
    nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
    msg.status = nvshmemx_get_uniqueid(&uid);
    msg.uid = uid;
  }
  bootstrap.broadcast(&msg, sizeof(msg), 0);
  EPCOMM_CHECK(msg.status == 0, kUnavailable,
               "rank " << rank << ": NVSHMEM's nvshmemx_get_uniqueid failed on rank 0 (status " << msg.status
                       << "); NVSHMEM_DEBUG=WARN says why");
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int rc = nvshmemx_set_attr_uniqueid_args(rank, world, &msg.uid, &attr);
  EPCOMM_CHECK(rc == 0, kUnavailable, "rank " << rank << ": nvshmemx_set_attr_uniqueid_args failed (" << rc << ")");
  // nvshmemx_init_attr, without its exit(-1) on failure (a library never exits the process).
  nvshmemx_init_init_attr_ver_only(attr);
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  EPCOMM_CHECK(rc == 0, kUnavailable,
               "rank " << rank << ": NVSHMEM initialisation failed (status " << rc << ") as PE " << rank << " of "
                       << world << " on CUDA device " << device << " with NVSHMEM_SYMMETRIC_SIZE=" << heapSizeSetting()
                       << "; NVSHMEM_DEBUG=WARN says why");
  EPCOMM_CHECK(nvshmem_my_pe() == rank && nvshmem_n_pes() == world, kInternal,
               "NVSHMEM started as PE " << nvshmem_my_pe() << " of " << nvshmem_n_pes() << ", expected " << rank
                                        << " of " << world);
  r.initialized = true;
  r.rank = rank;
  r.world = world;
  r.device = device;
  r.refs = 1;
  EPCOMM_LOG(kInfo, "NVSHMEM " << NVSHMEM_VENDOR_MAJOR_VERSION << "." << NVSHMEM_VENDOR_MINOR_VERSION << "."
                               << NVSHMEM_VENDOR_PATCH_VERSION << " initialised: PE " << rank << " of " << world
                               << ", device " << device << ", NVSHMEM_SYMMETRIC_SIZE=" << heapSizeSetting());
}

void releaseRuntime() {
  Runtime& r = runtime();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.refs > 0) --r.refs;
}

void* symmetricAlloc(uint64_t bytes, uint32_t rank) {
  void* p = nvshmem_malloc(bytes);
  EPCOMM_CHECK(p != nullptr, kUnavailable,
               "rank " << rank << ": the NVSHMEM symmetric heap has no room for this object's " << bytes
                       << " bytes (NVSHMEM_SYMMETRIC_SIZE=" << heapSizeSetting()
                       << "; the first object of the process sizes the heap from its own plan unless the variable is "
                          "set: raise NVSHMEM_SYMMETRIC_SIZE on every rank, see epcomm-plan --backend nvshmem)");
  return p;
}

void symmetricFree(void* p) {
  if (p != nullptr) nvshmem_free(p);
}

}  // namespace nvshmem
}  // namespace epcomm
