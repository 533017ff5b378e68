# Configures, builds and runs one consumer project from tests/consumers/: a tiny
# program that uses dtrain the way a user's project would, entirely offline.
#
#   cmake -DCONSUMER=<find_package|add_subdirectory|fetch_content|single_header>
#         [-DMODE=<compiled|header_only>] [-DPREFIX_PATH=<dirs, |-separated>]
#         -DSOURCE_DIR=<dtrain checkout> -DWORK_DIR=<scratch dir>
#         -DINIT_CACHE=<settings of this build> -DGENERATOR=<generator> -DCONFIG=<config>
#         -DVERSION=<dtrain version> -P run_consumer.cmake
#
# MODE is the form of dtrain the consumer gets: `compiled` (the default) or
# `header_only` (DTRAIN_HEADER_ONLY=ON in the consumer's build; for find_package,
# the header-only install on PREFIX_PATH, which has no tools).
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

if(NOT MODE)
  set(MODE compiled)
endif()
set(extra_args "-DDTRAIN_CONSUMER_MODE=${MODE}")
if(PREFIX_PATH)
  string(REPLACE "|" ";" PREFIX_PATH "${PREFIX_PATH}")
  list(APPEND extra_args "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}")
endif()
if(MODE STREQUAL "header_only")
  if(CONSUMER STREQUAL "find_package")
    list(APPEND extra_args -DDTRAIN_CONSUMER_WITHOUT_TOOLS=ON)
  else()
    list(APPEND extra_args -DDTRAIN_HEADER_ONLY=ON)
  endif()
endif()
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
  list(APPEND extra_args "-DDTRAIN_GIT_TAG=${head}")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
step("configure"
  "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/consumers/${CONSUMER}" -B "${WORK_DIR}"
  -G "${GENERATOR}" -C "${INIT_CACHE}" "-DDTRAIN_SOURCE_DIR=${SOURCE_DIR}" ${extra_args})
set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
# FetchContent hands the fetched dtrain to add_subdirectory: what happens after
# the fetch is consumer.add_subdirectory's, which builds and checks all of it.
# Here one program is enough to show the fetch works: the one linked to
# dtrain::gloo when there is one (its library is one engine's code, a third of
# dtrain::dtrain's to compile), else the one linked to dtrain::dtrain.
set(target_args "")
set(fetched_program dtrain_consumer)
if(CONSUMER STREQUAL "fetch_content")
  # DTRUN, GLOO_PROGRAM, HEADER_ONLY_PROGRAM, LINK_CHECKS (common.cmake)
  include("${WORK_DIR}/dtrain_consumer_paths.cmake")
  if(GLOO_PROGRAM)
    set(fetched_program dtrain_consumer_gloo)
  endif()
  set(target_args --target ${fetched_program})
endif()
step("build" "${CMAKE_COMMAND}" --build "${WORK_DIR}" ${config_args} ${target_args})

# check_program(<path>): runs a build of main.cpp; it prints "<version> <world
# as JSON>", world size 1 (no launcher variables).
function(check_program program)
  execute_process(COMMAND "${program}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer.${CONSUMER}: ${program} exited ${rc}:\n${out}${err}")
  endif()
  if(NOT out MATCHES "^([^ ]+) ({[^\n]*})\n?$")
    message(FATAL_ERROR "consumer.${CONSUMER}: unexpected output of ${program}:\n${out}")
  endif()
  set(json "${CMAKE_MATCH_2}")
  if(NOT CMAKE_MATCH_1 STREQUAL VERSION)
    message(FATAL_ERROR "consumer.${CONSUMER}: printed version ${CMAKE_MATCH_1}, expected ${VERSION}")
  endif()
  string(JSON world_size GET "${json}" world_size)
  if(NOT world_size STREQUAL "1")
    message(FATAL_ERROR "consumer.${CONSUMER}: world_size ${world_size}, expected 1: ${json}")
  endif()
  message(STATUS "consumer.${CONSUMER}: ${program}: ${out}")
endfunction()

find_program(program ${fetched_program} PATHS "${WORK_DIR}" "${WORK_DIR}/${CONFIG}" NO_DEFAULT_PATH)
check_program("${program}")
if(CONSUMER STREQUAL "single_header")  # and in its compiled form, by hand
  find_program(by_hand dtrain_consumer_by_hand PATHS "${WORK_DIR}" "${WORK_DIR}/${CONFIG}"
               NO_DEFAULT_PATH)
  check_program("${by_hand}")
endif()
if(CONSUMER MATCHES "^(single_header|fetch_content)$")
  return()
endif()
# DTRUN, GLOO_PROGRAM, HEADER_ONLY_PROGRAM, LINK_CHECKS (common.cmake)
include("${WORK_DIR}/dtrain_consumer_paths.cmake")
if(HEADER_ONLY_PROGRAM)
  check_program("${HEADER_ONLY_PROGRAM}")
endif()

# dtrun: a subproject builds it on request (it is not in `all` there); an
# installed package brings it along (the header-only test install has no
# tools, and dtrun is the same program in both forms: checked once).
if(NOT CONSUMER STREQUAL "find_package" AND MODE STREQUAL "compiled")
  step("build dtrun" "${CMAKE_COMMAND}" --build "${WORK_DIR}" ${config_args} --target dtrun)
endif()
if(DTRUN AND EXISTS "${DTRUN}")
  step("dtrun --help" "${DTRUN}" --help)
  if(NOT out MATCHES "usage: dtrun ")
    message(FATAL_ERROR "consumer.${CONSUMER}: ${DTRUN} --help printed no usage:\n${out}")
  endif()
  message(STATUS "consumer.${CONSUMER}: ${DTRUN} --help works")
elseif(MODE STREQUAL "compiled")
  message(FATAL_ERROR "consumer.${CONSUMER}: no dtrun at '${DTRUN}'")
endif()

# A program whose TUs and libraries disagree on the engines does not link, and
# the linker names the check (dtrain/detail/link_check.hpp).
# expect_link_failure(<target> <regex> <what>)
function(expect_link_failure target regex what)
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}" ${config_args} --target ${target}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "consumer.${CONSUMER}: ${target} (${what}) linked; it must not")
  endif()
  if(NOT out MATCHES "${regex}")
    message(FATAL_ERROR "consumer.${CONSUMER}: ${target} (${what}) failed without naming the "
                        "link check (no match for \"${regex}\"):\n${out}")
  endif()
  message(STATUS "consumer.${CONSUMER}: ${what} does not link: ${CMAKE_MATCH_0}")
endfunction()
if(LINK_CHECKS)
  expect_link_failure(dtrain_consumer_wrong_library
    "undefined reference to .dtrain::detail::link_check::library_built_with_engines_[a-z_]+."
    "a TU for dtrain::dtrain linked to dtrain::gloo's library")
  expect_link_failure(dtrain_consumer_mixed
    "(multiple definition of|duplicate symbol:?) .?dtrain::detail::link_check::every_unit_must_use_the_same_dtrain_engines.?"
    "a TU for dtrain::gloo beside one for dtrain::dtrain")
elseif(MODE STREQUAL "compiled" AND GLOO_PROGRAM)
  message(STATUS "consumer.${CONSUMER}: dtrain::gloo is dtrain::dtrain's library (Gloo is the "
                 "only engine): no mix to check")
endif()

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
