#pragma once
/// @file
/// dtrain::run<Policy>(argc, argv, fn): the whole life of a process in a job.
/// A worker discovers its world, joins the rendezvous, builds the
/// communicator, runs `fn(context&)` and tears down; under launch::per_node
/// the process first started is the node agent, which re-executes the
/// program as the node's workers. Every failure becomes one rank-prefixed
/// line on stderr and a non-zero exit status.

#include <dtrain/context.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/agent.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/worker.hpp>
#include <dtrain/policy.hpp>

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif

namespace dtrain {

/// Exit status of a process whose input (environment, options) was bad.
inline constexpr int config_error_exit_status = 2;

namespace detail {

/// "[rank 3/8]", or what is known of it.
inline std::string rank_label(const world* w) {
  if (w == nullptr || !w->rank) return "[rank ?]";
  return "[rank " + std::to_string(*w->rank) + "/" +
         (w->world_size ? std::to_string(*w->world_size) : "?") + "]";
}

/// The exit status and text of the exception in flight: 2 for a config_error,
/// 127 / 126 for a worker program that is missing / not executable, else 1.
inline std::pair<int, std::string> current_failure() {
  try {
    throw;
  } catch (const program_error& e) {
    return {e.exit_status(), e.what()};
  } catch (const config_error& e) {
    return {config_error_exit_status, e.what()};
  } catch (const std::exception& e) {
    return {1, e.what()};
  } catch (...) {
    return {1, "an exception that is not a std::exception"};
  }
}

/// Prints `<who> dtrain: <what>` as one line on stderr and returns the status.
inline int report_failure(const std::string& who, const std::pair<int, std::string>& failure) {
  std::fprintf(stderr, "%s dtrain: %s\n", who.c_str(), failure.second.c_str());
  return failure.first;
}

/// This program's own path, for an agent that re-executes it.
inline std::string own_executable() {
  std::vector<char> path(4096);
  ssize_t n = DTRAIN_SYSCALL(::readlink("/proc/self/exe", path.data(), path.size() - 1));
  return std::string(path.data(), static_cast<std::size_t>(n));
}

/// Default workers per node: one per visible GPU for backends that use GPUs (NCCL), else one.
template <class Policy>
int default_nproc_per_node() {
#if DTRAIN_HAS_CUDA()
  if constexpr (Policy::traits::uses_gpus) {
    int count = 0;
    if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return count;
    (void)cudaGetLastError();
  }
#endif
  return 1;
}

}  // namespace detail

/// Runs `fn` as one worker of a data-parallel job and returns the process's
/// exit status, for `return dtrain::run<Policy>(argc, argv, fn);` in main.
///
/// `fn` is called as `fn(context<Policy>&)` and may return void (exit 0) or
/// an int (the exit status). Under launch::per_node the process started by
/// the user is the node agent: it starts `nproc_per_node` copies of this
/// program (the same argv) as workers and returns the job's status (see
/// node_agent). Workers are recognised by DTRAIN_AGENT_STORE in their
/// environment.
///
/// Any exception ends the process's part in the job: one line on stderr,
/// `[rank 3/8] dtrain: <what>`, and exit status 2 for a config_error, else 1.
/// A worker ignores SIGPIPE (a dead peer is an error, not a silent death).
/// When MPI is running (the MPI backend, or MPI initialised by the caller), a
/// failed worker, or one whose `fn` returned non-zero, calls MPI_Abort with
/// its exit status after its report, so mpirun ends the whole job at once.
template <class Policy, class Fn>
requires std::is_invocable_v < Fn&, context<Policy>
& > int run(int argc, char** argv, Fn&& fn, const run_options& options = {}) {
  const environment env = environment::from_process();
  std::vector<std::string_view> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  const bool agent =
      Policy::launch_type::mode == launch_mode::per_node && !env.contains(agent_store_variable);

  if (agent) {
    std::string who = "[agent]";
    try {
      agent_options opts = options.agent;
      if (!opts.nproc_per_node) opts.nproc_per_node = detail::default_nproc_per_node<Policy>();
      opts = opts.with_env(env);
      std::vector<std::string> command{detail::own_executable()};
      for (int i = 1; i < argc; ++i) command.emplace_back(argv[i]);
      node_agent node(std::move(command), opts, env, options.store.with_env(env));
      who = "[agent node " + std::to_string(*node.node().node_rank) + "/" +
            std::to_string(*node.node().num_nodes) + "]";
      return node.run();
    } catch (...) {
      return detail::report_failure(who, detail::current_failure());
    }
  }

  detail::ignore_sigpipe();
  std::optional<world> w;
  try {
    w = discover_world(env, args);
    context<Policy> ctx(*w, env, options);
    w = ctx.world();
    int status = 0;
    try {
      if constexpr (std::is_void_v<std::invoke_result_t<Fn&, context<Policy>&>>) {
        fn(ctx);
      } else {
        status = static_cast<int>(fn(ctx));
      }
    } catch (...) {
      auto failure = detail::current_failure();
      if (auto summary = ctx.explain_failure(std::current_exception())) failure.second += "; diagnostics: " + *summary;
      ctx.record_failure(failure.first, failure.second);
      const int code = detail::report_failure(detail::rank_label(&*w), failure);
      detail::abort_mpi_job(code);
      return code;
    }
    if (status != 0) {
      ctx.record_failure(status, {});
      if (detail::mpi_is_running()) {
        detail::report_failure(detail::rank_label(&*w),
                               {status, "the training function returned " +
                                            std::to_string(status) + "; aborting the MPI job"});
        detail::abort_mpi_job(status);
      }
      return status;
    }
    ctx.finish();
    return 0;
  } catch (...) {
    const int code =
        detail::report_failure(detail::rank_label(w ? &*w : nullptr), detail::current_failure());
    detail::abort_mpi_job(code);  // MPI initialised by the caller, with peers still waiting
    return code;
  }
}

}  // namespace dtrain
