# LibTorch, for dtrain/torch.hpp (dtrain::torch::DistributedDataParallel): an
# optional integration, found only when LibTorch is present. Its test, example
# and benchmark are built when it is found and skipped, with the reason,
# otherwise. Debian: apt-get install libtorch-dev (1.13); elsewhere point
# CMAKE_PREFIX_PATH (or Torch_DIR) at a LibTorch download.
#
# Defines DTRAIN_TORCH_FOUND, DTRAIN_TORCH_VERSION, DTRAIN_TORCH_CUDA (LibTorch
# has its CUDA headers: a CPU-only build, Debian's, lacks them or ships them
# incomplete) and, when found, the
# targets dtrain_torch_libraries (LibTorch's libraries and include dirs, with
# its own compile flags; link it beside a dtrain engine target) and
# dtrain_torch_part_<engine> (below).
option(DTRAIN_WITH_TORCH "Build the LibTorch integration's tests, example and benchmark when LibTorch is found" ON)
set(DTRAIN_TORCH_FOUND OFF)
set(DTRAIN_TORCH_VERSION "")
set(DTRAIN_TORCH_CUDA OFF)
set(DTRAIN_TORCH_MISSING "")
if(NOT DTRAIN_WITH_TORCH)
  set(DTRAIN_TORCH_MISSING "DTRAIN_WITH_TORCH is OFF")
else()
  find_package(Torch QUIET)
  if(NOT Torch_FOUND)
    set(DTRAIN_TORCH_MISSING "needs LibTorch (find_package(Torch) found none; Debian: apt-get install libtorch-dev, or set Torch_DIR)")
  else()
    set(DTRAIN_TORCH_FOUND ON)
    set(DTRAIN_TORCH_VERSION "${Torch_VERSION}")
    foreach(_dtrain_dir IN LISTS TORCH_INCLUDE_DIRS)
      if(EXISTS "${_dtrain_dir}/c10/cuda/impl/cuda_cmake_macros.h")
        set(DTRAIN_TORCH_CUDA ON)
      endif()
    endforeach()
    unset(_dtrain_dir)
    add_library(dtrain_torch_libraries INTERFACE)
    target_link_libraries(dtrain_torch_libraries INTERFACE ${TORCH_LIBRARIES})
    # SYSTEM: LibTorch's headers do not pass dtrain's -Wpedantic -Werror.
    target_include_directories(dtrain_torch_libraries SYSTEM INTERFACE ${TORCH_INCLUDE_DIRS})
    if(TORCH_CXX_FLAGS)
      separate_arguments(_dtrain_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
      target_compile_options(dtrain_torch_libraries INTERFACE ${_dtrain_torch_flags})
    endif()
    message(STATUS "dtrain: LibTorch ${Torch_VERSION} found: dtrain/torch.hpp's tests, example and benchmark are built")
    # dtrain::torch's compiled part for the programs here, once per engine: a
    # user's program compiles it once by linking dtrain::torch; here the test,
    # the example and the benchmark of an engine share one. Link
    # dtrain_torch_part_<engine> instead of dtrain::<engine> and dtrain_torch_libraries.
    foreach(_dtrain_engine IN LISTS DTRAIN_ENGINES)
      string(TOLOWER "${_dtrain_engine}" _dtrain_engine)
      add_library(dtrain_torch_part_${_dtrain_engine} OBJECT EXCLUDE_FROM_ALL)  # sources: dtrain::torch's
      target_link_libraries(dtrain_torch_part_${_dtrain_engine}
        PUBLIC dtrain::${_dtrain_engine} dtrain_torch_libraries PRIVATE dtrain::torch)
      target_compile_definitions(dtrain_torch_part_${_dtrain_engine} PUBLIC DTRAIN_TORCH_SEPARATE_COMPILATION=1)
      # The warnings of compile.torch_strict_*, which leaves the part to this build.
      dtrain_strict_warnings(dtrain_torch_part_${_dtrain_engine})
    endforeach()
    unset(_dtrain_engine)
  endif()
endif()
if(DTRAIN_TORCH_MISSING)
  message(STATUS "dtrain: ${DTRAIN_TORCH_MISSING}: dtrain/torch.hpp's tests, example and benchmark are skipped")
endif()
