// Under mpirun: broadcast_nccl_unique_id from the last rank (a root other than
// 0) must give every rank the same non-zero id. Needs no GPU: ncclGetUniqueId
// only opens NCCL's bootstrap socket. Exit 0 on every rank when it holds.
#include <dtrain/backend/nccl.hpp>

#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int failed = 0;
  ncclUniqueId id{};
  try {
    id = dtrain::broadcast_nccl_unique_id(MPI_COMM_WORLD, size - 1);
  } catch (const std::exception& e) {
    std::printf("rank %d: %s\n", rank, e.what());
    failed = 1;
  }
  std::vector<char> all(static_cast<std::size_t>(size) * sizeof id);
  MPI_Gather(&id, sizeof id, MPI_BYTE, all.data(), sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank == 0 && !failed) {
    const ncclUniqueId zero{};
    if (std::memcmp(all.data(), &zero, sizeof zero) == 0) {
      std::printf("rank 0: the broadcast id is all zeros\n");
      failed = 1;
    }
    for (int r = 1; r < size; ++r) {
      if (std::memcmp(all.data(), all.data() + static_cast<std::size_t>(r) * sizeof id,
                      sizeof id) != 0) {
        std::printf("rank %d got a different NCCL unique id than rank 0\n", r);
        failed = 1;
      }
    }
    if (!failed)
      std::printf("the same NCCL unique id reached all %d ranks from rank %d\n", size, size - 1);
  }
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
