// Under mpirun: how ranks agree on the NCCL unique id (no GPU needed:
// ncclGetUniqueId only opens NCCL's bootstrap socket). Exit 0 on every rank
// when all of this holds:
//  1. broadcast_nccl_unique_id from the last rank (a root other than 0) gives
//     every rank the same non-zero id;
//  2. when the root cannot create the id (an NCCL_COMM_ID that is no address,
//     on the root only), the root throws NCCL's error and every other rank a
//     rendezvous_error with the root's message, at once;
//  3. the same through a store (rank 0 serves it; nccl_communicator's
//     exchange_unique_id): the same id everywhere, and rank 0's failure in
//     every rank's words;
//  4. rank 0's device, claimed before its id: a rank 0 with device -1 makes
//     every rank fail with rank 0's message, not wait for an id.
// The store's timeout is 60 s: a rank that waited for the id instead would
// end with a timeout_error, which fails the checks below.
#include "mpi_checks.hpp"

#include <dtrain/backend/nccl/nccl.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/server.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <mpi.h>

namespace {

using namespace mpi_checks;

/// Every rank gets the same non-zero id (gathered to rank 0).
void check_same_id(const ncclUniqueId& id, const std::string& how) {
  std::vector<char> all(static_cast<std::size_t>(size) * sizeof id);
  MPI_Gather(&id, sizeof id, MPI_BYTE, all.data(), sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  const ncclUniqueId zero{};
  check(std::memcmp(all.data(), &zero, sizeof zero) != 0, how + ": the id is all zeros");
  for (int r = 1; r < size; ++r) {
    check(std::memcmp(all.data(), all.data() + static_cast<std::size_t>(r) * sizeof id,
                      sizeof id) == 0,
          how + ": rank " + std::to_string(r) + " got a different id than rank 0");
  }
}

/// Runs `step` on this rank, where `root` is made to fail first; checks that
/// the root throws its own error (containing `root_says`) and every other
/// rank a rendezvous_error with the root's message.
void check_root_failure(int root, const std::string& how, const std::string& root_says,
                        const std::function<void()>& step) {
  std::string error;
  bool rendezvous = false;
  try {
    step();
  } catch (const dtrain::rendezvous_error& e) {
    rendezvous = true;
    error = e.what();
  } catch (const std::exception& e) {
    error = e.what();
  }
  check(contains(error, root_says), how + ": \"" + error + "\" lacks \"" + root_says + "\"");
  if (rank != root) {
    check(rendezvous, how + ": expected a rendezvous_error, got \"" + error + "\"");
    check(
        contains(error, "rank " + std::to_string(root) + " could not provide the NCCL unique id: "),
        how + ": \"" + error + "\" does not name rank " + std::to_string(root));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

int main(int argc, char** argv) {
  start(argc, argv);
  const int last = size - 1;
  try {
    // 1. Over MPI, from the last rank.
    check_same_id(dtrain::broadcast_nccl_unique_id(MPI_COMM_WORLD, last), "over MPI");

    // 2. Over MPI, the root fails.
    check_root_failure(last, "over MPI, the root failing", "Invalid NCCL_COMM_ID", [&] {
      if (rank == last) ::setenv("NCCL_COMM_ID", "no address at all", 1);
      try {
        (void)dtrain::broadcast_nccl_unique_id(MPI_COMM_WORLD, last);
      } catch (...) {
        ::unsetenv("NCCL_COMM_ID");
        throw;
      }
      ::unsetenv("NCCL_COMM_ID");
    });

    // 3. Through a store that rank 0 serves.
    const dtrain::store_options options{.timeout = std::chrono::seconds(60),
                                        .log = [](std::string_view) {}};
    std::optional<dtrain::store_server> server;
    int port = 0;
    if (rank == 0) {
      server.emplace("127.0.0.1", 0, options);
      port = server->port();
    }
    MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
    dtrain::store_client client("127.0.0.1", port, options);
    check_same_id(dtrain::nccl_communicator::exchange_unique_id(client, rank, size, "id/ok"),
                  "through the store");
    check_root_failure(0, "through the store, rank 0 failing", "Invalid NCCL_COMM_ID", [&] {
      if (rank == 0) ::setenv("NCCL_COMM_ID", "no address at all", 1);
      try {
        (void)dtrain::nccl_communicator::exchange_unique_id(client, rank, size, "id/failed");
      } catch (...) {
        ::unsetenv("NCCL_COMM_ID");
        throw;
      }
      ::unsetenv("NCCL_COMM_ID");
    });

    // 4. Rank 0's device comes first: device -1 there, and nobody waits for its id.
    check_root_failure(0, "through the store, rank 0 without a device",
                       "CUDA device -1 of NCCL rank 0 is negative", [&] {
                         dtrain::nccl_communicator comm(
                             client, rank, size, rank == 0 ? -1 : 0,
                             dtrain::nccl_options{.store_key = "id/device"});
                       });
    MPI_Barrier(MPI_COMM_WORLD);  // rank 0's store outlives every client's last request
  } catch (const std::exception& e) {
    check(false, std::string("unexpected: ") + e.what());
  }
  const int any_failed = mpi_checks::any_failed();
  if (rank == 0 && any_failed == 0) {
    std::printf("the NCCL unique id reached all %d ranks, and so did its root's failures\n", size);
  }
  MPI_Finalize();
  return any_failed;
}
