// Under mpirun: the NCCL communicator made from an MPI communicator checks,
// as the store constructor does, that no two ranks share a GPU, over the host
// fake of CUDA and NCCL (fake_nccl.hpp: CUDA_VISIBLE_DEVICES maps each rank's
// device onto the node's fake GPUs). Exit 0 on every rank when all of this holds:
//  1. two ranks shown the same GPU (CUDA_VISIBLE_DEVICES=2,2) fail, each with
//     the store path's config_error: the GPU, both ranks, their CUDA_VISIBLE_DEVICES;
//  2. rank 1 cannot read its GPU (FAKE_CUDA_IDENTITY_FAILS_RANK=1): it throws
//     its own error, every other rank a rendezvous_error with rank 1's reason;
//  3. ranks on GPUs of their own (CUDA_VISIBLE_DEVICES=2,3) get a communicator.
// Nothing waits for a timeout: a rank that missed a step would hang, and the
// test's TIMEOUT ends it.
#include "fake_nccl.hpp"
#include "mpi_checks.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace mpi_checks;

/// Creates this rank's communicator (device = its rank) with `visible` as
/// CUDA_VISIBLE_DEVICES; returns the error's kind and text, empty when none.
std::pair<std::string, std::string> create(const std::string& visible) {
  ::setenv("CUDA_VISIBLE_DEVICES", visible.c_str(), 1);
  std::pair<std::string, std::string> out;
  try {
    fake_nccl::communicator comm(MPI_COMM_WORLD, rank,
                                 dtrain::nccl_options{.cuda_visible_devices = visible});
    check(comm.valid() && comm.rank() == rank && comm.size() == size,
          "the communicator is not this rank's of " + std::to_string(size));
  } catch (const dtrain::config_error& e) {
    out = {"config_error", e.what()};
  } catch (const dtrain::rendezvous_error& e) {
    out = {"rendezvous_error", e.what()};
  } catch (const std::exception& e) {
    out = {"other", e.what()};
  }
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  MPI_Barrier(MPI_COMM_WORLD);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  start(argc, argv);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);  // what the fake's *_RANK knobs compare
  // Where the fake's ranks meet: made by rank 0, the same for all.
  char dir[] = "/tmp/dtrain_nccl_mpi_gpus.XXXXXX";
  if (rank == 0 && ::mkdtemp(dir) == nullptr) std::abort();
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  ::setenv("FAKE_NCCL_DIR", dir, 1);

  // 1. Two ranks on GPU 2.
  {
    const auto [kind, text] = create("2,2");
    check(kind == "config_error",
          "a shared GPU: expected a config_error, got " + kind + " \"" + text + "\"");
    check(contains(text, "ranks 0 and 1 on host ") && contains(text, "both use GPU GPU-fake2-") &&
              contains(text, "rank 1 as CUDA device 1 (CUDA_VISIBLE_DEVICES=2,2)"),
          "a shared GPU: \"" + text + "\" does not name the GPU and both ranks");
  }
  // 2. Rank 1 cannot read its GPU.
  {
    ::setenv("FAKE_CUDA_IDENTITY_FAILS_RANK", "1", 1);
    const auto [kind, text] = create("2,3");
    ::unsetenv("FAKE_CUDA_IDENTITY_FAILS_RANK");
    check(contains(text, "cudaErrorECCUncorrectable"),
          "an unreadable GPU: \"" + text + "\" lacks rank 1's reason");
    if (rank != 1) {
      check(kind == "rendezvous_error" && contains(text, "rank 1 cannot use its GPU: "),
            "an unreadable GPU: expected a rendezvous_error naming rank 1, got " + kind + " \"" +
                text + "\"");
    }
  }
  // 3. A GPU each.
  {
    const auto [kind, text] = create("2,3");
    check(kind.empty(), "GPUs of their own: " + kind + " \"" + text + "\"");
  }

  const int any_failed = mpi_checks::any_failed();
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    if (any_failed == 0)
      std::printf("over MPI, %d ranks on one GPU failed naming it, and on their own GPUs did not\n",
                  size);
  }
  MPI_Finalize();
  return any_failed;
}
