# `cmake --install`: the headers, the libraries (libdtrain, libdtrain_<engine>),
# dtrun and dtrain_whoami, and a CMake package: find_package(dtrain
# [COMPONENTS gloo mpi nccl]) gives dtrain::core, one dtrain::<engine> per
# engine this build had, dtrain::dtrain (all of them), dtrain::header_only and
# the imported executables dtrain::dtrun and dtrain::dtrain_whoami
# (cmake/dtrain_compiled.cmake says what each target is). The libraries make
# the package architecture-specific, under lib/; with DTRAIN_HEADER_ONLY=ON
# nothing is compiled and it is ARCH_INDEPENDENT, under share/ (the tools are
# programs to run, not to link, so they do not change that).
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(DTRAIN_INSTALL_CMAKEDIR ""
    CACHE STRING "Where dtrainConfig.cmake is installed, relative to the prefix (empty: lib/cmake/dtrain, or share/cmake/dtrain when header-only)")
mark_as_advanced(DTRAIN_INSTALL_CMAKEDIR)
set(_dtrain_cmakedir "${DTRAIN_INSTALL_CMAKEDIR}")
if(DTRAIN_HEADER_ONLY)
  set(_dtrain_arch_independent ARCH_INDEPENDENT)
  if(NOT _dtrain_cmakedir)
    set(_dtrain_cmakedir "${CMAKE_INSTALL_DATADIR}/cmake/dtrain")
  endif()
else()
  set(_dtrain_arch_independent "")
  if(NOT _dtrain_cmakedir)
    set(_dtrain_cmakedir "${CMAKE_INSTALL_LIBDIR}/cmake/dtrain")
  endif()
endif()

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/dtrain" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
# dtrain::torch's source, compiled in the user's build against the user's LibTorch.
install(FILES "${PROJECT_SOURCE_DIR}/src/torch.cpp" DESTINATION "${CMAKE_INSTALL_DATADIR}/dtrain/src")
install(TARGETS ${DTRAIN_LIBRARY_TARGETS} EXPORT dtrainTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}")
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION "${_dtrain_cmakedir}")
# In their own export file, which dtrainConfig.cmake includes when present
# (absent when dtrain was installed with DTRAIN_BUILD_TOOLS=OFF).
if(TARGET dtrun)
  install(TARGETS dtrun dtrain_whoami EXPORT dtrainToolsTargets RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
  install(EXPORT dtrainToolsTargets NAMESPACE dtrain:: DESTINATION "${_dtrain_cmakedir}")
endif()

# The NCCL search the installed package repeats must find what this build found.
if(DTRAIN_WITH_NCCL)
  get_filename_component(DTRAIN_NCCL_ROOT_HINT "${NCCL_INCLUDE_DIR}" DIRECTORY)
endif()

configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/dtrainConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/dtrainConfig.cmake"
  INSTALL_DESTINATION "${_dtrain_cmakedir}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake"
  COMPATIBILITY SameMajorVersion
  ${_dtrain_arch_independent})

set(_dtrain_package_files
  "${PROJECT_BINARY_DIR}/dtrainConfig.cmake"
  "${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake")
if(DTRAIN_WITH_NCCL)
  list(APPEND _dtrain_package_files "${CMAKE_CURRENT_LIST_DIR}/FindNCCL.cmake")
endif()
install(FILES ${_dtrain_package_files} DESTINATION "${_dtrain_cmakedir}")
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/dtrain")
unset(_dtrain_package_files)
unset(_dtrain_cmakedir)
unset(_dtrain_arch_independent)
