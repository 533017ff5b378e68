# Regenerates the single header into the build tree and compares it with the
# committed single_include/dtrain/dtrain.hpp (nlohmann/json's check-amalgamation).
#
#   cmake -DSOURCE_DIR=<checkout> -DOUT=<scratch file> [-DMODE=warn] -P check_single_include.cmake
#
# MODE=warn prints the advice and succeeds: the build uses it to explain a
# failure of the single-header test build before it happens.
cmake_minimum_required(VERSION 3.21)

set(committed "${SOURCE_DIR}/single_include/dtrain/dtrain.hpp")
execute_process(
  COMMAND "${CMAKE_COMMAND}" "-DOUT=${OUT}" -P "${SOURCE_DIR}/tools/amalgamate.cmake"
  OUTPUT_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tools/amalgamate.cmake failed (exit status ${rc})")
endif()

execute_process(COMMAND "${CMAKE_COMMAND}" -E compare_files "${OUT}" "${committed}"
                RESULT_VARIABLE differs)
if(differs)
  set(advice
    "single_include/dtrain/dtrain.hpp is out of date with include/dtrain/.\n"
    "Regenerate and commit it:\n"
    "  cmake -P tools/amalgamate.cmake && git add single_include/dtrain/dtrain.hpp\n"
    "(freshly generated: ${OUT})")
  if(MODE STREQUAL "warn")
    message(WARNING ${advice})
  else()
    message(FATAL_ERROR ${advice})
  endif()
endif()
