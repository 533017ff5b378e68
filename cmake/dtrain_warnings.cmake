# Warnings for dtrain's own tests and examples (never for users of dtrain::dtrain).
include_guard(GLOBAL)

option(DTRAIN_WARNINGS_AS_ERRORS "Build dtrain's own tests and examples with -Werror" ${PROJECT_IS_TOP_LEVEL})

# dtrain_target_warnings(<target>)
function(dtrain_target_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    set(werror "$<$<BOOL:${DTRAIN_WARNINGS_AS_ERRORS}>:-Werror>")
    # GCC 12 at -O2/-O3 reports a false -Wrestrict inside libstdc++ for
    # `"literal" + std::string` (GCC bug 105329). It stays fatal here: users
    # build with -Werror, so dtrain's headers (and its tests, which show where
    # the headers get inlined) append instead.
    target_compile_options(${target} PRIVATE
      "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wpedantic;${werror}>")
  endif()
  # nvcc: the host compiler's -Wall only, and not fatal: CUDA's own headers are not clean.
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>")
endfunction()
