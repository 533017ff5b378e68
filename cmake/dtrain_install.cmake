# `cmake --install`: the headers, and a CMake package so that users can write
# find_package(dtrain) and link dtrain::dtrain. dtrain has no compiled code,
# hence one ARCH_INDEPENDENT package under share/.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(DTRAIN_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/dtrain"
    CACHE STRING "Where dtrainConfig.cmake is installed, relative to the prefix")
mark_as_advanced(DTRAIN_INSTALL_CMAKEDIR)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/dtrain" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS dtrain EXPORT dtrainTargets)
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION "${DTRAIN_INSTALL_CMAKEDIR}")

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
