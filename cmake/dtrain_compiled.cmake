# Separate compilation (issue 14): dtrain::compiled, a library of the
# policy-dependent code (context, run's agent and worker, and with them the
# store, the agent and the engine glue) for the standard policies, so that a
# program's own translation units only declare it (`extern template`,
# include/dtrain/compiled.hpp). Header-only dtrain::dtrain stays the default.
#
#   cmake -DDTRAIN_SEPARATE_COMPILATION=ON ...   then link dtrain::compiled
#
# dtrain::compiled brings dtrain::dtrain (headers, engines) and defines
# DTRAIN_SEPARATE_COMPILATION=1 for its users. dtrain's own tests build it
# whatever the option, to check that the separate mode builds and runs.
include_guard(GLOBAL)

option(DTRAIN_SEPARATE_COMPILATION
       "Build dtrain::compiled: dtrain's policy code compiled once, for faster builds of programs that link it"
       OFF)

if(NOT DTRAIN_SEPARATE_COMPILATION AND NOT DTRAIN_BUILD_TESTS)
  return()
endif()

# One source per engine (src/<engine>.cpp), so that they build in parallel, and
# the link check's symbols (src/link_check.cpp, dtrain/detail/link_check.hpp).
set(_dtrain_compiled_sources "")
foreach(_engine IN LISTS DTRAIN_ENGINES)
  string(TOLOWER "${_engine}" _engine)
  list(APPEND _dtrain_compiled_sources "${PROJECT_SOURCE_DIR}/src/${_engine}.cpp")
endforeach()

if(_dtrain_compiled_sources)
  list(APPEND _dtrain_compiled_sources "${PROJECT_SOURCE_DIR}/src/link_check.cpp")
  # Static unless BUILD_SHARED_LIBS; position-independent, so a shared library may link it.
  add_library(dtrain_compiled ${_dtrain_compiled_sources})
  set_target_properties(dtrain_compiled PROPERTIES POSITION_INDEPENDENT_CODE ON
                                                   OUTPUT_NAME dtrain_compiled)
  target_link_libraries(dtrain_compiled PUBLIC dtrain::dtrain)
  target_compile_definitions(dtrain_compiled PUBLIC DTRAIN_SEPARATE_COMPILATION=1)
  if(PROJECT_IS_TOP_LEVEL)  # a user's newer compiler must not fail the user's build on a warning
    dtrain_target_warnings(dtrain_compiled)
  endif()
else()
  # No engine, no policy to compile: the headers alone.
  add_library(dtrain_compiled INTERFACE)
  target_link_libraries(dtrain_compiled INTERFACE dtrain::dtrain)
endif()
add_library(dtrain::compiled ALIAS dtrain_compiled)
unset(_dtrain_compiled_sources)

if(NOT DTRAIN_BUILD_TESTS)
  return()
endif()
if(NOT DTRAIN_WITH_GLOO)
  foreach(_test IN ITEMS demo thin_tu)
    dtrain_add_skipped_test(compiled.${_test} "needs Gloo (DTRAIN_WITH_GLOO is OFF)")
  endforeach()
  return()
endif()

# compiled.demo: the training demo built against dtrain::compiled trains, and
# its ranks end with identical weights (the check of training.demo.gloo).
add_executable(dtrain_train_mlp_compiled "${PROJECT_SOURCE_DIR}/examples/train_mlp.cpp")
target_link_libraries(dtrain_train_mlp_compiled PRIVATE dtrain::compiled)
dtrain_target_warnings(dtrain_train_mlp_compiled)
dtrain_add_test(compiled.demo
  COMMAND "${CMAKE_COMMAND}" -DCASE=gloo "-DTRAIN=$<TARGET_FILE:dtrain_train_mlp_compiled>"
          -P "${PROJECT_SOURCE_DIR}/tests/training/check_demo.cmake"
  TIMEOUT 180
  PROPERTIES PROCESSORS 4)

# compiled.thin_tu: a program's TU that calls run<> (and one that also builds a
# DistributedDataParallel) in separate mode defines none of the code that
# dtrain::compiled holds (context's constructor, run's process, the store
# server and client, the node agent, basic_ddp): what makes it compile fast.
add_library(dtrain_compiled_thin_tu OBJECT "${PROJECT_SOURCE_DIR}/bench/compile_time/run_only.cpp"
                                           "${PROJECT_SOURCE_DIR}/bench/compile_time/demo.cpp")
target_link_libraries(dtrain_compiled_thin_tu PRIVATE dtrain::compiled)
dtrain_target_warnings(dtrain_compiled_thin_tu)
dtrain_add_test(compiled.thin_tu
  COMMAND "${CMAKE_COMMAND}" "-DOBJECTS=$<TARGET_OBJECTS:dtrain_compiled_thin_tu>"
          "-DNM=${CMAKE_NM}" -P "${PROJECT_SOURCE_DIR}/tests/compiled/check_thin_tu.cmake")
