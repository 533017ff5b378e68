# dtrun (the per-node agent, torchrun's flags, for any program) and
# dtrain_whoami (prints the world this process sees, as one JSON line): the two
# programs the README tells users to run. Defined whether or not the examples
# are built. At top level they are part of `all` and installed; under
# add_subdirectory/FetchContent they are EXCLUDE_FROM_ALL, so a user's build
# compiles them only when asked (`cmake --build . -t dtrun`, or a dependency),
# unless DTRAIN_INSTALL is ON there: what is installed must be built.
include_guard(GLOBAL)

set(_dtrain_tools_exclude "")
if(NOT PROJECT_IS_TOP_LEVEL AND NOT DTRAIN_INSTALL)
  set(_dtrain_tools_exclude EXCLUDE_FROM_ALL)
endif()

# dtrun starts and watches processes; it needs no collective engine.
add_executable(dtrun ${_dtrain_tools_exclude} "${PROJECT_SOURCE_DIR}/examples/dtrun.cpp")
target_link_libraries(dtrun PRIVATE dtrain::core)
# dtrain_whoami --rendezvous meets over MPI or Gloo: every engine that was found.
add_executable(dtrain_whoami ${_dtrain_tools_exclude} "${PROJECT_SOURCE_DIR}/examples/whoami.cpp")
target_link_libraries(dtrain_whoami PRIVATE dtrain::dtrain)
unset(_dtrain_tools_exclude)

foreach(_dtrain_tool IN ITEMS dtrun dtrain_whoami)
  add_executable(dtrain::${_dtrain_tool} ALIAS ${_dtrain_tool})
  dtrain_target_warnings(${_dtrain_tool})
  # The engines' libraries (NCCL, CUDA runtime) live outside the loader's
  # default path; the installed program must still start.
  # build/examples/, where they were when they were examples (scripts and docs name that path).
  set_target_properties(${_dtrain_tool} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON
                        RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/examples")
endforeach()
unset(_dtrain_tool)
