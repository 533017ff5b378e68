# `cmake --install`: the headers, dtrun and dtrain_whoami, and a CMake package:
# find_package(dtrain [COMPONENTS gloo mpi nccl]) gives dtrain::core, one
# dtrain::<engine> per engine this build had, dtrain::dtrain (all of them) and
# the imported executables dtrain::dtrun and dtrain::dtrain_whoami. The library
# has no compiled code, hence an ARCH_INDEPENDENT package under share/; the
# tools are programs to run, not to link, so they do not change that.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(DTRAIN_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/dtrain"
    CACHE STRING "Where dtrainConfig.cmake is installed, relative to the prefix")
mark_as_advanced(DTRAIN_INSTALL_CMAKEDIR)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/dtrain" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS ${DTRAIN_LIBRARY_TARGETS} EXPORT dtrainTargets)
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION "${DTRAIN_INSTALL_CMAKEDIR}")
# In their own export file, which dtrainConfig.cmake includes when present
# (absent when dtrain was installed with DTRAIN_BUILD_TOOLS=OFF).
if(TARGET dtrun)
  install(TARGETS dtrun dtrain_whoami EXPORT dtrainToolsTargets RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
  install(EXPORT dtrainToolsTargets NAMESPACE dtrain:: DESTINATION "${DTRAIN_INSTALL_CMAKEDIR}")
endif()

# The NCCL search the installed package repeats must find what this build found.
if(DTRAIN_WITH_NCCL)
  get_filename_component(DTRAIN_NCCL_ROOT_HINT "${NCCL_INCLUDE_DIR}" DIRECTORY)
endif()

configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/dtrainConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/dtrainConfig.cmake"
  INSTALL_DESTINATION "${DTRAIN_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake"
  COMPATIBILITY SameMajorVersion
  ARCH_INDEPENDENT)

set(_dtrain_package_files
  "${PROJECT_BINARY_DIR}/dtrainConfig.cmake"
  "${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake")
if(DTRAIN_WITH_NCCL)
  list(APPEND _dtrain_package_files "${CMAKE_CURRENT_LIST_DIR}/FindNCCL.cmake")
endif()
install(FILES ${_dtrain_package_files} DESTINATION "${DTRAIN_INSTALL_CMAKEDIR}")
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/dtrain")
unset(_dtrain_package_files)
