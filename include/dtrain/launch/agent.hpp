#pragma once
/// @file
/// node_agent: the per-node launcher (launch::per_node, dtrun). It starts the
/// node's workers with torchrun's environment, hosts the rendezvous store on
/// node 0, supervises the workers, stops the whole job on the first failure
/// (on every node), restarts it up to a limit, and forwards signals. Each
/// restart round is an agent_round (launch/round.hpp); the agents meet
/// through agent_store (launch/agent_store.hpp).

#include <dtrain/config.hpp>
#include <dtrain/detail/net.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/agent_store.hpp>
#include <dtrain/launch/metrics_endpoint.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/process.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/launch/round.hpp>
#include <dtrain/launch/signals.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/server.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace dtrain {

/// The agent of one node. run() starts `nproc_per_node` workers running
/// `command`, and returns the exit status the agent should exit with: 0 when
/// every worker of every node succeeded, else the failing worker's status
/// (128 + signal for a killed one). Throws config_error on bad options.
/// The summary it prints names the worker that went wrong: the first failure,
/// or, when that was a collective that a worker which had already ended well
/// never issued, that worker first (it left its peers waiting).
///
/// Each worker gets torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
/// ROLE_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS (and
/// TORCHELASTIC_RUN_ID, the rdzv_id, when one is given), plus
/// DTRAIN_RESTART_COUNT and DTRAIN_AGENT_STORE, and for the checkpoints'
/// memory tier DTRAIN_MEMORY_CHECKPOINT_DIR and (several nodes)
/// DTRAIN_MEMORY_BUDDY and DTRAIN_MEMORY_HELD. MASTER_PORT is a port that
/// node 0's agent picks for the workers in each round (a PyTorch worker's
/// rank 0 binds its own store there); dtrain workers meet at the agent's
/// store instead, which outlives restarts.
namespace detail {
/// A node's directory for the checkpoints' memory tier (DTRAIN_MEMORY_CHECKPOINT_DIR
/// of its workers): made in /dev/shm (else the temporary directory), private
/// to this user, and removed with all in it when its agent ends, so that it
/// outlives every worker but not the job. Empty when neither can hold one.
/// Its name carries the agent's pid: an agent removes the directories that
/// agents of this user which are gone (SIGKILLed) left behind. `what` names
/// what it holds ("memory"; "metrics": the workers' DTRAIN_METRICS_DIR, which
/// the agent's metrics endpoint serves).
class memory_directory {
 public:
  explicit memory_directory(int node_rank, std::string_view what = "memory");
  memory_directory(const memory_directory&) = delete;
  memory_directory& operator=(const memory_directory&) = delete;
  ~memory_directory();
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};
}  // namespace detail

class node_agent {
 public:
  /// `command` is the worker's argv; `env` the environment the workers
  /// inherit (and where NODE_RANK, MASTER_ADDR, ... are read); `options` are
  /// final (apply with_env() before).
  node_agent(std::vector<std::string> command, agent_options options,
             environment env = environment::from_process(), store_options store = {});

  /// The node as the agent sees it (node_rank, num_nodes, nproc as local_world_size).
  [[nodiscard]] const world& node() const noexcept { return node_; }

  /// Runs the job to the end; see the class comment for the exit status.
  int run();

 private:
  [[nodiscard]] int node_rank() const { return *node_.node_rank; }
  [[nodiscard]] int nnodes() const { return *node_.num_nodes; }
  /// dtrun --nnodes MIN:MAX (agent_options::min_nnodes): rounds of the nodes present.
  [[nodiscard]] bool elastic() const { return options_.min_nnodes.has_value(); }

  void say(const std::string& text, bool verbose = false) const;

  /// The options of this agent's connection to the job's store: the store's,
  /// but on a node other than 0 a call waits for a reply at most the heartbeat
  /// timeout (when DTRAIN_STORE_IO_TIMEOUT is longer). Node 0's agent beats its
  /// heartbeat in that store, so a store silent that long is node 0's agent
  /// frozen, or its host gone without closing its connections (store_lost()
  /// then tells which), found as soon as a frozen node of another rank is.
  store_options client_options() const;
  /// The store's options for one look at node 0's store (store_lost(),
  /// await_new_store()): 1 s to connect, no progress lines.
  store_options probe_options() const;
  /// In a handler, for a failure of this agent (the exception handled): tells
  /// the other nodes through `store` (unless gone), so that they end too, and
  /// returns 128 + signal when a signal ended a wait, else rethrows it.
  int fail(std::optional<detail::agent_store>& store, int restart);
  /// After `store` failed: whether node 0's store is gone (nothing answers at
  /// its address, or a new store does), not merely this call.
  bool store_lost(detail::agent_store& store) const;
  /// Node 0's agent is gone with the store (`why`; `silent`: it does not
  /// answer), in round `restart`: waits, at most the store timeout, for a
  /// store at the same address (an agent that takes node 0's place serves it;
  /// or node 0's, awake again). Returns 0 once one answers, 128 + signal when
  /// a signal asks the agent to stop; throws timeout_error.
  int await_new_store(const std::string& why, bool silent, int restart, std::uint64_t known);

  /// Runs restart rounds until one succeeds, or one fails with no restart
  /// left; returns the job's exit status. `restart` follows the round under way.
  int run_rounds(detail::agent_store& store, int& restart);
  /// The same for an elastic job: node 0 forms each round of the nodes that
  /// are ready (at least min_nnodes); a lost node or a node that comes ends
  /// the round, and the next is formed. Only failures count as restarts.
  int run_elastic_rounds(detail::agent_store& store, int& restart);
  /// Whether a round's failure `end` ends the job (final, or `used` restarts
  /// are all of max_restarts); says so when it does.
  bool ends_job(const detail::round_end& end, int used) const;

  /// Starts this node's workers for one round of `members` (the round's
  /// nodes, ascending) and supervises them until the round ends on every
  /// node. The round stops them on every way out.
  detail::round_end run_round(detail::agent_store& store, int restart,
                              const std::vector<int>& members);

  /// The environment of a worker: `group` is this node's place among the
  /// round's `groups` nodes (its node rank, unless elastic); `buddy` the
  /// store that holds its memory copies (DTRAIN_MEMORY_BUDDY; empty: none).
  std::vector<std::string> worker_environment(int rank, int local_rank, int restart,
                                              int worker_port, int group, int groups,
                                              const std::string& buddy) const;
  /// Starts `server`, where this agent holds the memory copies of the node
  /// before it (checkpoint_options::memory_buddy), and returns its HOST:PORT;
  /// empty (said why) when it cannot.
  std::string serve_buddies(std::optional<store_server>& server);

  std::vector<std::string> command_;
  agent_options options_;
  environment env_;
  store_options store_options_;
  world node_;
  int nproc_ = 1;
  std::string master_addr_;
  int master_port_ = 0;
  std::string memory_dir_;  // the workers' DTRAIN_MEMORY_CHECKPOINT_DIR, while run() runs
  std::string buddy_at_;  // where this agent holds the copies of the node before it (serve_buddies)
  std::string metrics_dir_;  // the workers' DTRAIN_METRICS_DIR, which the endpoint serves
  int failures_ = 0;         // elastic: the rounds that failed (restarts used), across stores
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/agent-inl.hpp>
#endif
