#pragma once
/// @file
/// agent_options: what a per-node agent (launch::per_node, dtrun) is told.
/// Every option can also come from an environment variable; see with_env().

#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace dtrain {

/// How long stopped workers get between SIGTERM and SIGKILL (torchrun: 30 s).
/// Environment: DTRAIN_GRACE_PERIOD (seconds).
inline constexpr std::chrono::milliseconds default_grace_period{10'000};

/// How long an agent may go without beating its heartbeat in the store before
/// the other agents declare its node lost and end the job. Environment:
/// DTRAIN_HEARTBEAT_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_heartbeat_timeout{10'000};

namespace detail {
/// Parses a node count as dtrun's --nnodes takes it: "N", or "MIN:MAX" for
/// an elastic job (1 <= MIN <= MAX). Returns {MIN, MAX}; MIN is unset for
/// "N" and for "N:N" (not elastic). `origin` names the value in errors.
DTRAIN_DETAIL_INLINE std::pair<std::optional<int>, int> parse_node_count(const std::string& origin,
                                                                         std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::pair<std::optional<int>, int> parse_node_count(const std::string& origin,
                                                                         std::string_view text) {
  const std::size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    const int n = parse_non_negative(origin, text);
    if (n < 1) throw config_error(origin + " must be at least 1 (nodes)");
    return {std::nullopt, n};
  }
  const int least = parse_non_negative(origin + " (MIN)", text.substr(0, colon));
  const int most = parse_non_negative(origin + " (MAX)", text.substr(colon + 1));
  if (least < 1 || least > most) {
    throw config_error(origin + ": MIN:MAX needs 1 <= MIN <= MAX (nodes; e.g. 1:4)");
  }
  return {least < most ? std::optional<int>(least) : std::nullopt, most};
}
#endif  // DTRAIN_DETAIL_BODIES()
}  // namespace detail

/// Options of the node agent. Aggregate: `{.nproc_per_node = 4, .max_restarts = 2}`.
/// Unset values come from the environment or the outer launcher (see
/// discover_world in per-node mode): NODE_RANK, OMPI_COMM_WORLD_RANK,
/// SLURM_NODEID, MASTER_ADDR, MASTER_PORT.
struct agent_options {
  /// Workers this agent starts. Environment: DTRAIN_NPROC_PER_NODE. Default:
  /// the number of visible CUDA devices for backend::nccl, else 1.
  std::optional<int> nproc_per_node{};
  /// Nodes (agents) in the job; in an elastic job, the most. Environment:
  /// DTRAIN_NNODES (N, or MIN:MAX). Default: from the outer launcher, else 1.
  std::optional<int> nnodes{};
  /// An elastic job (dtrun --nnodes MIN:MAX, as torchrun's): the fewest nodes
  /// it runs on. When a node is lost, the others go on without it (at least
  /// this many), and a node that comes (back) joins at the next round, up to
  /// nnodes; each change restarts every worker with the new world size
  /// (resume from a checkpoint: docs/checkpoints.md). Unset: exactly nnodes.
  std::optional<int> min_nnodes{};
  /// This agent's node. Environment: DTRAIN_NODE_RANK (NODE_RANK is read too,
  /// and must agree).
  std::optional<int> node_rank{};
  /// Where node 0's agent serves the rendezvous store. Default: MASTER_ADDR,
  /// else 127.0.0.1 on a single node; required with several nodes.
  std::optional<std::string> master_addr{};
  /// Its port. Default: MASTER_PORT, else a free port on a single node and
  /// 29500 with several. 0 picks a free port (single node only).
  std::optional<int> master_port{};
  /// Times the whole job is restarted after a worker fails. Environment: DTRAIN_MAX_RESTARTS.
  int max_restarts = 0;
  /// SIGTERM → SIGKILL delay when workers are stopped.
  /// Environment: DTRAIN_GRACE_PERIOD (seconds).
  std::chrono::milliseconds grace_period = default_grace_period;
  /// A node whose agent is silent this long is lost: the others end the job.
  /// Environment: DTRAIN_HEARTBEAT_TIMEOUT (seconds).
  std::chrono::milliseconds heartbeat_timeout = default_heartbeat_timeout;
  /// Prefix every line the workers print with `[rank N] ` (torchrun's --tee).
  /// Environment: DTRAIN_TEE=1.
  bool tee = false;
  /// When set, each worker's output (stdout and stderr) also goes to
  /// `<log_dir>/restart_<k>/rank_<N>.log`. Environment: DTRAIN_LOG_DIR.
  std::string log_dir{};
  /// Pass `--local_rank=N` as the workers' first argument, as
  /// torch.distributed.launch did for Hugging Face style scripts.
  /// Environment: DTRAIN_LOCAL_RANK_ARG=1.
  bool local_rank_arg = false;

  /// These options with DTRAIN_NPROC_PER_NODE, DTRAIN_NNODES,
  /// DTRAIN_NODE_RANK, DTRAIN_MAX_RESTARTS, DTRAIN_GRACE_PERIOD,
  /// DTRAIN_HEARTBEAT_TIMEOUT, DTRAIN_TEE,
  /// DTRAIN_LOG_DIR and DTRAIN_LOCAL_RANK_ARG applied on top: the environment
  /// wins, as for every dtrain option, so an operator can change a job without
  /// rebuilding it. Throws config_error naming the variable and its value.
  [[nodiscard]] agent_options with_env(const environment& env) const;

  /// Throws config_error when an option is out of range.
  void check() const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE agent_options agent_options::with_env(const environment& env) const {
  agent_options out = *this;
  auto count = [&](std::string_view name, std::optional<int>& into, int least) {
    if (auto v = detail::read_int(env, name)) {
      if (v->value < least) {
        throw config_error(v->origin + " must be at least " + std::to_string(least));
      }
      into = v->value;
    }
  };
  count(nproc_per_node_variable, out.nproc_per_node, 1);
  if (auto text = env.get(nnodes_variable)) {
    const auto [least, most] =
        detail::parse_node_count(detail::assignment(nnodes_variable, *text), *text);
    out.nnodes = most;
    out.min_nnodes = least;
  }
  count(node_rank_variable, out.node_rank, 0);
  if (auto v = detail::read_int(env, max_restarts_variable)) out.max_restarts = v->value;
  if (auto t = detail::read_seconds(env, grace_period_variable)) out.grace_period = *t;
  if (auto t = detail::read_seconds(env, heartbeat_timeout_variable)) out.heartbeat_timeout = *t;
  if (auto f = detail::read_flag(env, tee_variable)) out.tee = *f;
  if (auto dir = env.get(log_dir_variable); dir && !dir->empty()) out.log_dir = std::string(*dir);
  if (auto f = detail::read_flag(env, local_rank_arg_variable)) out.local_rank_arg = *f;
  out.check();
  return out;
}

DTRAIN_DETAIL_INLINE void agent_options::check() const {
  auto at_least = [](const char* name, const std::optional<int>& v, int least) {
    if (v && *v < least) {
      throw config_error("option " + std::string(name) + "=" + std::to_string(*v) +
                         " must be at least " + std::to_string(least));
    }
  };
  at_least("nproc_per_node", nproc_per_node, 1);
  at_least("nnodes", nnodes, 1);
  at_least("min_nnodes", min_nnodes, 1);
  if (min_nnodes && (!nnodes || *min_nnodes > *nnodes)) {
    throw config_error("option min_nnodes=" + std::to_string(*min_nnodes) +
                       (nnodes ? " is more than nnodes=" + std::to_string(*nnodes)
                               : " needs nnodes (the most nodes)"));
  }
  at_least("node_rank", node_rank, 0);
  auto at_most = [](const char* name, const std::optional<int>& v) {
    if (v && *v > max_world_size) {
      throw config_error("option " + std::string(name) + "=" + std::to_string(*v) +
                         " is more than dtrain's limit of " + std::to_string(max_world_size) +
                         " ranks (max_world_size)");
    }
  };
  at_most("nproc_per_node", nproc_per_node);
  at_most("nnodes", nnodes);
  if (max_restarts < 0) {
    throw config_error("option max_restarts=" + std::to_string(max_restarts) + " is negative");
  }
  if (grace_period.count() < 0) throw config_error("option grace_period is negative");
  if (heartbeat_timeout.count() <= 0) {
    throw config_error("option heartbeat_timeout=" + std::to_string(heartbeat_timeout.count()) +
                       " ms must be positive");
  }
  if (master_port && *master_port != 0) {
    detail::check_port("option master_port=" + std::to_string(*master_port), *master_port);
  }
  if (master_addr && master_addr->empty()) throw config_error("option master_addr is empty");
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
