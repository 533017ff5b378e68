# Warnings for dtrain's own tests and examples (never for users of dtrain::dtrain).
include_guard(GLOBAL)

option(DTRAIN_WARNINGS_AS_ERRORS "Build dtrain's own tests and examples with -Werror" ON)

# dtrain_target_warnings(<target>)
function(dtrain_target_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    set(werror "$<$<BOOL:${DTRAIN_WARNINGS_AS_ERRORS}>:-Werror>")
    target_compile_options(${target} PRIVATE
      "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wpedantic;${werror}>")
  endif()
  # nvcc: the host compiler's -Wall only, and not fatal: CUDA's own headers are not clean.
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>")
endfunction()
