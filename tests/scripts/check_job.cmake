# Runs a DistributedDataParallel job and checks how it ends: its exit status
# (0 for a job that must succeed and say something) and the text a user would read.
#
#   cmake "-DCOMMAND=launcher|args|program|args" -DEXPECT_STATUS=2
#         "-DEXPECT_1=regex" ["-DEXPECT_2=regex" ...] -P check_job.cmake
#
# EXPECT_STATUS is a number or a regex of numbers ("[1-9][0-9]*": any failure).
# CLEAN_DIR, when given, is a scratch directory of the job's, removed before
# and after it.
# COMMAND is the job's command line with '|' between the arguments. Every
# EXPECT_<n> must match the job's combined stdout and stderr.
foreach(var IN ITEMS COMMAND EXPECT_STATUS EXPECT_1)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_job.cmake: ${var} is not set")
  endif()
endforeach()

string(REPLACE "|" ";" command "${COMMAND}")
if(DEFINED CLEAN_DIR)
  file(REMOVE_RECURSE "${CLEAN_DIR}")
endif()
execute_process(
  COMMAND ${command}
  RESULT_VARIABLE status
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err
  TIMEOUT 100)
message("${out}${err}")
if(DEFINED CLEAN_DIR)
  file(REMOVE_RECURSE "${CLEAN_DIR}")
endif()

set(failed "")
if(NOT status MATCHES "^(${EXPECT_STATUS})$")
  string(APPEND failed "the job exited with '${status}', expected ${EXPECT_STATUS}\n")
endif()
foreach(n RANGE 1 9)
  if(DEFINED EXPECT_${n})
    if("${out}${err}" MATCHES "${EXPECT_${n}}")
      message("found: ${EXPECT_${n}}")
    else()
      string(APPEND failed "no match for \"${EXPECT_${n}}\" in the job's output\n")
    endif()
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "${failed}")
endif()
message("the job ended as it should: status ${status}, messages as expected")
