// dtrain_mpi_tests: the MPI backend, run as every rank under mpirun.
//   mpirun -np N dtrain_mpi_tests            the doctest suite
//   mpirun -np 2 dtrain_mpi_tests --die      rank 1 exits mid-job; the job must end, not hang
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <dtrain/dtrain.hpp>

#include "collective_suite.hpp"
#include "support.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include <unistd.h>

using namespace std::chrono_literals;

namespace {
std::optional<dtrain::mpi_communicator> world;
}

TEST_CASE("mpi: every collective x type x op against a serial computation") {
  dtrain_test::run_collective_suite(*world);
}

TEST_CASE("mpi: topology::flat runs the collective on the world communicator") {
  std::vector<double> v(5, 1.0);
  dtrain::topology::flat::allreduce(*world, dtrain::host_buffer(std::span(v)),
                                    dtrain::host_buffer(std::span(v)), dtrain::reduce_op::sum)
      .wait();
  CHECK(v[4] == static_cast<double>(world->size()));
  std::vector<std::int32_t> b{world->rank()};
  dtrain::topology::flat::broadcast(*world, dtrain::host_buffer(std::span(b)), world->size() - 1)
      .wait();
  CHECK(b[0] == world->size() - 1);
}

TEST_CASE("mpi: split by parity, then reduce within each half") {
  auto half = world->split(world->rank() % 2, world->rank());
  const int members = (world->size() + 1 - world->rank() % 2) / 2;
  CHECK(half.size() == members);
  CHECK(half.rank() == world->rank() / 2);
  std::vector<std::int64_t> v{world->rank()};
  dtrain::allreduce(half, std::span(v)).wait();
  std::int64_t expected = 0;
  for (int r = world->rank() % 2; r < world->size(); r += 2) expected += r;
  CHECK(v[0] == expected);
  dtrain_test::run_collective_suite(half);
}

TEST_CASE("mpi: a negative color to split() leaves the rank out") {
  dtrain_test::run_left_out_split(*world);
}

TEST_CASE("mpi: check mode reports a rank that passed a different size") {
  auto checked = dtrain::mpi_communicator::world({.collectives = {.check = true}});
  std::vector<float> right(4, 1.0f);
  dtrain::allreduce(checked, std::span(right)).wait();  // agreeing calls pass
  CHECK(right[0] == static_cast<float>(checked.size()));
  if (checked.size() < 2) return;
  std::vector<float> data(checked.rank() == 1 ? 5 : 4, 1.0f);
  try {
    dtrain::allreduce(checked, std::span(data)).wait();
    FAIL("mismatched sizes were not reported");
  } catch (const dtrain::backend_error& e) {
    // Numbered as in the ring and the desync table: the second collective of `checked`.
    CHECK_CONTAINS(std::string(e.what()),
                   checked.rank() == 1
                       ? "rank 0 called collective #2: allreduce(sum, float32 \u00d7 4)"
                       : "rank 1 called collective #2: allreduce(sum, float32 \u00d7 5)");
  }
}

TEST_CASE(
    "mpi: a collective a peer never joins times out, and the communicator refuses further use") {
  auto group = world->split(0, world->rank());
  if (group.size() < 2) return;
  // Static: MPI may still write into it after rank 0 gave up on the collective.
  static std::vector<float> v(16, 1.0f);
  if (group.rank() == 0) {
    auto w = dtrain::allreduce(group, std::span(v));
    CHECK_THROWS_WITH_AS(w.wait(200ms), doctest::Contains("did not finish within 0.2 s"),
                         dtrain::timeout_error);
    CHECK_THROWS_WITH_AS(group.barrier(), doctest::Contains("unusable"), dtrain::backend_error);
    world->barrier().wait();  // let the late ranks join now, so MPI can complete what it holds
  } else {
    world->barrier().wait();  // join only after rank 0 gave up
    dtrain::allreduce(group, std::span(v)).wait();
  }
}

TEST_CASE("mpi: MPI was initialised by dtrain, with the thread level it needs") {
  int provided = 0;
  MPI_Query_thread(&provided);
  CHECK(provided == MPI_THREAD_MULTIPLE);
  MPI_Comm mine = world->native();
  MPI_Errhandler handler;
  MPI_Comm_get_errhandler(mine, &handler);
  CHECK(handler == MPI_ERRORS_RETURN);
  MPI_Errhandler_free(&handler);
}

TEST_CASE("mpi: cuda_aware_direct is refused by an MPI that cannot take device pointers") {
  // Collective (MPI_Comm_dup) only when it is accepted: every rank sees the same MPI.
  if (DTRAIN_HAS_CUDA() && dtrain::mpi_environment::cuda_aware()) {
    auto direct = dtrain::mpi_communicator::from(MPI_COMM_WORLD, {.cuda_aware_direct = true});
    CHECK(direct.size() == world->size());
    return;
  }
  CHECK_THROWS_WITH_AS(dtrain::mpi_communicator::from(MPI_COMM_WORLD, {.cuda_aware_direct = true}),
                       doctest::Contains("mpi_options::cuda_aware_direct is set"),
                       dtrain::config_error);
  // Host buffers never touch the staging pool.
  std::vector<float> v(1000, 1.0f);
  dtrain::allreduce(*world, std::span(v)).wait();
  CHECK(world->staging_bytes() == 0);
}

int main(int argc, char** argv) {
  try {
    world.emplace(dtrain::mpi_communicator::world());
    if (argc > 1 && std::strcmp(argv[1], "--die") == 0) {
      std::vector<float> v(1 << 20, 1.0f);
      if (world->rank() == 1) {
        std::fprintf(stderr, "rank 1 exiting on purpose before the allreduce\n");
        std::fflush(stderr);
        ::_exit(3);
      }
      dtrain::allreduce(*world, std::span(v)).wait(30s);
      std::fprintf(stderr, "rank %d: the allreduce finished without rank 1\n", world->rank());
      return 0;
    }
    doctest::Context context(argc, argv);
    int status = context.run();
    world.reset();  // finalizes MPI
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain_mpi_tests: %s\n", e.what());
    return 1;
  }
}
