#pragma once
/// @file
/// One reader per launcher. Each turns that launcher's variables into an
/// `observation`: what it says about this process, each value with the
/// variable that said it. discover_world() (env/discover.hpp) reconciles them.

#include <dtrain/config.hpp>
#include <dtrain/detail/hostlist.hpp>
#include <dtrain/detail/json.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {

/// Port used when a launcher names a master host but no port, and
/// MASTER_PORT is unset (torchrun's default). Under Slurm the default is
/// slurm_default_port(SLURM_JOB_ID) instead, so two jobs sharing a node differ.
inline constexpr int default_master_port = 29500;

/// 20000 + job id mod 10000: a port that two Slurm jobs on one node are unlikely to share.
[[nodiscard]] constexpr int slurm_default_port(long long job_id) noexcept {
  return 20000 + static_cast<int>(job_id % 10000);
}

namespace detail {

using field = world::field;
constexpr std::size_t count_fields = 6;  // rank .. num_nodes

/// What one launcher (or one loose variable) says about this process.
struct observation {
  launcher source = launcher::none;
  std::array<std::optional<sourced_int>, count_fields> counts{};
  // A master derived from a host list (TF_CONFIG, Slurm): used only when no
  // variable names the master explicitly.
  std::optional<sourced_text> fallback_addr;
  std::optional<sourced_int> fallback_port;
  process_role role = process_role::worker;
  std::string note;
  // env:// only: WORLD_SIZE without RANK, as Azure ML's Lightning recipe sets
  // it beside OMPI_COMM_WORLD_*: a loose variable that must agree with the
  // launcher, and an error when there is none.
  std::optional<sourced_int> world_size_alone;

  std::optional<sourced_int>& operator[](field f) { return counts[static_cast<std::size_t>(f)]; }
  const std::optional<sourced_int>& operator[](field f) const {
    return counts[static_cast<std::size_t>(f)];
  }
  /// A launcher, as opposed to loose variables like LOCAL_RANK alone: it says how many processes
  /// there are.
  [[nodiscard]] bool is_launcher() const { return (*this)[field::world_size].has_value(); }
};

/// Reads NAME_RANK/NAME_SIZE-style pairs: both or neither.
DTRAIN_DETAIL_INLINE void read_rank_and_size(const environment& env, observation& o,
                                             std::string_view rank_var, std::string_view size_var);

/// env:// — torchrun, dtrun, Azure ML PyTorch jobs, Kubeflow PyTorchJob. Also
/// loose LOCAL_RANK / NODE_RANK, which other launchers' users often export.
DTRAIN_DETAIL_INLINE observation read_env_url(const environment& env);

/// Hugging Face style `--local_rank=N`, `--local_rank N`, `--local-rank=N`,
/// `--local-rank N` (the old torch.distributed.launch without --use_env).
/// `args` excludes the program name; scanning stops at `--`.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_argv_local_rank(
    std::span<const std::string_view> args);

/// The variables of a launcher that states rank, size, local rank and local size.
struct rank_variables {
  std::string_view rank, size, local_rank, local_size;
};

/// Reads a launcher that states rank, size, local rank and local size.
DTRAIN_DETAIL_INLINE observation read_ranks(const environment& env, launcher source,
                                            const rank_variables& names);

/// Open MPI's mpirun. OMPI_COMM_WORLD_NODE_RANK is deliberately not read: it
/// is the rank among this node's processes (like the local rank), not the
/// node's index, and Open MPI gives no node index at all. Open MPI 4 exports
/// the number of nodes in the job's map as OMPI_MCA_orte_num_nodes.
DTRAIN_DETAIL_INLINE observation read_open_mpi(const environment& env);

/// MPICH / Intel MPI (Hydra). No node index or node count.
DTRAIN_DETAIL_INLINE observation read_hydra(const environment& env);

/// The first of `names` that is set, with its name.
DTRAIN_DETAIL_INLINE std::optional<std::pair<std::string_view, std::string_view>> first_set(
    const environment& env, std::initializer_list<std::string_view> names);

/// srun. Only inside a job step (SLURM_STEP_ID set): a batch script carries
/// the allocation's SLURM_NTASKS too, but it is one process, and believing
/// otherwise would wait forever for ranks that never start. Step-level
/// variables win over job-level ones, which describe the whole allocation.
DTRAIN_DETAIL_INLINE observation read_slurm(const environment& env);

/// horovodrun. HOROVOD_CROSS_RANK is the rank among the processes that share
/// this local rank; it is the node index only for local rank 0, or when
/// every node runs the same number of processes (SIZE = LOCAL_SIZE × CROSS_SIZE).
DTRAIN_DETAIL_INLINE observation read_horovod(const environment& env);

/// The member `key` of `obj` when it has the expected kind; nullptr when absent.
DTRAIN_DETAIL_INLINE const json::value* json_member(const json::value& obj, std::string_view key,
                                                    json::value::kind kind,
                                                    const std::string& where);

/// TF_CONFIG: {"cluster": {"chief": [...], "worker": [...], "ps": [...],
/// "evaluator": [...]}, "task": {"type": ..., "index": ...}}. Data-parallel
/// ranks are the chief (TF1's "master" too) then the workers; ps and
/// evaluator tasks get their role and no rank.
DTRAIN_DETAIL_INLINE observation read_tf_config(const environment& env);

/// The master named outright: MASTER_ADDR / MASTER_PORT; without
/// MASTER_ADDR, the address of Azure's AZ_BATCH_MASTER_NODE (addr:port,
/// multi-node: its port is Azure Batch's own, never used) or else
/// AZ_BATCHAI_MPI_MASTER_NODE (addr, single node). `note`: MASTER_ADDR and
/// Azure's address differ (MASTER_ADDR is used).
struct explicit_master {
  std::optional<sourced_text> addr;
  std::optional<sourced_int> port;
  std::string note{};
};

DTRAIN_DETAIL_INLINE explicit_master read_explicit_master(const environment& env);

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/launchers-inl.hpp>
#endif
