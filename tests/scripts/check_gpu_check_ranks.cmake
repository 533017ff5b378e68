# tools/gpu-check --ranks N where this machine has fewer than N GPUs (issue 31):
# it must say how many it needs and has, exit 77, and build nothing; a bad
# --ranks (or DEADLINE, or SKIP_ROWS) is exit status 2 naming the value. Where
# nvidia-smi lists two GPUs or more, this check is skipped (the real run builds
# and takes minutes).
#   cmake -DSOURCE_DIR=<repo> -P check_gpu_check_ranks.cmake
execute_process(COMMAND nvidia-smi -L OUTPUT_VARIABLE gpus ERROR_QUIET RESULT_VARIABLE smi)
string(REGEX MATCHALL "(^|\n)GPU " listed "${gpus}")
list(LENGTH listed count)
if(smi EQUAL 0 AND count GREATER_EQUAL 2)
  message("SKIPPED: this machine has ${count} GPUs: run tools/gpu-check --ranks ${count} itself")
  return()
endif()

set(tool "${SOURCE_DIR}/tools/gpu-check")
set(scratch "${CMAKE_CURRENT_BINARY_DIR}/gpu-check-ranks-scratch")
file(REMOVE_RECURSE "${scratch}")
foreach(case IN ITEMS "2|77|needs 2 GPUs, one per rank, and this machine has [0-9]+ [(]nvidia-smi -L[)]: built nothing"
                      "1|2|--ranks takes a number of ranks of at least 2 [(]one GPU each[)], not '1'"
                      "two|2|not 'two'")
  string(REPLACE "|" ";" fields "${case}")
  list(GET fields 0 ranks)
  list(GET fields 1 want_status)
  list(GET fields 2 want_text)
  execute_process(COMMAND "${CMAKE_COMMAND}" -E env "BUILD_DIR=${scratch}" bash "${tool}" --ranks "${ranks}"
                  RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  message("gpu-check --ranks ${ranks}: exit ${status}: ${out}${err}")
  if(NOT status EQUAL want_status)
    message(FATAL_ERROR "gpu-check --ranks ${ranks} exited ${status}, not ${want_status}")
  endif()
  if(NOT "${out}${err}" MATCHES "${want_text}")
    message(FATAL_ERROR "gpu-check --ranks ${ranks} did not say \"${want_text}\"")
  endif()
endforeach()
# A setting gpu-check cannot read: exit 2, naming it, before any build.
function(expect_refused setting want)
  execute_process(COMMAND "${CMAKE_COMMAND}" -E env "BUILD_DIR=${scratch}" "${setting}" bash "${tool}"
                  RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
  message("${setting} gpu-check: exit ${status}: ${out}${err}")
  if(NOT status EQUAL 2 OR NOT "${out}${err}" MATCHES "${want}")
    message(FATAL_ERROR "${setting} gpu-check exited ${status} without saying \"${want}\"")
  endif()
endfunction()
expect_refused("DEADLINE=10m" "DEADLINE is a number of seconds, not '10m'")
expect_refused("SKIP_ROWS=vs_pytorch[" "SKIP_ROWS is not a regular expression grep -E reads: 'vs_pytorch\\['")
if(EXISTS "${scratch}")
  message(FATAL_ERROR "gpu-check --ranks built into ${scratch} on a machine without the GPUs")
endif()
message("gpu-check --ranks: the no-GPU path says what it needs and builds nothing")
