# How dtrain's own tests, examples and benchmarks are compiled (never what
# users of dtrain::dtrain get): warnings, and which of them only need to compile.
include_guard(GLOBAL)

option(DTRAIN_WARNINGS_AS_ERRORS "Build dtrain's own tests and examples with -Werror" ${PROJECT_IS_TOP_LEVEL})

# DTRAIN_COMPILE_ONLY: programs of these kinds are only checked to compile in
# this build, so they are built without optimisation (dtrain_compile_check),
# and say so on stderr when run: `bench` (the benchmarks: no test runs them),
# `gpu` (what needs a GPU to run: tests/gpu, the CUDA demo, and NCCL's parts of
# the libraries, cmake/dtrain_compiled.cmake). tools/test sets `bench`, and
# `gpu` on a machine without a GPU.
set(DTRAIN_COMPILE_ONLY "" CACHE STRING
    "Kinds of dtrain's own programs built unoptimised, only to check that they compile: bench;gpu")
foreach(kind IN LISTS DTRAIN_COMPILE_ONLY)
  if(NOT kind MATCHES "^(bench|gpu)$")
    message(FATAL_ERROR "DTRAIN_COMPILE_ONLY=${DTRAIN_COMPILE_ONLY}: '${kind}' is not one of bench, gpu")
  endif()
endforeach()

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

# The warnings careful users turn on (compile.strict_*: dtrain's headers must
# stay quiet under them), and dtrain_strict_warnings(<target>), which adds them
# as dtrain_target_warnings() adds its own: dtrain's libraries are built so in
# dtrain's own build, which makes compile.strict_* cover what they compile.
set(DTRAIN_STRICT_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion)
function(dtrain_strict_warnings target)
  dtrain_target_warnings(${target})
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${DTRAIN_STRICT_WARNINGS}>")
  endif()
endfunction()

# dtrain_compile_check(<target>): a target that exists to prove that something
# compiles (a header on its own, an engine combination, nvcc's view of dtrain,
# one definition across units) is built without optimisation, whatever the
# build type: code generation is not what it checks, and at -O3 it is most of
# its time. The warnings only optimisation finds are compile.strict_*'s, built
# at the build type's level.
function(dtrain_compile_check target)
  # nvcc: the host compiler's level (a second -O to nvcc itself draws a warning).
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-O0>"
                                           "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-O0>")
endfunction()

# dtrain_program_kind(<target> <kind>): a program of that kind (bench, gpu);
# when DTRAIN_COMPILE_ONLY names the kind, it is a compile check, and running
# it prints that its results are not to be used (compile_only_notice.cpp).
function(dtrain_program_kind target kind)
  if(kind IN_LIST DTRAIN_COMPILE_ONLY)
    dtrain_compile_check(${target})
    target_sources(${target} PRIVATE "${PROJECT_SOURCE_DIR}/cmake/compile_only_notice.cpp")
    target_compile_definitions(${target} PRIVATE "DTRAIN_COMPILE_ONLY_KIND=\"${kind}\"")
  endif()
endfunction()
