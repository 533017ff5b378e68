# DDP's core does not branch on the sharding stage (docs/design.md, "DDP's one
# core"; DESIGN.md's decision after the third wave): what a stage changes is
# asked of the sharding part (detail::ddp_sharding, ddp/sharding.hpp) through
# its seam. This fails, naming the file and the line, where the core's files
# name a stage or read the option themselves.
#
#   cmake -DINCLUDE_DIR=<dir with dtrain/> -P check_sharding_seam.cmake

cmake_minimum_required(VERSION 3.21)

if(NOT INCLUDE_DIR)
  message(FATAL_ERROR "check_sharding_seam.cmake: give -DINCLUDE_DIR=<directory that holds dtrain/>")
endif()

set(core_files ddp/basic_ddp.hpp ddp/basic_ddp_buckets.hpp ddp/basic_ddp_step.hpp)
# A stage by name, the option read directly, or the stage predicates the part keeps to itself.
set(stage_pattern
    "sharding::(none|optimizer|gradients|parameters)|options_\\.sharding|shards_(parameters|gradients|optimizer_state)\\(|owns_bucket_shards\\(|transient_buckets\\(")

set(found "")
set(checked 0)
foreach(file IN LISTS core_files)
  set(path "${INCLUDE_DIR}/dtrain/${file}")
  if(NOT EXISTS "${path}")
    message(FATAL_ERROR "check_sharding_seam.cmake: ${path} does not exist")
  endif()
  file(STRINGS "${path}" lines)
  set(number 0)
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    # Comments may name the stages (they say what the part does).
    string(REGEX REPLACE "//.*$" "" code "${line}")
    if(code MATCHES "${stage_pattern}")
      string(STRIP "${line}" shown)
      string(APPEND found "\n  ${file}:${number}: ${shown}")
    endif()
  endforeach()
  math(EXPR checked "${checked} + 1")
endforeach()

if(found)
  message(FATAL_ERROR
          "the DDP core branches on the sharding stage; ask the sharding part "
          "(detail::ddp_sharding, ddp/sharding.hpp) instead:${found}")
endif()
message(STATUS "sharding seam: ${checked} core files, no stage named outside the sharding part")
