// The checks of the programs that test the NCCL communicator's MPI paths
// (nccl_mpi_id.cpp, nccl_mpi_gpus.cpp): a check that does not hold prints this
// rank's reason and marks the rank failed; the program ends with every rank's verdict.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <string>

namespace mpi_checks {

inline int rank = 0, size = 0;
inline int failed = 0;

inline void check(bool holds, const std::string& what) {
  if (holds) return;
  std::printf("rank %d: %s\n", rank, what.c_str());
  failed = 1;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// MPI_Init, with errors returned (so that dtrain's checks see them), and this rank.
inline void start(int& argc, char**& argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
}

/// 1 when a check failed on any rank, else 0 (collective).
inline int any_failed() {
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}

}  // namespace mpi_checks
