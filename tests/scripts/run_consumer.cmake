# Configures, builds and runs one consumer project from tests/consumers/: a tiny
# program that uses dtrain the way a user's project would, entirely offline.
#
#   cmake -DCONSUMER=<find_package|add_subdirectory|fetch_content|single_header>
#         -DSOURCE_DIR=<dtrain checkout> -DWORK_DIR=<scratch dir>
#         -DINIT_CACHE=<settings of this build> -DGENERATOR=<generator> -DCONFIG=<config>
#         -DVERSION=<dtrain version> -P run_consumer.cmake
cmake_minimum_required(VERSION 3.21)
include("${CMAKE_CURRENT_LIST_DIR}/clean_env.cmake")

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer.${CONSUMER}: ${what} failed (exit status ${rc}):\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

dtrain_clean_launcher_env()

set(extra_args "")
if(CONSUMER STREQUAL "fetch_content")
  # FetchContent clones commits, so this consumer needs the checkout's HEAD.
  execute_process(COMMAND git -C "${SOURCE_DIR}" rev-parse --show-toplevel
                  RESULT_VARIABLE rc OUTPUT_VARIABLE toplevel
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  file(REAL_PATH "${SOURCE_DIR}" source_dir)
  if(rc EQUAL 0 AND EXISTS "${toplevel}")
    file(REAL_PATH "${toplevel}" toplevel)
  endif()
  if(NOT rc EQUAL 0 OR NOT toplevel STREQUAL source_dir)
    message("SKIPPED: ${SOURCE_DIR} is not the top of a git checkout (or git is missing)")
    return()
  endif()
  execute_process(COMMAND git -C "${SOURCE_DIR}" rev-parse --verify --quiet HEAD
                  RESULT_VARIABLE rc OUTPUT_VARIABLE head
                  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message("SKIPPED: ${SOURCE_DIR} has no commit yet; FetchContent can only fetch commits")
    return()
  endif()
  message(STATUS "consumer.fetch_content: fetching commit ${head} (without uncommitted changes)")
  set(extra_args "-DDTRAIN_GIT_TAG=${head}")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
step("configure"
  "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/consumers/${CONSUMER}" -B "${WORK_DIR}"
  -G "${GENERATOR}" -C "${INIT_CACHE}" "-DDTRAIN_SOURCE_DIR=${SOURCE_DIR}" ${extra_args})
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
step("build" "${CMAKE_COMMAND}" --build "${WORK_DIR}" ${config_args})

find_program(program dtrain_consumer PATHS "${WORK_DIR}" "${WORK_DIR}/${CONFIG}" NO_DEFAULT_PATH)
execute_process(COMMAND "${program}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer.${CONSUMER}: dtrain_consumer exited ${rc}:\n${out}${err}")
endif()
# Expected: "<version> <world as JSON>", world size 1 (no launcher variables).
if(NOT out MATCHES "^([^ ]+) ({[^\n]*})\n?$")
  message(FATAL_ERROR "consumer.${CONSUMER}: unexpected output:\n${out}")
endif()
set(json "${CMAKE_MATCH_2}")
if(NOT CMAKE_MATCH_1 STREQUAL VERSION)
  message(FATAL_ERROR "consumer.${CONSUMER}: printed version ${CMAKE_MATCH_1}, expected ${VERSION}")
endif()
string(JSON world_size GET "${json}" world_size)
if(NOT world_size STREQUAL "1")
  message(FATAL_ERROR "consumer.${CONSUMER}: world_size ${world_size}, expected 1: ${json}")
endif()
message(STATUS "consumer.${CONSUMER}: ${out}")

if(CONSUMER STREQUAL "single_header")
  return()
endif()
include("${WORK_DIR}/dtrain_consumer_paths.cmake")  # DTRUN, GLOO_PROGRAM (common.cmake)

# dtrun: a subproject builds it on request (it is not in `all` there); an
# installed package brings it along.
if(NOT CONSUMER STREQUAL "find_package")
  step("build dtrun" "${CMAKE_COMMAND}" --build "${WORK_DIR}" ${config_args} --target dtrun)
endif()
step("dtrun --help" "${DTRUN}" --help)
if(NOT out MATCHES "usage: dtrun ")
  message(FATAL_ERROR "consumer.${CONSUMER}: ${DTRUN} --help printed no usage:\n${out}")
endif()
message(STATUS "consumer.${CONSUMER}: ${DTRUN} --help works")

# A program linked to dtrain::gloo loads Gloo and no other engine.
if(GLOO_PROGRAM)
  step("ldd" ldd "${GLOO_PROGRAM}")
  if(NOT out MATCHES "libgloo")
    message(FATAL_ERROR "consumer.${CONSUMER}: ${GLOO_PROGRAM} does not load libgloo:\n${out}")
  endif()
  if(out MATCHES "(libmpi[^ ]*|libnccl[^ ]*|libcudart[^ ]*)")
    message(FATAL_ERROR "consumer.${CONSUMER}: ${GLOO_PROGRAM}, linked to dtrain::gloo alone, "
                        "loads ${CMAKE_MATCH_1}:\n${out}")
  endif()
  message(STATUS "consumer.${CONSUMER}: a dtrain::gloo program loads no MPI, NCCL or CUDA runtime")
endif()
