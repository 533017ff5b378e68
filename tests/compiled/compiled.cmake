# The two forms of the library (cmake/dtrain_compiled.cmake): included from
# tests/CMakeLists.txt. dtrain::dtrain is compiled by default, so nearly every
# test program links the library; these tests check what that promises, and
# keep one real multi-rank program header-only. The header checks, compile.odr,
# compile.strict_*, the nvcc checks and the single-header runs (single.*) are
# header-only too (tests/CMakeLists.txt), as are consumer.*.header_only.
if(DTRAIN_HEADER_ONLY)
  foreach(test IN ITEMS compiled.thin_tu training.demo.gloo_header_only)
    dtrain_add_skipped_test(${test} "DTRAIN_HEADER_ONLY is ON: no library to test")
  endforeach()
  return()
endif()
if(NOT DTRAIN_WITH_GLOO)
  foreach(test IN ITEMS compiled.thin_tu training.demo.gloo_header_only)
    dtrain_add_skipped_test(${test} "needs Gloo (DTRAIN_WITH_GLOO is OFF)")
  endforeach()
  return()
endif()

# compiled.thin_tu: a program's TU that calls run<> (and one that also builds a
# DistributedDataParallel), linked to dtrain::dtrain, defines none of the code
# that the library holds (context's constructor, run's process, the store
# server and client, the node agent, basic_ddp): what makes it compile fast.
# Optimised builds only: at -O0, GCC 12 emits every inline coroutine of the
# store server (rendezvous/server.hpp) in each TU that includes it, with what
# they call, whatever the TU uses.
if(CMAKE_BUILD_TYPE STREQUAL "Debug")
  dtrain_add_skipped_test(compiled.thin_tu
    "at -O0 GCC emits the store server's inline coroutines in every TU (build type Debug)")
else()
  add_library(dtrain_compiled_thin_tu OBJECT
              "${PROJECT_SOURCE_DIR}/bench/compile_time/run_only.cpp"
              "${PROJECT_SOURCE_DIR}/bench/compile_time/demo.cpp")
  target_link_libraries(dtrain_compiled_thin_tu PRIVATE dtrain::dtrain)
  dtrain_target_warnings(dtrain_compiled_thin_tu)
  dtrain_add_test(compiled.thin_tu
    COMMAND "${CMAKE_COMMAND}" "-DOBJECTS=$<TARGET_OBJECTS:dtrain_compiled_thin_tu>"
            "-DNM=${CMAKE_NM}" -P "${CMAKE_CURRENT_LIST_DIR}/check_thin_tu.cmake")
endif()

# training.demo.gloo_header_only: the training demo (examples/train_mlp.cpp)
# built against dtrain::header_only trains, and its ranks end with identical
# weights (the check of training.demo.gloo, whose program links the library).
include(dtrain_example_blas)
add_executable(dtrain_train_mlp_header_only "${PROJECT_SOURCE_DIR}/examples/train_mlp.cpp")
target_link_libraries(dtrain_train_mlp_header_only PRIVATE dtrain::header_only dtrain_example_blas)
dtrain_target_warnings(dtrain_train_mlp_header_only)
# What it checks is the header-only form, not the optimiser (training.demo.gloo
# runs the demo at the build's level): -O0, in a third of the time of -O3.
dtrain_compile_check(dtrain_train_mlp_header_only)
dtrain_add_test(training.demo.gloo_header_only
  COMMAND "${CMAKE_COMMAND}" -DCASE=gloo "-DTRAIN=$<TARGET_FILE:dtrain_train_mlp_header_only>"
          -P "${PROJECT_SOURCE_DIR}/tests/training/check_demo.cmake"
  TIMEOUT 180
  PROPERTIES PROCESSORS 4)
