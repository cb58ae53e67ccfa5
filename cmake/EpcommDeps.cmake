# Detects optional dependencies. Each sets EPCOMM_HAVE_<X> (ON/OFF); a backend that is not built reports
# kNotBuilt at run time through the factory.
include(CheckLanguage)

set(EPCOMM_HAVE_CUDA OFF)
if(EPCOMM_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # One CUDA runtime per process: the shared libcudart (the one PyTorch and NCCL load too). The default static
    # runtime would put a second copy beside the shared one that CUDA::cudart brings in.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(EPCOMM_HAVE_CUDA ON)
  else()
    message(STATUS "epcomm: no CUDA compiler found; GPU backends are not built")
  endif()
endif()

# NCCL: only the benchmark's baseline uses it. Search the toolkit and the nvidia-nccl pip wheel.
set(EPCOMM_HAVE_NCCL OFF)
if(EPCOMM_HAVE_CUDA)
  execute_process(COMMAND python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))"
                  OUTPUT_VARIABLE _epcomm_nvidia_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_epcomm_nvidia_site}/nvidia/nccl/include
            ${_epcomm_nvidia_site}/nvidia/cu13/include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR}
               ${_epcomm_nvidia_site}/nvidia/nccl/lib ${_epcomm_nvidia_site}/nvidia/cu13/lib)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(EPCOMM_HAVE_NCCL ON)
  endif()
endif()

set(EPCOMM_HAVE_LIBFABRIC OFF)
if(EPCOMM_WITH_LIBFABRIC)
  find_path(LIBFABRIC_INCLUDE_DIR rdma/fabric.h)
  find_library(LIBFABRIC_LIBRARY NAMES fabric libfabric.so.1)
  # A machine with the library but without its development files (the GPU image): libfabric's own headers, kept
  # in third_party/ (1.17, the ABI that libfabric.so.1 keeps), against the installed libfabric.so.1.
  if(LIBFABRIC_LIBRARY AND NOT LIBFABRIC_INCLUDE_DIR)
    set(LIBFABRIC_INCLUDE_DIR ${PROJECT_SOURCE_DIR}/third_party/libfabric/include CACHE PATH "" FORCE)
    message(STATUS "epcomm: libfabric headers from third_party/libfabric (library ${LIBFABRIC_LIBRARY})")
  endif()
  if(LIBFABRIC_INCLUDE_DIR AND LIBFABRIC_LIBRARY)
    set(EPCOMM_HAVE_LIBFABRIC ON)
  else()
    message(STATUS "epcomm: libfabric headers/library not found (apt-get install libfabric-dev)")
  endif()
endif()

set(EPCOMM_HAVE_VERBS OFF)
if(EPCOMM_WITH_VERBS)
  find_path(VERBS_INCLUDE_DIR infiniband/verbs.h)
  find_library(VERBS_LIBRARY NAMES ibverbs libibverbs.so.1)
  if(VERBS_INCLUDE_DIR AND VERBS_LIBRARY)
    set(EPCOMM_HAVE_VERBS ON)
  else()
    message(STATUS "epcomm: libibverbs headers/library not found (apt-get install libibverbs-dev)")
  endif()
endif()

set(EPCOMM_HAVE_NVSHMEM OFF)
# NVSHMEM: the nvidia-nvshmem-cu13 wheel (python3's site-packages nvidia/nvshmem/{include,lib}) or NVSHMEM_HOME. The
# wheel ships libnvshmem_host.so.3 without an unversioned name and without a CMake package, so the libraries are found
# by file name and linked by full path. Off (the rest builds) when not found.
if(EPCOMM_WITH_NVSHMEM AND EPCOMM_HAVE_CUDA)
  set(_epcomm_nvshmem_hints ${NVSHMEM_HOME} $ENV{NVSHMEM_HOME})
  if(_epcomm_nvidia_site)
    list(APPEND _epcomm_nvshmem_hints ${_epcomm_nvidia_site}/nvidia/nvshmem)
  endif()
  find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_epcomm_nvshmem_hints} PATH_SUFFIXES include include/nvshmem)
  find_library(NVSHMEM_HOST_LIBRARY NAMES nvshmem_host libnvshmem_host.so.3 HINTS ${_epcomm_nvshmem_hints}
               PATH_SUFFIXES lib lib64)
  find_library(NVSHMEM_DEVICE_LIBRARY NAMES libnvshmem_device.a nvshmem_device HINTS ${_epcomm_nvshmem_hints}
               PATH_SUFFIXES lib lib64)
  # CUDA 13 moved CCCL (cuda/std, thrust, cub) under include/cccl; NVSHMEM's headers include <cuda/std/...>.
  set(EPCOMM_NVSHMEM_CCCL_DIR "")
  foreach(_dir ${CUDAToolkit_INCLUDE_DIRS})
    if(EXISTS ${_dir}/cccl/cuda/std)
      set(EPCOMM_NVSHMEM_CCCL_DIR ${_dir}/cccl)
    endif()
  endforeach()
  if(NVSHMEM_INCLUDE_DIR AND NVSHMEM_HOST_LIBRARY AND NVSHMEM_DEVICE_LIBRARY)
    file(STRINGS ${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h _epcomm_nvshmem_version
         REGEX "define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
    string(REGEX REPLACE "[^0-9;]*([0-9]+)[^;]*" "\\1." _epcomm_nvshmem_version "${_epcomm_nvshmem_version}")
    string(REPLACE ";" "" _epcomm_nvshmem_version "${_epcomm_nvshmem_version}")
    string(REGEX REPLACE "\\.$" "" _epcomm_nvshmem_version "${_epcomm_nvshmem_version}")
    set(EPCOMM_HAVE_NVSHMEM ON)
    message(STATUS "epcomm: NVSHMEM ${_epcomm_nvshmem_version} (${NVSHMEM_HOST_LIBRARY})")
  else()
    message(STATUS "epcomm: NVSHMEM not found (pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME); the nvshmem "
                   "backend is not built")
  endif()
endif()
