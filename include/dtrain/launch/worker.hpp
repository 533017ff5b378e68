#pragma once
/// @file
/// How a worker process ends its part in a job so that the job ends too:
/// it ignores SIGPIPE (a write to a dead peer becomes an error that names
/// the peer instead of a silent death), and a failed rank under MPI calls
/// MPI_Abort, so that mpirun ends every rank at once instead of leaving the
/// failed one blocked in MPI_Finalize while its peers wait out their timeout.

#include <dtrain/config.hpp>

#include <csignal>
#include <cstdio>

#if DTRAIN_HAS_MPI()
#include <mpi.h>
#endif

namespace dtrain::detail {

/// Ignores SIGPIPE in this process: a peer that dies mid-write gives EPIPE,
/// which the engines and the store turn into an error naming the peer. Under
/// an agent, a worker killed by SIGPIPE would otherwise be blamed as the
/// root cause of a failure it only witnessed.
inline void ignore_sigpipe() noexcept { std::signal(SIGPIPE, SIG_IGN); }

/// Whether MPI is initialised and not yet finalised in this process (by
/// dtrain's MPI backend or by the user); false in a build without MPI.
inline bool mpi_is_running() noexcept {
#if DTRAIN_HAS_MPI()
  int initialized = 0;
  int finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || initialized == 0) return false;
  return MPI_Finalized(&finalized) == MPI_SUCCESS && finalized == 0;
#else
  return false;
#endif
}

/// Ends the whole MPI job with `status` as MPI_Abort's error code (Open MPI's
/// mpirun exits with it) when MPI is running and `status` is not 0; returns
/// otherwise. Call it after the failure's one-line report: the report is
/// flushed first, since MPI_Abort does not return.
inline void abort_mpi_job(int status) noexcept {
  if (status == 0 || !mpi_is_running()) return;
  std::fflush(stdout);
  std::fflush(stderr);
#if DTRAIN_HAS_MPI()
  MPI_Abort(MPI_COMM_WORLD, status);
#endif
}

}  // namespace dtrain::detail
