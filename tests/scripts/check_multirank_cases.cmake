cmake_minimum_required(VERSION 3.25)  # IN_LIST
# Every TEST_CASE of a multi-rank program is run by some test: the cases that
# dtrain_add_multirank_test registered (their CASE, '|' between them) against the
# program's own list (`<program> --list-test-cases`, which starts no job).
#
#   cmake -DPROGRAM=<program> "-DCASES=mean|features" -P check_multirank_cases.cmake
execute_process(COMMAND "${PROGRAM}" --list-test-cases --no-version
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} --list-test-cases exited with ${status}:\n${out}${err}")
endif()
string(REPLACE "|" ";" registered "${CASES}")
# doctest lists the names between two lines of '='.
string(REPLACE ";" "\\;" out "${out}")
string(REPLACE "\n" ";" lines "${out}")
set(listed "")
set(separators 0)
foreach(line IN LISTS lines)
  if(line MATCHES "^=+$")
    math(EXPR separators "${separators} + 1")
  elseif(separators EQUAL 1)
    list(APPEND listed "${line}")
  endif()
endforeach()
list(JOIN listed ", " listing)
set(missing "")
foreach(case IN LISTS listed)
  if(NOT case IN_LIST registered)
    list(APPEND missing "${case}")
  endif()
endforeach()
list(LENGTH listed count)
if(count EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} lists no test cases:\n${out}")
endif()
if(missing)
  list(JOIN missing ", " missing)
  message(FATAL_ERROR "${PROGRAM}: no test runs the case(s) ${missing}: add them to a "
                      "dtrain_add_multirank_test(... CASE <case> ...) in tests/")
endif()
message("${count} cases, every one registered: ${listing}")
