# Helpers for tests/CMakeLists.txt. Every test gets a TIMEOUT, so a hang fails
# CI instead of blocking it.
include_guard(GLOBAL)

set(DTRAIN_TEST_TIMEOUT 120 CACHE STRING "Default CTest TIMEOUT (seconds) of dtrain's tests")
mark_as_advanced(DTRAIN_TEST_TIMEOUT)

# A test is skipped, visibly, when it exits 77 or prints a line starting with
# "SKIPPED: " (cmake -P drivers cannot exit 77 before CMake 3.29).
set(DTRAIN_SKIP_REGEX "(^|\n)SKIPPED: ")

# dtrain_add_test(<name> COMMAND <command> [<arg>...]
#                 [TIMEOUT <seconds>] [WORKING_DIRECTORY <dir>]
#                 [ENVIRONMENT <var=value>...] [PROPERTIES <property> <value>...])
function(dtrain_add_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT;WORKING_DIRECTORY"
                        "COMMAND;ENVIRONMENT;PROPERTIES")
  if(NOT arg_COMMAND)
    message(FATAL_ERROR "dtrain_add_test(${name}): COMMAND is required")
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT ${DTRAIN_TEST_TIMEOUT})
  endif()
  if(NOT arg_WORKING_DIRECTORY)
    set(arg_WORKING_DIRECTORY "${CMAKE_CURRENT_BINARY_DIR}")
  endif()
  add_test(NAME ${name} COMMAND ${arg_COMMAND} WORKING_DIRECTORY "${arg_WORKING_DIRECTORY}")
  set_tests_properties(${name} PROPERTIES
    TIMEOUT ${arg_TIMEOUT}
    SKIP_RETURN_CODE 77
    SKIP_REGULAR_EXPRESSION "${DTRAIN_SKIP_REGEX}"
    ${arg_PROPERTIES})
  if(arg_ENVIRONMENT)
    set_property(TEST ${name} PROPERTY ENVIRONMENT ${arg_ENVIRONMENT})
  endif()
endfunction()

# dtrain_add_skipped_test(<name> <reason>): a test that reports itself as
# skipped, so that what could not run here shows in every CTest summary.
function(dtrain_add_skipped_test name reason)
  dtrain_add_test(${name} COMMAND "${CMAKE_COMMAND}" -E echo "SKIPPED: ${reason}")
endfunction()

# Open MPI refuses to run as root unless both variables are set (CI containers run as root).
set(DTRAIN_MPI_TEST_ENVIRONMENT OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)

# dtrain_add_mpi_test(<name> RANKS <n> COMMAND <program> [<arg>...] [TIMEOUT <seconds>])
# Registers <name>.<n>ranks, run as `mpiexec -n <n> --oversubscribe <program>`
# (--oversubscribe with Open MPI only). <program> is a path: $<TARGET_FILE:tgt>.
function(dtrain_add_mpi_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "RANKS;TIMEOUT" "COMMAND")
  set(test_name "${name}.${arg_RANKS}ranks")
  if(NOT DTRAIN_WITH_MPI OR NOT MPIEXEC_EXECUTABLE)
    dtrain_add_skipped_test(${test_name} "needs MPI and mpiexec (DTRAIN_WITH_MPI is OFF)")
    return()
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT ${DTRAIN_TEST_TIMEOUT})
  endif()
  dtrain_add_test(${test_name}
    COMMAND "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} ${arg_RANKS}
            ${MPIEXEC_PREFLAGS} ${DTRAIN_MPIEXEC_PREFLAGS} ${arg_COMMAND} ${MPIEXEC_POSTFLAGS}
    TIMEOUT ${arg_TIMEOUT}
    ENVIRONMENT ${DTRAIN_MPI_TEST_ENVIRONMENT}
    PROPERTIES PROCESSORS ${arg_RANKS})
endfunction()

# dtrain_test_interface(<name> <include dir> [<engine>...]): an INTERFACE target
# like dtrain::dtrain, with the include dir and engines chosen by the test
# (the single header; one combination of engines).
function(dtrain_test_interface name include_dir)
  add_library(${name} INTERFACE)
  target_include_directories(${name} INTERFACE "${include_dir}")
  target_compile_features(${name} INTERFACE cxx_std_20)
  target_link_libraries(${name} INTERFACE Threads::Threads)
  dtrain_link_engines(${name} INTERFACE ${ARGN})
endfunction()

# dtrain_engine_combinations(<out_var> [<engine>...]): every subset of the
# engines, each written as its engines joined by "_" ("none" for the empty one):
# MPI GLOO -> none;MPI;GLOO;MPI_GLOO.
function(dtrain_engine_combinations out_var)
  set(combinations none)
  foreach(engine IN LISTS ARGN)
    set(grown "")
    foreach(combination IN LISTS combinations)
      if(combination STREQUAL "none")
        list(APPEND grown ${engine})
      else()
        list(APPEND grown ${combination}_${engine})
      endif()
    endforeach()
    list(APPEND combinations ${grown})
  endforeach()
  set(${out_var} ${combinations} PARENT_SCOPE)
endfunction()

# ---------------------------------------------------------------------------
# Multi-rank tests (docs/developing.md, "Adding a test"): a program whose cases
# are doctest TEST_CASEs run in every rank (tests/support/multirank.hpp), and
# one CTest test per case, engine and rank count.

# dtrain_add_multirank_program(<target> <source>...): the program, with the
# multi-rank main (tests/support/multirank_main.cpp), linked to dtrain::dtrain.
function(dtrain_add_multirank_program target)
  add_executable(${target} ${ARGN} "${PROJECT_SOURCE_DIR}/tests/support/multirank_main.cpp")
  target_link_libraries(${target} PRIVATE dtrain::dtrain doctest::doctest)
  dtrain_target_warnings(${target})
  add_dependencies(${target} dtrain_test_launch)
endfunction()

# Why <engine> cannot run here, in `out` (empty when it can).
function(dtrain_multirank_missing out engine)
  set(why "")
  if(engine STREQUAL "mpi" AND NOT (DTRAIN_WITH_MPI AND MPIEXEC_EXECUTABLE))
    set(why "needs MPI and mpiexec (DTRAIN_WITH_MPI is OFF)")
  elseif(engine STREQUAL "gloo" AND NOT DTRAIN_WITH_GLOO)
    set(why "needs Gloo (DTRAIN_WITH_GLOO is OFF; Debian: apt-get install libgloo-dev)")
  elseif(NOT engine MATCHES "^(mpi|gloo)$")
    message(FATAL_ERROR "multi-rank test: engine '${engine}' is mpi or gloo")
  endif()
  set(${out} "${why}" PARENT_SCOPE)
endfunction()

# dtrain_multirank_command(<out> PROGRAM <target> ENGINE <mpi|gloo> RANKS <n>
#                          [NODES <a,b,...>] [NO_KILL] [ARGS <arg>...])
# The one place that builds the command starting <n> ranks of <target>, as a
# list in `out`: mpirun for MPI (one process per rank); dtrain_test_launch for
# Gloo, which gives each rank a torchrun-style environment (NODES: the ranks of
# each simulated node; NO_KILL: a failing rank does not stop the others, for a
# test that wants every rank's own message). The program gets --engine=<engine>
# and ARGS.
function(dtrain_multirank_command out)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_KILL" "PROGRAM;ENGINE;RANKS;NODES" "ARGS")
  if(arg_ENGINE STREQUAL "mpi")
    set(job "${MPIEXEC_EXECUTABLE}" ${MPIEXEC_NUMPROC_FLAG} ${arg_RANKS} ${MPIEXEC_PREFLAGS}
            ${DTRAIN_MPIEXEC_PREFLAGS} $<TARGET_FILE:${arg_PROGRAM}> --engine=mpi ${arg_ARGS}
            ${MPIEXEC_POSTFLAGS})
  else()
    set(job $<TARGET_FILE:dtrain_test_launch>)
    if(arg_NO_KILL)
      list(APPEND job --no-kill)
    endif()
    if(arg_NODES)
      list(APPEND job --nodes ${arg_NODES})
    endif()
    list(APPEND job ${arg_RANKS} $<TARGET_FILE:${arg_PROGRAM}> --engine=${arg_ENGINE} ${arg_ARGS})
  endif()
  set(${out} ${job} PARENT_SCOPE)
endfunction()

# dtrain_multirank_register_case(<target> <case>): <case> of <target> is some
# test's. The first call for a program registers multirank.<target>.cases,
# which lists the program's TEST_CASEs (--list-test-cases starts no job) and
# fails naming one that no test runs, so a case added to the program but not
# here cannot go silently unrun.
function(dtrain_multirank_register_case target case)
  if(NOT TARGET ${target})
    return()
  endif()
  set_property(TARGET ${target} APPEND PROPERTY DTRAIN_MULTIRANK_CASES ${case})
  get_property(checked GLOBAL PROPERTY DTRAIN_MULTIRANK_CHECKED)
  if(NOT target IN_LIST checked)
    set_property(GLOBAL APPEND PROPERTY DTRAIN_MULTIRANK_CHECKED ${target})
    dtrain_add_test(multirank.${target}.cases
      COMMAND "${CMAKE_COMMAND}" "-DPROGRAM=$<TARGET_FILE:${target}>"
              "-DCASES=$<JOIN:$<TARGET_PROPERTY:${target},DTRAIN_MULTIRANK_CASES>,|>"
              -P "${PROJECT_SOURCE_DIR}/tests/scripts/check_multirank_cases.cmake")
  endif()
endfunction()

# dtrain_add_multirank_test(<prefix> PROGRAM <target> CASE <doctest case>
#     ENGINES <mpi|gloo>... RANKS <n>... [NODES <a,b,...>] [NAME <suffix>]
#     [ENGINE_NOT_IN_NAME] [TIMEOUT <s>] [ENVIRONMENT <var=value>...]
#     [EXPECT_STATUS <n> EXPECT <regex>... [NO_KILL]])
# Registers <prefix>.<engine>.<n>ranks for every engine and rank count, which
# runs the case in every rank (`--test-case=<case>`) and passes when every rank
# does. NODES runs the ranks as simulated nodes with topology::hierarchical
# (--topology=hierarchical; Gloo only), named <prefix>.<engine>.hierarchical.<a>x<b>;
# NAME replaces the last part of the name (".<n>ranks"); ENGINE_NOT_IN_NAME
# leaves ".<engine>" out. With EXPECT, the job's output must match every regex
# and its exit status be EXPECT_STATUS (tests/scripts/check_job.cmake). An
# engine that is not built registers the test as skipped, saying why. Every
# TEST_CASE of the program must be some test's CASE (multirank.<target>.cases).
function(dtrain_add_multirank_test prefix)
  cmake_parse_arguments(PARSE_ARGV 1 arg "ENGINE_NOT_IN_NAME;NO_KILL"
                        "PROGRAM;CASE;NODES;NAME;TIMEOUT;EXPECT_STATUS"
                        "ENGINES;RANKS;ENVIRONMENT;EXPECT")
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 240)
  endif()
  dtrain_multirank_register_case(${arg_PROGRAM} ${arg_CASE})
  set(args --test-case=${arg_CASE})
  if(arg_NODES)
    list(APPEND args --topology=hierarchical)
  endif()
  foreach(engine IN LISTS arg_ENGINES)
    foreach(ranks IN LISTS arg_RANKS)
      set(name "${prefix}")
      if(NOT arg_ENGINE_NOT_IN_NAME)
        string(APPEND name ".${engine}")
      endif()
      if(arg_NAME)
        string(APPEND name ".${arg_NAME}")
      elseif(arg_NODES)
        string(REPLACE "," "x" shape "${arg_NODES}")
        string(APPEND name ".hierarchical.${shape}")
      else()
        string(APPEND name ".${ranks}ranks")
      endif()
      dtrain_multirank_missing(why ${engine})
      if(why)
        dtrain_add_skipped_test(${name} "${why}")
        continue()
      endif()
      set(options "")
      if(arg_NO_KILL)
        set(options NO_KILL)
      endif()
      if(arg_NODES)  # not an empty NODES: CMake 3.31+ warns of it (CMP0174)
        list(APPEND options NODES ${arg_NODES})
      endif()
      dtrain_multirank_command(job PROGRAM ${arg_PROGRAM} ENGINE ${engine} RANKS ${ranks}
                               ${options} ARGS ${args})
      set(env ${arg_ENVIRONMENT})
      if(NOT env MATCHES "(^|;)DTRAIN_COLLECTIVE_TIMEOUT=")
        list(PREPEND env DTRAIN_COLLECTIVE_TIMEOUT=120)  # a hang fails well within TIMEOUT
      endif()
      if(engine STREQUAL "mpi")
        list(APPEND env ${DTRAIN_MPI_TEST_ENVIRONMENT})
      endif()
      if(DEFINED arg_EXPECT_STATUS)
        set(expect_args "")
        set(n 0)
        foreach(regex IN LISTS arg_EXPECT)
          math(EXPR n "${n} + 1")
          list(APPEND expect_args "-DEXPECT_${n}=${regex}")
        endforeach()
        list(JOIN job "|" job)
        set(job "${CMAKE_COMMAND}" "-DCOMMAND=${job}" -DEXPECT_STATUS=${arg_EXPECT_STATUS}
                ${expect_args} -P "${PROJECT_SOURCE_DIR}/tests/scripts/check_job.cmake")
      endif()
      # A CASE that selects no TEST_CASE would run nothing and pass: doctest's "test cases: 0".
      dtrain_add_test(${name} COMMAND ${job} TIMEOUT ${arg_TIMEOUT} ENVIRONMENT ${env}
                      PROPERTIES PROCESSORS ${ranks} FAIL_REGULAR_EXPRESSION "test cases: +0 ")
    endforeach()
  endforeach()
endfunction()
