#pragma once
/// @file
/// The non-template bodies of dtrain/launch/worker.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/worker.hpp, not this file.

#include <dtrain/launch/worker.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE bool mpi_is_running() noexcept {
#if DTRAIN_HAS_MPI()
  int initialized = 0;
  int finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || initialized == 0) return false;
  return MPI_Finalized(&finalized) == MPI_SUCCESS && finalized == 0;
#else
  return false;
#endif
}

DTRAIN_DETAIL_INLINE void abort_mpi_job(int status) noexcept {
  if (status == 0 || !mpi_is_running()) return;
  std::fflush(stdout);
  std::fflush(stderr);
#if DTRAIN_HAS_MPI()
  MPI_Abort(MPI_COMM_WORLD, status);
#endif
}

}  // namespace dtrain::detail
