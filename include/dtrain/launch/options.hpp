#pragma once
/// @file
/// agent_options: what a per-node agent (launch::per_node, dtrun) is told.
/// Every option can also come from an environment variable, dtrain's own
/// (DTRAIN_*) or torchrun's (PET_*); see with_env().

#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/device.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/launchers.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <chrono>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace dtrain {

/// How long stopped workers get between SIGTERM and SIGKILL (torchrun: 30 s).
/// Environment: DTRAIN_GRACE_PERIOD (seconds).
inline constexpr std::chrono::milliseconds default_grace_period{10'000};

/// How long an agent may go without beating its heartbeat in the store before
/// the other agents declare its node lost and end the job. Environment:
/// DTRAIN_HEARTBEAT_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_heartbeat_timeout{10'000};

/// The port of a `--rdzv-endpoint HOST` without one (torchrun's c10d default).
inline constexpr int default_rdzv_port = 29400;

namespace detail {
/// Parses a node count as dtrun's --nnodes takes it: "N", or "MIN:MAX" for
/// an elastic job (1 <= MIN <= MAX). Returns {MIN, MAX}; MIN is unset for
/// "N" and for "N:N" (not elastic). `origin` names the value in errors.
DTRAIN_DETAIL_INLINE std::pair<std::optional<int>, int> parse_node_count(const std::string& origin,
                                                                         std::string_view text);

/// Parses workers per node as torchrun's --nproc-per-node takes them: a
/// positive integer; `gpu`, the CUDA devices this process sees (config_error
/// when it sees none); `cpu`, the cores it may run on; `auto`, the GPUs if
/// any, else the cores. `count` is called for a keyword only. Returns the
/// number with its origin (`origin`, and what a keyword counted).
DTRAIN_DETAIL_INLINE sourced_int
parse_nproc_per_node(const std::string& origin, std::string_view text,
                     local_devices (*count)() = &count_local_devices);

/// Checks a rendezvous backend (torchrun's --rdzv-backend): dtrun's agents
/// meet at node 0's store, which is c10d's way; etcd, etcd-v2 and static are
/// refused, naming the dtrun flags that say the same.
DTRAIN_DETAIL_INLINE void check_rdzv_backend(const std::string& origin, std::string_view text);

/// Parses a c10d rendezvous endpoint (torchrun's --rdzv-endpoint), HOST[:PORT],
/// as node 0's store: the port is default_rdzv_port (29400) when absent, and
/// its origin says so.
DTRAIN_DETAIL_INLINE std::pair<sourced_text, sourced_int> parse_rdzv_endpoint(
    const std::string& origin, std::string_view text);

/// The value of an option as the variables `names` give it: parse(origin,
/// text) of each that is set, a T or a sourced<T>. Two that are set must agree.
template <class T, class Parse>
std::optional<sourced<T>> read_agreeing(const environment& env,
                                        std::initializer_list<std::string_view> names,
                                        std::string_view what, Parse parse) {
  std::optional<sourced<T>> found;
  for (std::string_view name : names) {
    if (auto text = env.get(name)) {
      const std::string origin = assignment(name, *text);
      if constexpr (std::is_same_v<decltype(parse(origin, *text)), sourced<T>>) {
        agree(found, parse(origin, *text), what);
      } else {
        agree(found, sourced<T>{parse(origin, *text), origin}, what);
      }
    }
  }
  return found;
}
}  // namespace detail

/// Options of the node agent. Aggregate: `{.nproc_per_node = 4, .max_restarts = 2}`.
/// Unset values come from the environment or the outer launcher (see
/// discover_world in per-node mode): NODE_RANK, OMPI_COMM_WORLD_RANK,
/// SLURM_NODEID, MASTER_ADDR, MASTER_PORT.
struct agent_options {
  /// Workers this agent starts. Environment: DTRAIN_NPROC_PER_NODE or
  /// PET_NPROC_PER_NODE (N, gpu, cpu or auto). Default: the number of visible
  /// CUDA devices for backend::nccl, else 1.
  std::optional<int> nproc_per_node{};
  /// Nodes (agents) in the job; in an elastic job, the most. Environment:
  /// DTRAIN_NNODES or PET_NNODES (N, or MIN:MAX). Default: from the outer
  /// launcher, else 1.
  std::optional<int> nnodes{};
  /// An elastic job (dtrun --nnodes MIN:MAX, as torchrun's): the fewest nodes
  /// it runs on. When a node is lost, the others go on without it (at least
  /// this many), and a node that comes (back) joins at the next round, up to
  /// nnodes; each change restarts every worker with the new world size
  /// (resume from a checkpoint: docs/checkpoints.md). Unset: exactly nnodes.
  std::optional<int> min_nnodes{};
  /// This agent's node. Environment: DTRAIN_NODE_RANK or PET_NODE_RANK
  /// (NODE_RANK is read too, and must agree).
  std::optional<int> node_rank{};
  /// Where node 0's agent serves the rendezvous store. Environment:
  /// PET_MASTER_ADDR or PET_RDZV_ENDPOINT. Default: MASTER_ADDR, else
  /// 127.0.0.1 on a single node; required with several nodes.
  std::optional<std::string> master_addr{};
  /// Its port. Environment: PET_MASTER_PORT or PET_RDZV_ENDPOINT. Default:
  /// MASTER_PORT, else a free port on a single node and 29500 with several.
  /// 0 picks a free port (single node only).
  std::optional<int> master_port{};
  /// Times the whole job is restarted after a worker fails. Environment: DTRAIN_MAX_RESTARTS.
  int max_restarts = 0;
  /// SIGTERM → SIGKILL delay when workers are stopped.
  /// Environment: DTRAIN_GRACE_PERIOD (seconds).
  std::chrono::milliseconds grace_period = default_grace_period;
  /// A node whose agent is silent this long is lost (node 0's, whose store
  /// does not answer a call this long, too): the others end the round.
  /// Environment: DTRAIN_HEARTBEAT_TIMEOUT (seconds).
  std::chrono::milliseconds heartbeat_timeout = default_heartbeat_timeout;
  /// Prefix every line the workers print with `[rank N] ` (torchrun's --tee).
  /// Environment: DTRAIN_TEE=1.
  bool tee = false;
  /// When set, each worker's output (stdout and stderr) also goes to
  /// `<log_dir>/restart_<k>/rank_<N>.log`; the workers' flight records go
  /// there too (DTRAIN_DIAGNOSTICS_DIR, unless set). Environment: DTRAIN_LOG_DIR.
  std::string log_dir{};
  /// Pass `--local_rank=N` as the workers' first argument, as
  /// torch.distributed.launch did for Hugging Face style scripts.
  /// Environment: DTRAIN_LOCAL_RANK_ARG=1.
  bool local_rank_arg = false;
  /// The job's id (torchrun's --rdzv-id): every node's agent must give the
  /// same one (or none), or the job does not start (a node of another job
  /// that reached this store is named); the workers get it as
  /// TORCHELASTIC_RUN_ID. Environment: PET_RDZV_ID.
  std::string rdzv_id{};
  /// Serve this node's workers' metrics (DTRAIN_METRICS_DIR: DDP's and the
  /// checkpoint's files, in a directory the agent owns unless set) for
  /// Prometheus, at http://HOST:PORT/metrics; 0: a free port (said on
  /// stderr). HOST is DTRAIN_METRICS_BIND, 127.0.0.1 unless set; another
  /// address needs DTRAIN_METRICS_TOKEN, which every scrape must send
  /// (Authorization: Bearer TOKEN). Unset: no endpoint.
  /// Environment: DTRAIN_METRICS_PORT.
  std::optional<int> metrics_port{};

  /// These options with DTRAIN_NPROC_PER_NODE, DTRAIN_NNODES,
  /// DTRAIN_NODE_RANK, DTRAIN_MAX_RESTARTS, DTRAIN_GRACE_PERIOD,
  /// DTRAIN_HEARTBEAT_TIMEOUT, DTRAIN_TEE, DTRAIN_LOG_DIR,
  /// DTRAIN_LOCAL_RANK_ARG and DTRAIN_METRICS_PORT applied on top: the environment
  /// wins, as for every dtrain option, so an operator can change a job without
  /// rebuilding it. torchrun's variables are read as dtrun's (Kubeflow
  /// Trainer sets them): PET_NPROC_PER_NODE and PET_NNODES beside their
  /// DTRAIN_ twins, PET_NODE_RANK beside DTRAIN_NODE_RANK and NODE_RANK,
  /// PET_MASTER_ADDR, PET_MASTER_PORT and PET_RDZV_ENDPOINT (HOST[:PORT]) beside
  /// MASTER_ADDR and MASTER_PORT (over Azure's AZ_BATCH_MASTER_NODE), PET_RDZV_BACKEND (c10d
  /// only) and PET_RDZV_ID. Throws config_error naming the variable and its
  /// value, or both variables when two that are set disagree.
  [[nodiscard]] agent_options with_env(const environment& env) const;

  /// Throws config_error when an option is out of range.
  void check() const;
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/options-inl.hpp>
#endif
