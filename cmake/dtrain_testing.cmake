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
