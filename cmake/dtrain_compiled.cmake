# The library targets (issue 30): compiled by default, as fmt and spdlog do it.
# A program's translation units only declare the policy-dependent code
# (`extern template`, include/dtrain/runtime/compiled.hpp) and link it from a library
# built once, so they compile in seconds instead of half a minute.
#
#   dtrain::core          headers, C++20, threads; no engine (header-only: it has no policy)
#   dtrain::gloo / dtrain::mpi / dtrain::nccl
#                         libdtrain_<engine>: src/<engine>.cpp built with that engine
#                         alone, its libraries and DTRAIN_WITH_<X>=1; defined only
#                         when DTRAIN_WITH_<X> is ON (the engine was found)
#   dtrain::dtrain        libdtrain: every engine that is switched on, each src/<engine>.cpp
#                         built with all of them
#   dtrain::header_only   dtrain::dtrain's headers and engines, without the library
#   dtrain::compiled      an alias of dtrain::dtrain (its name before issue 30)
#   dtrain::torch         dtrain::torch's compiled part, compiled in the target that links
#                         it (below); with an engine target beside it
# The libraries define DTRAIN_SEPARATE_COMPILATION=1 for their users.
#
# DTRAIN_HEADER_ONLY=ON makes dtrain::dtrain and dtrain::<engine> header-only
# (what they were before issue 30): no library is built or installed.
#
# Why one library per set of engines, and not the engine parts shared: the
# engines change what the same code does (with NCCL, CUDA is compiled in and
# the MPI engine reaches device memory; with MPI, a failed rank ends the MPI
# job), and every TU of a program must see the bodies its library holds. So a
# TU compiled for dtrain::gloo (Gloo alone) links libdtrain_gloo, one compiled
# for dtrain::dtrain links libdtrain, and a program that mixes the two does not
# link: the link check (include/dtrain/detail/link_check.hpp, src/link_check.cpp)
# makes it a multiple definition of
# `dtrain::detail::link_check::every_unit_must_use_the_same_dtrain_engines`,
# where link order would otherwise pick one body silently. With one engine
# switched on, dtrain::<engine> is dtrain::dtrain's library: the sets are equal.
include_guard(GLOBAL)

option(DTRAIN_HEADER_ONLY
       "dtrain::dtrain and dtrain::<engine> header-only: build and install no library (dtrain::header_only is header-only either way)"
       OFF)
if(DEFINED DTRAIN_SEPARATE_COMPILATION AND NOT DTRAIN_SEPARATE_COMPILATION STREQUAL "")
  message(WARNING "DTRAIN_SEPARATE_COMPILATION=${DTRAIN_SEPARATE_COMPILATION} is no longer used: "
                  "dtrain::dtrain is compiled by default (dtrain::compiled is an alias of it); "
                  "configure with -DDTRAIN_HEADER_ONLY=ON, or link dtrain::header_only, for the "
                  "header-only form.")
endif()

add_library(dtrain_header_only INTERFACE)
add_library(dtrain::header_only ALIAS dtrain_header_only)
set_target_properties(dtrain_header_only PROPERTIES EXPORT_NAME header_only)
target_link_libraries(dtrain_header_only INTERFACE dtrain_core)
dtrain_link_engines(dtrain_header_only INTERFACE ${DTRAIN_ENGINES})

# _dtrain_library(<target> <export name> <engine>...): dtrain::<export name>,
# the library of those engines (its file: lib<target>.a), or with
# DTRAIN_HEADER_ONLY the same usage requirements without it.
function(_dtrain_library target export_name)
  if(DTRAIN_HEADER_ONLY)
    add_library(${target} INTERFACE)
    target_link_libraries(${target} INTERFACE dtrain_core)
    dtrain_link_engines(${target} INTERFACE ${ARGN})
  else()
    set(sources "${PROJECT_SOURCE_DIR}/src/link_check.cpp" "${PROJECT_SOURCE_DIR}/src/core.cpp")
    foreach(engine IN LISTS ARGN)
      string(TOLOWER "${engine}" engine)
      list(APPEND sources "${PROJECT_SOURCE_DIR}/src/${engine}.cpp")  # one per engine: parallel builds
    endforeach()
    # Static unless BUILD_SHARED_LIBS; position-independent, so a shared library may link it.
    # Under add_subdirectory/FetchContent, built only when something links it.
    add_library(${target} ${_dtrain_library_exclude} ${sources})
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    target_link_libraries(${target} PUBLIC dtrain_core)
    dtrain_link_engines(${target} PUBLIC ${ARGN})
    target_compile_definitions(${target} PUBLIC DTRAIN_SEPARATE_COMPILATION=1)
    # A user's newer compiler must not fail the user's build on a warning. In
    # dtrain's own build the library is built with the warnings of
    # compile.strict_* (tests/CMakeLists.txt), which check what it compiles.
    if(PROJECT_IS_TOP_LEVEL)
      dtrain_strict_warnings(${target})
    endif()
  endif()
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${export_name})
  add_library(dtrain::${export_name} ALIAS ${target})
  set_property(GLOBAL APPEND PROPERTY DTRAIN_LIBRARY_TARGETS ${target})
endfunction()

set(_dtrain_library_exclude "")
if(NOT PROJECT_IS_TOP_LEVEL AND NOT DTRAIN_INSTALL)  # what is installed must be built
  set(_dtrain_library_exclude EXCLUDE_FROM_ALL)
endif()
set_property(GLOBAL PROPERTY DTRAIN_LIBRARY_TARGETS dtrain_core dtrain_header_only)
_dtrain_library(dtrain dtrain ${DTRAIN_ENGINES})
foreach(_dtrain_engine IN LISTS DTRAIN_ENGINES)
  string(TOLOWER "${_dtrain_engine}" _dtrain_component)
  if(DTRAIN_ENGINES STREQUAL _dtrain_engine)  # the only engine: the same set as dtrain::dtrain
    add_library(dtrain_${_dtrain_component} INTERFACE)
    target_link_libraries(dtrain_${_dtrain_component} INTERFACE dtrain)
    set_target_properties(dtrain_${_dtrain_component} PROPERTIES EXPORT_NAME ${_dtrain_component})
    add_library(dtrain::${_dtrain_component} ALIAS dtrain_${_dtrain_component})
    set_property(GLOBAL APPEND PROPERTY DTRAIN_LIBRARY_TARGETS dtrain_${_dtrain_component})
  else()
    _dtrain_library(dtrain_${_dtrain_component} ${_dtrain_component} ${_dtrain_engine})
  endif()
endforeach()
unset(_dtrain_engine)
unset(_dtrain_component)
unset(_dtrain_library_exclude)
add_library(dtrain::compiled ALIAS dtrain)

# A test build on a machine without a GPU (DTRAIN_COMPILE_ONLY names `gpu`,
# cmake/dtrain_warnings.cmake) can only compile NCCL's code, never run it: there
# NCCL's parts of the libraries (src/nccl.cpp, and Gloo- or MPI-free
# libdtrain_nccl) are compile checks, built without optimisation. A build to
# install leaves DTRAIN_COMPILE_ONLY empty.
if("gpu" IN_LIST DTRAIN_COMPILE_ONLY AND NOT DTRAIN_HEADER_ONLY AND "NCCL" IN_LIST DTRAIN_ENGINES)
  set_source_files_properties("${PROJECT_SOURCE_DIR}/src/nccl.cpp" PROPERTIES COMPILE_OPTIONS -O0)
  get_target_property(_dtrain_nccl_type dtrain_nccl TYPE)
  if(_dtrain_nccl_type MATCHES "_LIBRARY$" AND NOT _dtrain_nccl_type STREQUAL "INTERFACE_LIBRARY")
    dtrain_compile_check(dtrain_nccl)
  endif()
  unset(_dtrain_nccl_type)
endif()

# dtrain::torch: the compiled part of dtrain::torch::DistributedDataParallel
# (src/torch.cpp, dtrain/torch/compiled.hpp). LibTorch's ABI is the user's, so
# it is not built here: it is a source of each target that links dtrain::torch,
# compiled once there with that target's engines and LibTorch (the `torch`
# target of find_package(Torch), which must exist by generation time). Link it
# beside the engine target: `dtrain::gloo dtrain::torch`. Header-only with
# DTRAIN_HEADER_ONLY=ON.
add_library(dtrain_torch INTERFACE)
set_target_properties(dtrain_torch PROPERTIES EXPORT_NAME torch)
add_library(dtrain::torch ALIAS dtrain_torch)
target_link_libraries(dtrain_torch INTERFACE dtrain_core torch)
if(NOT DTRAIN_HEADER_ONLY)
  target_sources(dtrain_torch INTERFACE
    "$<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/src/torch.cpp>"
    "$<INSTALL_INTERFACE:$<INSTALL_PREFIX>/${CMAKE_INSTALL_DATADIR}/dtrain/src/torch.cpp>")
  target_compile_definitions(dtrain_torch INTERFACE DTRAIN_TORCH_SEPARATE_COMPILATION=1)
endif()
set_property(GLOBAL APPEND PROPERTY DTRAIN_LIBRARY_TARGETS dtrain_torch)
get_property(DTRAIN_LIBRARY_TARGETS GLOBAL PROPERTY DTRAIN_LIBRARY_TARGETS)
