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

/// Runs `body(ctx)` as dtrain::run<Policy>'s training function and returns
/// run's exit status: for a program whose policy is its own (a test backend).
template <class Policy, class Body>
int run_with(Body&& body) {
  std::string program = job().program;
  char* argv[] = {program.data(), nullptr};
  return dtrain::run<Policy>(
      1, argv, [&](dtrain::context<Policy>& ctx) -> int { return static_cast<int>(body(ctx)); });
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
/// launch::per_process x the job's engine x its topology; returns run's exit
/// status: body's result, or 1 (2 for a config_error) after run printed
/// "[rank r/n] dtrain: <what>" for what body threw. `body` is a generic
/// lambda: `[](auto& ctx) { ... return 0; }`.
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

/// Ends this rank as a program ends whose training function failed: with
/// dtrain::run's exit status, for a case whose job must fail (its test checks
/// the job's status and output: EXPECT_STATUS and EXPECT of
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
