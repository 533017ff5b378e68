#pragma once
/// @file
/// Every environment variable of dtrain's own (`DTRAIN_*`), by name, in one
/// place: the code reads and names them only through these constants, and
/// docs/reference.md's table is checked against this list (the test
/// docs.environment_reference). The launchers' variables (RANK, WORLD_SIZE,
/// MASTER_ADDR, OMPI_COMM_WORLD_*, SLURM_*, ...) are read by env/launchers.hpp;
/// the torchrun flags' variables (PET_*) that the node agent reads are named
/// at the end.

#include <array>
#include <string_view>

namespace dtrain {

// --- the store and rendezvous (rendezvous/options.hpp, rendezvous/security.hpp)

/// The store's shared secret: every client proves it in the handshake.
inline constexpr std::string_view store_token_variable = "DTRAIN_STORE_TOKEN";
/// The address the store listens on instead of the one MASTER_ADDR names
/// ("0.0.0.0": every interface).
inline constexpr std::string_view store_bind_variable = "DTRAIN_STORE_BIND";
/// Seconds of a store client's connect, get, wait and barrier (default 300).
inline constexpr std::string_view store_timeout_variable = "DTRAIN_STORE_TIMEOUT";
/// Seconds one read or write on a store connection may take.
inline constexpr std::string_view store_io_timeout_variable = "DTRAIN_STORE_IO_TIMEOUT";
/// Seconds the store keeps a silent connection open.
inline constexpr std::string_view store_idle_timeout_variable = "DTRAIN_STORE_IDLE_TIMEOUT";
/// The most connections the store holds at once.
inline constexpr std::string_view store_max_connections_variable = "DTRAIN_STORE_MAX_CONNECTIONS";
/// The most bytes of keys and values the store holds.
inline constexpr std::string_view store_max_bytes_variable = "DTRAIN_STORE_MAX_BYTES";
/// Seconds between reports of a rendezvous or connection still waiting.
inline constexpr std::string_view rendezvous_progress_variable = "DTRAIN_RENDEZVOUS_PROGRESS";

// --- world discovery (env/placement.hpp)

/// This node's name for placement (default: the host name).
inline constexpr std::string_view node_name_variable = "DTRAIN_NODE_NAME";

// --- the node agent and dtrun (launch/)

/// Workers per node (dtrun --nproc-per-node).
inline constexpr std::string_view nproc_per_node_variable = "DTRAIN_NPROC_PER_NODE";
/// Nodes in the job (dtrun --nnodes).
inline constexpr std::string_view nnodes_variable = "DTRAIN_NNODES";
/// This node's rank (dtrun --node-rank).
inline constexpr std::string_view node_rank_variable = "DTRAIN_NODE_RANK";
/// Restarts of the whole job after a failure (dtrun --max-restarts).
inline constexpr std::string_view max_restarts_variable = "DTRAIN_MAX_RESTARTS";
/// Seconds between SIGTERM and SIGKILL (dtrun --grace-period).
inline constexpr std::string_view grace_period_variable = "DTRAIN_GRACE_PERIOD";
/// Seconds without an agent's heartbeat before its node is declared lost.
inline constexpr std::string_view heartbeat_timeout_variable = "DTRAIN_HEARTBEAT_TIMEOUT";
/// Switch: prefix every line the workers print with `[rank N] ` (dtrun --tee).
inline constexpr std::string_view tee_variable = "DTRAIN_TEE";
/// A directory for each worker's output, DIR/restart_K/rank_N.log (dtrun --log-dir).
inline constexpr std::string_view log_dir_variable = "DTRAIN_LOG_DIR";
/// Switch: give each worker `--local_rank=N` (dtrun --pass-local-rank).
inline constexpr std::string_view local_rank_arg_variable = "DTRAIN_LOCAL_RANK_ARG";
/// Set by the agent for its workers: the agents' store (HOST:PORT).
inline constexpr std::string_view agent_store_variable = "DTRAIN_AGENT_STORE";
/// Set by the agent for its workers: how many times the job was restarted.
inline constexpr std::string_view restart_count_variable = "DTRAIN_RESTART_COUNT";
/// Set by the node agent for its workers: its directory in memory for the
/// checkpoints' memory tier (checkpoint_options::memory_dir).
inline constexpr std::string_view memory_checkpoint_variable = "DTRAIN_MEMORY_CHECKPOINT_DIR";
/// Set by the node agent for its workers in a job of several nodes: the
/// store (HOST:PORT) of the next node's agent, which holds their memory
/// copies of per-rank state (checkpoint_options::memory_buddy).
inline constexpr std::string_view memory_buddy_variable = "DTRAIN_MEMORY_BUDDY";
/// Set by the node agent for its workers in a job of several nodes: its own
/// store (HOST:PORT) of the copies the node before it sent
/// (checkpoint_options::memory_held).
inline constexpr std::string_view memory_held_variable = "DTRAIN_MEMORY_HELD";

// --- collectives and engines (backend/)

/// Seconds a collective may take before it is a timeout_error.
inline constexpr std::string_view collective_timeout_variable = "DTRAIN_COLLECTIVE_TIMEOUT";
/// Switch: compare every collective's signature across ranks before it runs.
inline constexpr std::string_view check_collectives_variable = "DTRAIN_CHECK_COLLECTIVES";
/// Seconds a watchdog may stay stuck past a collective's deadline (its abort,
/// or the device, not returning) before it ends the process.
inline constexpr std::string_view watchdog_heartbeat_variable = "DTRAIN_WATCHDOG_HEARTBEAT";
/// Seconds NCCL's communicator set-up may take.
inline constexpr std::string_view nccl_init_timeout_variable = "DTRAIN_NCCL_INIT_TIMEOUT";
/// The network interface Gloo uses (before GLOO_SOCKET_IFNAME).
inline constexpr std::string_view gloo_ifname_variable = "DTRAIN_GLOO_IFNAME";
/// Switch: Gloo's allreduces through shared memory when all ranks share a host.
inline constexpr std::string_view gloo_shm_variable = "DTRAIN_GLOO_SHM";

// --- failure diagnostics and timelines

/// Switch: on a failure, gather and print the ranks' collective tables.
inline constexpr std::string_view diagnostics_variable = "DTRAIN_DIAGNOSTICS";
/// Seconds a failing rank waits for the other ranks' tables.
inline constexpr std::string_view diagnostics_wait_variable = "DTRAIN_DIAGNOSTICS_WAIT";
/// A directory where each rank writes its flight record (dtrain_flight_rank<R>.bin)
/// whenever a diagnostics round runs; `dtrun --flight-records DIR` reads them.
inline constexpr std::string_view diagnostics_dir_variable = "DTRAIN_DIAGNOSTICS_DIR";
/// A file for DDP's timeline (one per rank); empty: none.
inline constexpr std::string_view timeline_variable = "DTRAIN_TIMELINE";
/// DDP's straggler watch: "off", "auto", or the steps between its exchanges.
inline constexpr std::string_view stragglers_variable = "DTRAIN_STRAGGLERS";
/// A directory where DDP writes each rank's metrics file (dtrain_rank<R>.prom).
inline constexpr std::string_view metrics_dir_variable = "DTRAIN_METRICS_DIR";
/// The node agent's metrics endpoint: its port (dtrun --metrics-port; 0: a free one).
inline constexpr std::string_view metrics_port_variable = "DTRAIN_METRICS_PORT";
/// The address the metrics endpoint listens on (127.0.0.1 unless set).
inline constexpr std::string_view metrics_bind_variable = "DTRAIN_METRICS_BIND";
/// The token every scrape of the metrics endpoint must send (Authorization: Bearer).
inline constexpr std::string_view metrics_token_variable = "DTRAIN_METRICS_TOKEN";

// --- the doctor (examples/doctor.cpp)

/// The directory the doctor reads as /sys (to inspect a captured host).
inline constexpr std::string_view sysfs_root_variable = "DTRAIN_SYSFS_ROOT";

namespace detail {

/// Every name above, for checks and listings.
inline constexpr std::array dtrain_variables{
    store_token_variable,
    store_bind_variable,
    store_timeout_variable,
    store_io_timeout_variable,
    store_idle_timeout_variable,
    store_max_connections_variable,
    store_max_bytes_variable,
    rendezvous_progress_variable,
    node_name_variable,
    nproc_per_node_variable,
    nnodes_variable,
    node_rank_variable,
    max_restarts_variable,
    grace_period_variable,
    heartbeat_timeout_variable,
    tee_variable,
    log_dir_variable,
    local_rank_arg_variable,
    agent_store_variable,
    restart_count_variable,
    memory_checkpoint_variable,
    memory_buddy_variable,
    memory_held_variable,
    collective_timeout_variable,
    check_collectives_variable,
    watchdog_heartbeat_variable,
    nccl_init_timeout_variable,
    gloo_ifname_variable,
    gloo_shm_variable,
    diagnostics_variable,
    diagnostics_wait_variable,
    diagnostics_dir_variable,
    timeline_variable,
    stragglers_variable,
    metrics_dir_variable,
    metrics_port_variable,
    metrics_bind_variable,
    metrics_token_variable,
    sysfs_root_variable,
};

}  // namespace detail

// --- torchrun's flags as variables (PET_<FLAG>: the flag's default), which
// Kubeflow Trainer and PyTorchJob set; the node agent reads them as dtrun's
// own (agent_options::with_env).

/// Workers per node (--nproc-per-node): N, gpu, cpu or auto.
inline constexpr std::string_view pet_nproc_per_node_variable = "PET_NPROC_PER_NODE";
/// Nodes in the job (--nnodes): N or MIN:MAX.
inline constexpr std::string_view pet_nnodes_variable = "PET_NNODES";
/// This node's rank (--node-rank).
inline constexpr std::string_view pet_node_rank_variable = "PET_NODE_RANK";
/// Node 0's address (--master-addr).
inline constexpr std::string_view pet_master_addr_variable = "PET_MASTER_ADDR";
/// Node 0's store port (--master-port).
inline constexpr std::string_view pet_master_port_variable = "PET_MASTER_PORT";
/// The rendezvous backend (--rdzv-backend): only c10d, dtrun's store.
inline constexpr std::string_view pet_rdzv_backend_variable = "PET_RDZV_BACKEND";
/// Node 0's store as HOST[:PORT] (--rdzv-endpoint).
inline constexpr std::string_view pet_rdzv_endpoint_variable = "PET_RDZV_ENDPOINT";
/// The job's id, the same on every node (--rdzv-id).
inline constexpr std::string_view pet_rdzv_id_variable = "PET_RDZV_ID";

}  // namespace dtrain
