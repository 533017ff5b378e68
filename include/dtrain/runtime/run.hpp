#pragma once
/// @file
/// dtrain::run<Policy>(argc, argv, fn): the whole life of a process in a job.
/// A worker discovers its world, joins the rendezvous, builds the
/// communicator, runs `fn(context&)` and tears down; under launch::per_node
/// the process first started is the node agent, which re-executes the
/// program as the node's workers. Every failure becomes one rank-prefixed
/// line on stderr and a non-zero exit status.

#include <dtrain/backend/watchdog.hpp>
#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/device.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/agent.hpp>
#include <dtrain/launch/command_line.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/launch/worker.hpp>
#include <dtrain/policy.hpp>
#include <dtrain/runtime/context.hpp>

#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace dtrain {

namespace detail {

/// Prints `<who> dtrain: <what>` as one line on stderr and returns the status.
DTRAIN_DETAIL_INLINE int report_failure(const std::string& who,
                                        const std::pair<int, std::string>& failure);

/// This program's own path, for an agent that re-executes it.
DTRAIN_DETAIL_INLINE std::string own_executable();

/// Default workers per node: one per visible GPU for backends that use GPUs
/// (NCCL), else one; the GPUs counted as `--nproc-per-node gpu` counts them.
template <class Policy>
int default_nproc_per_node() {
  if constexpr (Policy::traits::uses_gpus) {
    if (const int gpus = count_local_devices().gpus; gpus > 0) return gpus;
  }
  return 1;
}

/// The workers per node that the command line asks for, torchrun's way:
/// `--nproc-per-node N`, `--nproc-per-node=N`, or the same with
/// `--nproc_per_node`; the last one counts, and nothing after `--`. Nullopt
/// when absent; config_error naming the flag when its value is not a positive
/// integer, or when another of dtrun's flags has a bad value (agent_flags).
[[nodiscard]] inline std::optional<int> nproc_per_node_from_args(
    std::span<const std::string_view> args) {
  return agent_flags::of_program(args).values().nproc_per_node;
}

/// What run() accepts: called as fn(context<Policy>&), returning void or an int.
template <class Fn, class Policy>
concept training_function_for = requires(Fn& fn, context<Policy>& ctx) {
  fn(ctx);
};

/// The training function as run_process sees it: one signature, whatever the
/// lambda, so run_process depends on the policy only (and can be compiled once,
/// dtrain/runtime/compiled.hpp). Refers to `fn`, which must outlive it.
template <class Policy>
class training_function {
 public:
  template <class Fn>
  explicit training_function(Fn& fn) noexcept
      : fn_(const_cast<void*>(static_cast<const void*>(std::addressof(fn)))), call_(&call<Fn>) {}
  /// Calls fn(ctx): its int result, or 0 when it returns void.
  int operator()(context<Policy>& ctx) const { return call_(fn_, ctx); }

 private:
  template <class Fn>
  static int call(void* fn, context<Policy>& ctx) {
    if constexpr (std::is_void_v<std::invoke_result_t<Fn&, context<Policy>&>>) {
      (*static_cast<Fn*>(fn))(ctx);
      return 0;
    } else {
      return static_cast<int>((*static_cast<Fn*>(fn))(ctx));
    }
  }

  void* fn_;
  int (*call_)(void*, context<Policy>&);
};

/// dtrain::run without the function's type: the agent, or a worker that runs `fn`.
template <class Policy>
int run_process(int argc, char** argv, training_function<Policy> fn, const run_options& options);

}  // namespace detail

/// Runs `fn` as one worker of a data-parallel job and returns the process's
/// exit status, for `return dtrain::run<Policy>(argc, argv, fn);` in main.
///
/// `fn` is called as `fn(context<Policy>&)` and may return void (exit 0) or
/// an int (the exit status). Under launch::per_node the process started by
/// the user is the node agent: it starts `nproc_per_node` copies of this
/// program (the same argv, unchanged) as workers and returns the job's
/// status (see node_agent). Workers are recognised by DTRAIN_AGENT_STORE in
/// their environment.
///
/// The agent takes dtrun's flags from the program's command line, as torchrun
/// users expect: `./train --nproc-per-node 2 --max-restarts 1 --epochs 3`.
/// Every flag of `dtrun --help` is read (`--nproc-per-node`, `--nnodes`,
/// `--node-rank`, `--master-addr`, `--master-port`, `--standalone`,
/// `--max-restarts`, `--grace-period`, `--heartbeat-timeout`, `--tee`,
/// `--log-dir`, `--pass-local-rank`, `--rdzv-endpoint`, `--rdzv-backend`,
/// `--rdzv-id`; `--flag value` or `--flag=value`, `_` for `-`), except
/// `--help`, `--no-python` and `--module`, which stay the program's.
/// Every other argument is the program's own; nothing after `--` is read; the
/// workers get the whole argv unchanged. Each option comes from, first to
/// last: its environment variable (DTRAIN_NPROC_PER_NODE, or torchrun's
/// PET_NPROC_PER_NODE, ...; see agent_options::with_env), run_options::agent
/// when it differs from agent_options' default, the flag, then the default
/// (for nproc_per_node: one per visible GPU for NCCL, else 1; `gpu`, `cpu`
/// or `auto` count as dtrun counts them). A bad value is a config_error
/// naming its source, e.g. `--master-port=70000 on the command line is
/// outside the port range 1-65535` (exit status 2).
///
/// Any exception ends the process's part in the job: one line on stderr,
/// `[rank 3/8] dtrain: <what>`, and exit status 2 for a config_error, else 1.
/// A worker ignores SIGPIPE (a dead peer is an error, not a silent death).
/// When MPI is running (the MPI backend, or MPI initialised by the caller), a
/// failed worker, or one whose `fn` returned non-zero, calls MPI_Abort with
/// its exit status after its report, so mpirun ends the whole job at once.
template <class Policy, detail::training_function_for<Policy> Fn>
int run(int argc, char** argv, Fn&& fn, const run_options& options = {}) {
  if constexpr (std::is_function_v<std::remove_reference_t<Fn>>) {
    auto* function = &fn;  // a function is no object: it is called through a pointer
    return detail::run_process<Policy>(argc, argv, detail::training_function<Policy>(function),
                                       options);
  } else {
    return detail::run_process<Policy>(argc, argv, detail::training_function<Policy>(fn), options);
  }
}

// Not inline: under `extern template` (dtrain/runtime/compiled.hpp) the agent, the store
// and the engine stay out of the user's translation unit.
template <class Policy>
int detail::run_process(int argc, char** argv, training_function<Policy> fn,
                        const run_options& options) {
  const environment env = environment::from_process();
  std::vector<std::string_view> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  const bool agent =
      Policy::launch_type::mode == launch_mode::per_node && !env.contains(agent_store_variable);

  if (agent) {
    std::string who = "[agent]";
    try {
      agent_options opts = options.agent;
      // The environment (with_env) wins over the program's options, which win over its argv.
      detail::agent_flags::of_program(args).fill(opts);
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
      // A watchdog's failure found after the training function's last call
      // that could report it (its buckets timed out while DDP's destructor
      // followed them) fails the rank as if the function had thrown it.
      detail::late_failure_hold late;
      status = fn(ctx);
      if (std::exception_ptr e = late.take()) std::rethrow_exception(e);
    } catch (...) {
      auto failure = detail::current_failure();
      if (auto summary = ctx.explain_failure(std::current_exception()))
        failure.second += "; diagnostics: " + *summary;
      // The rank's own line first: once the agent has the record it ends the
      // job, this rank included, and a line not yet written would be lost.
      const int code = detail::report_failure(detail::rank_label(&*w), failure);
      ctx.record_failure(failure.first, failure.second);
      detail::abort_mpi_job(code);
      ctx.abort_communicator();  // exit now, not after the collectives peers will never join
      return code;
    }
    if (status != 0) {
      const bool mpi = detail::mpi_is_running();
      if (mpi) {  // the line before the record, as above
        detail::report_failure(detail::rank_label(&*w),
                               {status, "the training function returned " + std::to_string(status) +
                                            "; aborting the MPI job"});
      }
      ctx.record_failure(status, {});
      ctx.abort_communicator();
      if (mpi) detail::abort_mpi_job(status);
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

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/runtime/run-inl.hpp>
#endif
