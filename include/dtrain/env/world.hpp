#pragma once
/// @file
/// `dtrain::world`: who this process is in the job, as the launcher told it.
/// A plain value; discover_world() (env/discover.hpp) builds it.

#include <dtrain/config.hpp>
#include <dtrain/detail/json.hpp>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

/// The launcher whose variables identified this process.
enum class launcher {
  none,       ///< no launcher variables: a single process
  env,        ///< env:// (torchrun, dtrun, Azure ML PyTorch, Kubeflow, Lightning-style NODE_RANK)
  open_mpi,   ///< Open MPI's mpirun (OMPI_COMM_WORLD_*)
  hydra,      ///< MPICH / Intel MPI Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID)
  slurm,      ///< srun (SLURM_PROCID, SLURM_NTASKS, ...)
  horovod,    ///< horovodrun (HOROVOD_RANK, ...)
  tf_config,  ///< TF_CONFIG (Kubeflow TFJob, Azure ML TensorFlow jobs)
};

/// The launcher's name as whoami and describe() print it.
[[nodiscard]] constexpr std::string_view to_string(launcher l) noexcept {
  switch (l) {
    case launcher::none: return "none";
    case launcher::env: return "env";
    case launcher::open_mpi: return "open_mpi";
    case launcher::hydra: return "hydra";
    case launcher::slurm: return "slurm";
    case launcher::horovod: return "horovod";
    case launcher::tf_config: return "tf_config";
  }
  return "unknown";
}

/// What this process is in the job. Only workers hold a data-parallel rank.
enum class process_role {
  worker,            ///< a data-parallel rank
  node_agent,        ///< a per-node launcher process that starts the workers of its node
  parameter_server,  ///< TF_CONFIG task type "ps"
  evaluator,         ///< TF_CONFIG task type "evaluator"
};

[[nodiscard]] constexpr std::string_view to_string(process_role r) noexcept {
  switch (r) {
    case process_role::worker: return "worker";
    case process_role::node_agent: return "agent";
    case process_role::parameter_server: return "ps";
    case process_role::evaluator: return "evaluator";
  }
  return "unknown";
}

/// The most ranks a dtrain job may have (1,048,576): sizes from options and
/// the environment are checked against it before anything is allocated for
/// them or multiplied, so that a typo is a config_error, not bad_alloc.
inline constexpr int max_world_size = 1 << 20;

/// Who this process is. A field the environment does not determine is
/// nullopt — unknown, never guessed; the runtime completes the node fields at
/// rendezvous by grouping ranks by host name.
struct world {
  std::optional<int> rank;              ///< 0 .. world_size-1; unknown for agents, ps, evaluators
  std::optional<int> world_size;        ///< number of data-parallel workers in the job
  std::optional<int> local_rank;        ///< rank among the workers on this node
  std::optional<int> local_world_size;  ///< workers on this node
  std::optional<int> node_rank;         ///< index of this node, 0 .. num_nodes-1
  std::optional<int> num_nodes;         ///< nodes in the job
  std::optional<std::string> master_addr;  ///< where the rendezvous store listens
  std::optional<int> master_port;
  launcher source = launcher::none;
  process_role role = process_role::worker;

  /// The fields, in the order describe() and to_json() print them.
  enum class field : std::size_t {
    rank,
    world_size,
    local_rank,
    local_world_size,
    node_rank,
    num_nodes,
    master_addr,
    master_port,
  };
  static constexpr std::size_t field_count = 8;
  static constexpr std::array<std::string_view, field_count> field_names{
      "rank",      "world_size", "local_rank",  "local_world_size",
      "node_rank", "num_nodes",  "master_addr", "master_port"};

  /// Where each known field came from, e.g. "RANK=3" or
  /// "SLURM_STEP_TASKS_PER_NODE=2(x3),1 at SLURM_NODEID=3"; empty when unknown.
  std::array<std::string, field_count> origins{};
  /// Remarks for logs: outer launchers seen, variables deliberately not used.
  std::string notes;

  [[nodiscard]] const std::string& origin(field f) const {
    return origins[static_cast<std::size_t>(f)];
  }

  /// True when every rank and node field is known (master fields excluded:
  /// a single process needs none, and mpirun jobs agree on one through MPI).
  [[nodiscard]] bool complete() const noexcept {
    return rank && world_size && local_rank && local_world_size && node_rank && num_nodes;
  }

  /// One or two lines for logs: each field with the variable it came from.
  [[nodiscard]] std::string describe() const;
};

/// The world as one JSON object on one line (no newline), with the keys rank,
/// world_size, local_rank, local_world_size, node_rank, num_nodes,
/// master_addr, master_port (null when unknown), source, and role when the
/// process is not a plain worker. This is what `dtrain_whoami` prints.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string to_json(const world& w);

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/world-inl.hpp>
#endif
