# FindNCCL
# --------
# Finds NVIDIA's NCCL (nccl.h and libnccl) and defines the imported target
# NCCL::NCCL, which also links CUDA::cudart: code that calls NCCL always calls
# the CUDA runtime too (streams, device selection).
#
# Searched, in order: NCCL_ROOT (CMake or environment variable), CUDAToolkit_ROOT,
# the CUDA toolkit found by FindCUDAToolkit, /usr/local/cuda, then the system
# paths (Debian's libnccl-dev installs into /usr).
#
# Result variables: NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIR, NCCL_LIBRARY.

include(FindPackageHandleStandardArgs)

# NCCL is useless without the CUDA runtime, so the toolkit is part of "found".
find_package(CUDAToolkit QUIET)

set(_nccl_hints
    ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_ROOT} $ENV{CUDAToolkit_ROOT}
    ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda)

find_path(NCCL_INCLUDE_DIR nccl.h
          HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include)
find_library(NCCL_LIBRARY nccl
             HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib64 lib lib/x86_64-linux-gnu)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part IN ITEMS MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NCCL_${_part} +([0-9]+).*" "\\1" _nccl_${_part}
           "${_nccl_version_lines}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR CUDAToolkit_FOUND
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES CUDA::cudart)
endif()

unset(_nccl_hints)
unset(_nccl_version_lines)
