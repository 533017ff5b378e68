# Runs dtrain_gloo_tests --mode=<MODE> on RANKS ranks, without the launcher
# stopping the survivors when rank 1 fails, and checks that the job exits with
# EXPECT_STATUS (rank 1's own) and that every other rank printed
# "rank R: <MODE> detected".
#
#   cmake -DLAUNCH=... -DPROGRAM=... -DMODE=dead-peer -DRANKS=3 -DEXPECT_STATUS=3 -P gloo_failure.cmake
foreach(var IN ITEMS LAUNCH PROGRAM MODE RANKS EXPECT_STATUS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "gloo_failure.cmake: ${var} is not set")
  endif()
endforeach()

execute_process(
  COMMAND "${LAUNCH}" --no-kill ${RANKS} "${PROGRAM}" --mode=${MODE}
  RESULT_VARIABLE status
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 100)
message("${out}${err}")

if(NOT status STREQUAL "${EXPECT_STATUS}")
  message(FATAL_ERROR "the job exited with ${status}, expected ${EXPECT_STATUS}")
endif()
math(EXPR last "${RANKS} - 1")
foreach(r RANGE 0 ${last})
  if(NOT r EQUAL 1 AND NOT out MATCHES "rank ${r}: ${MODE} detected")
    message(FATAL_ERROR "rank ${r} did not report the ${MODE} (no line \"rank ${r}: ${MODE} detected\")")
  endif()
endforeach()
