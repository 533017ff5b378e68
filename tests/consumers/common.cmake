# What every CMake consumer builds once it has found dtrain, however it did:
#   dtrain_consumer       main.cpp linked to dtrain::dtrain (every engine)
#   dtrain_consumer_gloo  the same, linked to dtrain::gloo alone; run_consumer.cmake
#                         checks that it does not load MPI, NCCL or the CUDA runtime
# and dtrain_consumer_paths.cmake: where dtrun and the Gloo program are.
add_executable(dtrain_consumer "${CMAKE_CURRENT_LIST_DIR}/main.cpp")
target_link_libraries(dtrain_consumer PRIVATE dtrain::dtrain)

set(gloo_program "")
if(TARGET dtrain::gloo)
  add_executable(dtrain_consumer_gloo "${CMAKE_CURRENT_LIST_DIR}/main.cpp")
  target_link_libraries(dtrain_consumer_gloo PRIVATE dtrain::gloo)
  target_compile_definitions(dtrain_consumer_gloo PRIVATE DTRAIN_CONSUMER_GLOO_ONLY=1)
  # Every library on the link line stays a dependency, used or not, so ldd shows them all.
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND NOT APPLE)
    target_link_options(dtrain_consumer_gloo PRIVATE "LINKER:--no-as-needed")
  endif()
  set(gloo_program "$<TARGET_FILE:dtrain_consumer_gloo>")
endif()
if(NOT TARGET dtrain::dtrun)
  message(FATAL_ERROR "dtrain gave no target dtrain::dtrun")
endif()
file(GENERATE OUTPUT "${CMAKE_BINARY_DIR}/dtrain_consumer_paths.cmake" CONTENT
     "set(DTRUN [==[$<TARGET_FILE:dtrain::dtrun>]==])\nset(GLOO_PROGRAM [==[${gloo_program}]==])\n")
