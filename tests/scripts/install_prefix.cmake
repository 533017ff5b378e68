# Installs dtrain into a fresh prefix, for the find_package consumer tests, and
# checks what the prefix holds for the form it was built in.
#
#   cmake -DBUILD_DIR=<build> -DPREFIX=<prefix> -DCONFIG=<config>
#         [-DHEADER_ONLY=<ON|OFF>] [-DLIBRARIES=<file names, |-separated>]
#         [-DSOURCE_DIR=<checkout> -DINIT_CACHE=<settings> -DGENERATOR=<generator>]
#         -P install_prefix.cmake
#
# With SOURCE_DIR, BUILD_DIR is configured first from that checkout with
# DTRAIN_HEADER_ONLY=ON and nothing but the install rules (no tests, examples,
# benchmarks or tools: nothing to compile); without it, BUILD_DIR is an
# existing build, HEADER_ONLY says what it was configured as, and LIBRARIES
# names the library files it must install.
#
# Compiled: lib*/libdtrain.a (or .so) and the package under lib*/cmake/dtrain,
# with a version file that checks the architecture. Header-only: no library,
# the package under share/cmake/dtrain, ARCH_INDEPENDENT.
cmake_minimum_required(VERSION 3.21)

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit status ${rc}):\n${out}")
  endif()
endfunction()

set(config_args "")
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
if(SOURCE_DIR)
  set(HEADER_ONLY ON)
  file(REMOVE_RECURSE "${BUILD_DIR}")
  step("configuring a header-only dtrain in ${BUILD_DIR}"
    "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BUILD_DIR}" -G "${GENERATOR}" -C "${INIT_CACHE}"
    -DDTRAIN_HEADER_ONLY=ON -DDTRAIN_BUILD_TESTS=OFF -DDTRAIN_BUILD_EXAMPLES=OFF
    -DDTRAIN_BUILD_BENCH=OFF -DDTRAIN_BUILD_TOOLS=OFF -DDTRAIN_INSTALL=ON)
endif()

file(REMOVE_RECURSE "${PREFIX}")  # leftovers of an older install must not satisfy the consumer
step("cmake --install ${BUILD_DIR} --prefix ${PREFIX}"
  "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${config_args})

file(GLOB libraries "${PREFIX}/lib*/libdtrain*")
file(GLOB_RECURSE configs "${PREFIX}/*/dtrainConfigVersion.cmake")
list(LENGTH configs count)
if(NOT count EQUAL 1)
  message(FATAL_ERROR "expected one dtrainConfigVersion.cmake under ${PREFIX}, found: ${configs}")
endif()
file(RELATIVE_PATH package_dir "${PREFIX}" "${configs}")
# Would the package suit a project of another architecture (4-byte pointers)?
function(suits_other_architecture out)
  set(PACKAGE_FIND_NAME dtrain)
  set(PACKAGE_FIND_VERSION 0.1)
  set(PACKAGE_FIND_VERSION_MAJOR 0)
  set(PACKAGE_FIND_VERSION_MINOR 1)
  set(PACKAGE_FIND_VERSION_COUNT 2)
  set(CMAKE_SIZEOF_VOID_P 4)
  include("${configs}")
  if(PACKAGE_VERSION_UNSUITABLE)
    set(${out} OFF PARENT_SCOPE)
  else()
    set(${out} ON PARENT_SCOPE)
  endif()
endfunction()
suits_other_architecture(arch_independent)
if(HEADER_ONLY)
  if(libraries)
    message(FATAL_ERROR "a header-only dtrain installed libraries: ${libraries}")
  endif()
  if(NOT package_dir MATCHES "^share/cmake/dtrain/")
    message(FATAL_ERROR "a header-only dtrain's package is not under share/: ${package_dir}")
  endif()
  if(NOT arch_independent)
    message(FATAL_ERROR "a header-only dtrain's version file checks the architecture: ${configs}")
  endif()
  message(STATUS "installed header-only: no library, ${package_dir}, ARCH_INDEPENDENT")
else()
  string(REPLACE "|" ";" LIBRARIES "${LIBRARIES}")
  foreach(library IN LISTS LIBRARIES)
    if(NOT libraries MATCHES "/lib[^/]*/${library}(;|$)")
      message(FATAL_ERROR "the compiled dtrain did not install ${library} (found: ${libraries})")
    endif()
  endforeach()
  if(NOT package_dir MATCHES "^lib[^/]*/cmake/dtrain/")
    message(FATAL_ERROR "a compiled dtrain's package is not under lib/: ${package_dir}")
  endif()
  if(arch_independent)
    message(FATAL_ERROR "a compiled dtrain's version file does not check the architecture: ${configs}")
  endif()
  message(STATUS "installed compiled: ${libraries}, ${package_dir}")
endif()
