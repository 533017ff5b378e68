# nvcc for dtrain's own CUDA programs (examples, tests). There may be no GPU
# to detect an architecture from, so the default covers the GPUs in use from
# Turing to Hopper (CUDA 13 dropped the older ones): 75;80;86;89;90. Set
# CMAKE_CUDA_ARCHITECTURES (e.g. `native` on a GPU machine) or CUDAARCHS to choose.
include_guard(GLOBAL)
include(CheckLanguage)

# dtrain_find_cuda(): enables CUDA when nvcc is found (/usr/local/cuda too);
# CMAKE_CUDA_COMPILER says whether it was. A macro: enable_language() must be
# called at file scope.
macro(dtrain_find_cuda)
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(ENV{CUDACXX} /usr/local/cuda/bin/nvcc)
  endif()
  # Chosen here, once per build directory, and kept in the cache: CMake reads
  # CUDAARCHS only when it first determines the compiler, so a later configure
  # of the same directory (the tests' after the demo's, a user's own) must find
  # the choice in the cache, never an empty value.
  if(NOT CMAKE_CUDA_ARCHITECTURES)  # unset, or left empty by an earlier configure
    if(NOT "$ENV{CUDAARCHS}" STREQUAL "")
      set(dtrain_cuda_archs "$ENV{CUDAARCHS}")
    else()
      set(dtrain_cuda_archs 75 80 86 89 90)
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${dtrain_cuda_archs}" CACHE STRING
        "CUDA architectures of dtrain's own CUDA programs (CUDAARCHS on a first configure)" FORCE)
    unset(dtrain_cuda_archs)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
  endif()
endmacro()

# dtrain_cuda_program(<target>): C++20 under nvcc, dtrain's warnings, and one
# CUDA runtime per process (the shared one that NCCL::NCCL brings).
function(dtrain_cuda_program target)
  set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Shared)
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON)
  else()  # CMake before 3.26 does not know nvcc's C++20 flag
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>")
  endif()
  dtrain_target_warnings(${target})
endfunction()

# dtrain_cuda_compile_check(<target>): a program that checks what nvcc makes of
# dtrain's host code (it launches no kernel of its own): one architecture, the
# first of CMAKE_CUDA_ARCHITECTURES, is enough, and each extra one costs a full
# device-side pass over dtrain.hpp.
function(dtrain_cuda_compile_check target)
  dtrain_cuda_program(${target})
  list(GET CMAKE_CUDA_ARCHITECTURES 0 first)
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${first}")
endfunction()
