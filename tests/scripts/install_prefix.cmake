# Installs this build into a fresh prefix, for the find_package consumer test.
#
#   cmake -DBUILD_DIR=<build> -DPREFIX=<prefix> -DCONFIG=<config> -P install_prefix.cmake
cmake_minimum_required(VERSION 3.21)

file(REMOVE_RECURSE "${PREFIX}")  # leftovers of an older install must not satisfy the consumer
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (exit status ${rc})")
endif()
