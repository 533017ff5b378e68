# The collective engines dtrain can drive. Each DTRAIN_WITH_<X> option defaults
# to whether the engine was found; forcing one ON that is missing stops the
# configure step and says what to install. Sets DTRAIN_ENGINES (the enabled
# engines: MPI, GLOO, NCCL) and DTRAIN_<X>_TARGETS (what an engine links).

include_guard(GLOBAL)

# _dtrain_engine(<X> <found> <what to install> <targets>...)
function(_dtrain_engine name found install_hint)
  if(found)
    set(default ON)
  else()
    set(default OFF)
  endif()
  option(DTRAIN_WITH_${name} "Use the ${name} engine (default: ON when found)" ${default})
  if(DTRAIN_WITH_${name} AND NOT found)
    message(FATAL_ERROR
      "DTRAIN_WITH_${name}=ON, but ${name} was not found.\n"
      "Install ${install_hint}, or configure with -DDTRAIN_WITH_${name}=OFF.")
  endif()
  if(DTRAIN_WITH_${name})
    set(DTRAIN_ENGINES ${DTRAIN_ENGINES} ${name} PARENT_SCOPE)
    set(DTRAIN_${name}_TARGETS ${ARGN} PARENT_SCOPE)
  endif()
endfunction()

set(DTRAIN_ENGINES "")

# An option that is OFF (given, or cached by an earlier configure) skips the
# search; after installing an engine, reconfigure with -DDTRAIN_WITH_<X>=ON.
if(NOT DEFINED DTRAIN_WITH_MPI OR DTRAIN_WITH_MPI)
  set(MPI_CXX_SKIP_MPICXX ON)  # dtrain calls the C API; the C++ bindings are deprecated
  find_package(MPI COMPONENTS CXX QUIET)
endif()
_dtrain_engine(MPI "${MPI_CXX_FOUND}"
  "an MPI implementation (Debian: apt-get install libopenmpi-dev openmpi-bin), or set MPI_HOME"
  MPI::MPI_CXX)

if(NOT DEFINED DTRAIN_WITH_GLOO OR DTRAIN_WITH_GLOO)
  find_package(Gloo CONFIG QUIET)  # Debian's libgloo-dev: /usr/share/cmake/Gloo, target `gloo`
endif()
_dtrain_engine(GLOO "${Gloo_FOUND}"
  "Gloo (Debian: apt-get install libgloo-dev), or set Gloo_DIR to the folder of GlooConfig.cmake"
  gloo)

if(NOT DEFINED DTRAIN_WITH_NCCL OR DTRAIN_WITH_NCCL)
  find_package(NCCL QUIET)  # cmake/FindNCCL.cmake; NCCL::NCCL brings CUDA::cudart along
endif()
_dtrain_engine(NCCL "${NCCL_FOUND}"
  "NCCL and the CUDA toolkit (set NCCL_ROOT / CUDAToolkit_ROOT if not in /usr/local/cuda)"
  NCCL::NCCL)

# Open MPI's mpirun refuses more ranks than cores unless told; tests run 4 ranks on 2 cores.
set(DTRAIN_MPIEXEC_IS_OPEN_MPI FALSE)
set(DTRAIN_MPIEXEC_PREFLAGS "")
if(DTRAIN_WITH_MPI AND MPIEXEC_EXECUTABLE)
  execute_process(COMMAND "${MPIEXEC_EXECUTABLE}" --version
                  OUTPUT_VARIABLE _dtrain_mpiexec_version ERROR_QUIET TIMEOUT 30)
  if(_dtrain_mpiexec_version MATCHES "Open MPI|OpenRTE|open-mpi")
    set(DTRAIN_MPIEXEC_IS_OPEN_MPI TRUE)
    set(DTRAIN_MPIEXEC_PREFLAGS --oversubscribe)
  endif()
  unset(_dtrain_mpiexec_version)
endif()

set(_dtrain_summary "")
set(_dtrain_version_MPI "MPI ${MPI_CXX_VERSION}")
set(_dtrain_version_GLOO "${Gloo_VERSION}")
set(_dtrain_version_NCCL "${NCCL_VERSION}, CUDA ${CUDAToolkit_VERSION}")
foreach(_engine IN ITEMS MPI GLOO NCCL)
  if(DTRAIN_WITH_${_engine})
    list(APPEND _dtrain_summary "${_engine} ON (${_dtrain_version_${_engine}})")
  else()
    list(APPEND _dtrain_summary "${_engine} OFF")
  endif()
  unset(_dtrain_version_${_engine})
endforeach()
list(JOIN _dtrain_summary ", " _dtrain_summary)
message(STATUS "dtrain engines: ${_dtrain_summary}")
unset(_dtrain_summary)

# dtrain_link_engines(<target> <INTERFACE|PUBLIC|PRIVATE> [<engine>...])
# Defines DTRAIN_WITH_<X>=1 and links the engine for each engine named. Tests use
# it to build one translation unit per combination of engines.
function(dtrain_link_engines target scope)
  foreach(engine IN LISTS ARGN)
    target_compile_definitions(${target} ${scope} DTRAIN_WITH_${engine}=1)
    target_link_libraries(${target} ${scope} ${DTRAIN_${engine}_TARGETS})
  endforeach()
endfunction()
