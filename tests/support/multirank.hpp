#pragma once
// One rank of a multi-rank test program: its cases are doctest TEST_CASEs that
// run in every rank of the job, each through dtrain::run (docs/developing.md,
// "Adding a test"). The program is started by the command that
// dtrain_add_multirank_test (cmake/dtrain_testing.cmake) builds:
//
//   mpirun -n N <program> --engine=mpi [--topology=hierarchical] --test-case=<case>
//   dtrain_test_launch N <program> --engine=gloo [--topology=hierarchical] --test-case=<case>
//
// A failed CHECK fails its rank (exit 1), and mpirun or the launcher fails the
// job. Every rank must run the same cases in the same order: a job runs one
// case (each TEST_CASE is its own CTest test).

#include <doctest/doctest.h>
#include <dtrain/dtrain.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace dtrain_test {

/// What the command line chose for this job.
struct job_choice {
  std::string engine;             ///< --engine=mpi|gloo
  std::string topology = "flat";  ///< --topology=flat|hierarchical
  std::string program = "a.out";  ///< argv[0], for dtrain::run
};

/// This job's choice (set by tests/support/multirank_main.cpp before any case runs).
const job_choice& job();

[[noreturn]] void end_job(int status);

/// Runs `body(ctx)` as dtrain::run<Policy>'s training function, for a program
/// whose policy is its own (a test backend). Returns 0 when run does; when run
/// fails, the case fails and the rank ends at once with run's exit status, as
/// the program would (1, or 2 for a config_error; under MPI run has already
/// ended the job), so that a test can check that status.
template <class Policy, class Body>
int run_with(Body&& body) {
  std::string program = job().program;
  char* argv[] = {program.data(), nullptr};
  const int status = dtrain::run<Policy>(
      1, argv, [&](dtrain::context<Policy>& ctx) -> int { return static_cast<int>(body(ctx)); });
  if (status != 0) {
    FAIL_CHECK("dtrain::run returned " << status << " on this rank");
    end_job(status);
  }
  return status;
}

namespace detail {
template <class Backend, class Body>
int run_backend(Body& body) {
  using dtrain::launch::per_process;
  if (job().topology == "hierarchical")
    return run_with<dtrain::policy<per_process, Backend, dtrain::topology::hierarchical>>(body);
  return run_with<dtrain::policy<per_process, Backend>>(body);
}
}  // namespace detail

/// Runs `body(ctx)` as dtrain::run's training function, with the policy
/// launch::per_process x the job's engine x its topology, as run_with does:
/// 0, or the rank ends with run's status (body's non-zero result, or 1 (2 for
/// a config_error) after run printed "[rank r/n] dtrain: <what>" for what body
/// threw). `body` is a generic lambda: `[](auto& ctx) { ... return 0; }`.
template <class Body>
int run_job(Body&& body) {
#if DTRAIN_HAS_MPI()
  if (job().engine == "mpi") return detail::run_backend<dtrain::backend::mpi>(body);
#endif
#if DTRAIN_HAS_GLOO()
  if (job().engine == "gloo") return detail::run_backend<dtrain::backend::gloo>(body);
#endif
  FAIL("engine '" << job().engine << "' is not in this build (--engine=mpi|gloo)");
  return 2;
}

/// Ends this rank with `status`, as a program ends whose training function
/// failed; run_with does so when dtrain::run fails (a test of such a job
/// checks its status and output: EXPECT_STATUS and EXPECT of
/// dtrain_add_multirank_test). Under MPI dtrain::run never returns from a
/// failure: it ends the job (MPI_Abort) with that status itself.
[[noreturn]] inline void end_job(int status) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::exit(status);
}

/// Whether `Context`'s policy uses topology::hierarchical.
template <class Context>
inline constexpr bool is_hierarchical =
    std::is_same_v<typename Context::policy_type::topology_type, dtrain::topology::hierarchical>;

}  // namespace dtrain_test
