# What every CMake consumer builds once it has found dtrain, however it did:
#   dtrain_consumer       main.cpp linked to dtrain::dtrain (every engine)
#   dtrain_consumer_gloo  the same, linked to dtrain::gloo alone; run_consumer.cmake
#                         checks that it does not load MPI, NCCL or the CUDA runtime
#   dtrain_consumer_header_only
#                         the same, linked to dtrain::header_only (compiled mode only:
#                         with DTRAIN_HEADER_ONLY every target is header-only already)
# and dtrain_consumer_paths.cmake: where dtrun and the programs are.
#
# DTRAIN_CONSUMER_MODE (run_consumer.cmake sets it) is what dtrain was asked to
# be: `compiled` (the default: its targets are libraries) or `header_only`
# (DTRAIN_HEADER_ONLY=ON, or an installed dtrain built so); main.cpp checks it.
#
# In compiled mode, two programs that must NOT link, built on request:
#   dtrain_consumer_wrong_library  main.cpp compiled for dtrain::dtrain, linked to
#                                  dtrain::gloo's library alone
#   dtrain_consumer_mixed          main.cpp for dtrain::gloo beside a TU for dtrain::dtrain
# run_consumer.cmake checks that the link says why (dtrain/detail/link_check.hpp).
if(NOT DEFINED DTRAIN_CONSUMER_MODE)
  set(DTRAIN_CONSUMER_MODE compiled)
endif()
set(separate 0)
if(DTRAIN_CONSUMER_MODE STREQUAL "compiled")
  set(separate 1)
endif()

add_library(dtrain_consumer_main OBJECT "${CMAKE_CURRENT_LIST_DIR}/main.cpp")
target_link_libraries(dtrain_consumer_main PRIVATE dtrain::dtrain)
target_compile_definitions(dtrain_consumer_main PRIVATE DTRAIN_CONSUMER_EXPECT_SEPARATE=${separate})
add_executable(dtrain_consumer $<TARGET_OBJECTS:dtrain_consumer_main>)
target_link_libraries(dtrain_consumer PRIVATE dtrain::dtrain)

set(header_only_program "")
if(separate)
  add_executable(dtrain_consumer_header_only "${CMAKE_CURRENT_LIST_DIR}/main.cpp")
  target_link_libraries(dtrain_consumer_header_only PRIVATE dtrain::header_only)
  target_compile_definitions(dtrain_consumer_header_only PRIVATE DTRAIN_CONSUMER_EXPECT_SEPARATE=0)
  set(header_only_program "$<TARGET_FILE:dtrain_consumer_header_only>")
endif()

set(gloo_program "")
set(link_checks OFF)
if(TARGET dtrain::gloo)
  add_library(dtrain_consumer_gloo_main OBJECT "${CMAKE_CURRENT_LIST_DIR}/main.cpp")
  target_link_libraries(dtrain_consumer_gloo_main PRIVATE dtrain::gloo)
  target_compile_definitions(dtrain_consumer_gloo_main PRIVATE DTRAIN_CONSUMER_GLOO_ONLY=1
                                                               DTRAIN_CONSUMER_EXPECT_SEPARATE=${separate})
  add_executable(dtrain_consumer_gloo $<TARGET_OBJECTS:dtrain_consumer_gloo_main>)
  target_link_libraries(dtrain_consumer_gloo PRIVATE dtrain::gloo)
  # Every library on the link line stays a dependency, used or not, so ldd shows them all.
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND NOT APPLE)
    target_link_options(dtrain_consumer_gloo PRIVATE "LINKER:--no-as-needed")
  endif()
  set(gloo_program "$<TARGET_FILE:dtrain_consumer_gloo>")

  # dtrain::gloo has a library of its own when another engine is on (with Gloo
  # alone it is dtrain::dtrain's): then mixing the two must not link.
  get_target_property(gloo_type dtrain::gloo TYPE)
  if(separate AND gloo_type MATCHES "^(STATIC|SHARED)_LIBRARY$")
    set(link_checks ON)
    add_executable(dtrain_consumer_wrong_library EXCLUDE_FROM_ALL
                   $<TARGET_OBJECTS:dtrain_consumer_main>)
    target_link_libraries(dtrain_consumer_wrong_library PRIVATE dtrain::gloo)
    add_library(dtrain_consumer_other_unit OBJECT EXCLUDE_FROM_ALL
                "${CMAKE_CURRENT_LIST_DIR}/other_unit.cpp")
    target_link_libraries(dtrain_consumer_other_unit PRIVATE dtrain::dtrain)
    add_executable(dtrain_consumer_mixed EXCLUDE_FROM_ALL $<TARGET_OBJECTS:dtrain_consumer_gloo_main>
                   $<TARGET_OBJECTS:dtrain_consumer_other_unit>)
    target_link_libraries(dtrain_consumer_mixed PRIVATE dtrain::gloo dtrain::dtrain)
  endif()
endif()

set(dtrun_program "")
if(TARGET dtrain::dtrun)
  set(dtrun_program "$<TARGET_FILE:dtrain::dtrun>")
elseif(NOT DTRAIN_CONSUMER_WITHOUT_TOOLS)
  message(FATAL_ERROR "dtrain gave no target dtrain::dtrun")
endif()
file(GENERATE OUTPUT "${CMAKE_BINARY_DIR}/dtrain_consumer_paths.cmake" CONTENT
     "set(DTRUN [==[${dtrun_program}]==])\nset(GLOO_PROGRAM [==[${gloo_program}]==])
set(HEADER_ONLY_PROGRAM [==[${header_only_program}]==])\nset(LINK_CHECKS ${link_checks})\n")
