#pragma once
/// @file
/// One restart round of a node agent: the node's workers, the warden that
/// takes their process groups down if the agent dies, and the relay that
/// carries their output. The round owns all three. It starts the workers,
/// supervises them until the round ends on every node, and stops them once:
/// when it ends, or when it is destroyed early (an exception, a signal during
/// a wait), whichever comes first.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/agent_store.hpp>
#include <dtrain/launch/process.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/launch/signals.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/types.h>

namespace dtrain::detail {

/// Prints one line of node `node_rank`'s agent on stderr: "[dtrain agent node 0/2] ...".
DTRAIN_DETAIL_INLINE void agent_say(int node_rank, int nnodes, const std::string& text);

/// How a restart round ended.
struct round_end {
  bool succeeded = false;
  int status = 0;        ///< exit status for the agent when the job ends here
  bool final = false;    ///< no restart: a signal or a lost peer ended the job
  bool regroup = false;  ///< elastic: the nodes change; the next round, no restart counted
  std::string message;   ///< who failed how
  /// The nodes this agent found gone (their lease) or silent (their
  /// heartbeat) in the round: a fixed-size job waits for agents in their places.
  std::vector<int> lost{};
};

/// One worker of a round: its place in the job and what it runs.
struct worker_start {
  int rank = 0;
  int local_rank = 0;
  worker_command command;
};

/// What an agent tells each of its rounds.
struct round_settings {
  int restart = 0;
  int node_rank = 0;
  int nnodes = 1;
  int nproc = 1;
  /// The round's nodes (node ranks, ascending): every node of the job,
  /// unless elastic (min_nodes set), where node 0 chose them for this round.
  std::vector<int> members{};
  /// Elastic (dtrun --nnodes MIN:MAX): a lost node fails the round, not the
  /// job, and node 0 ends the round when a node waits to join (a regroup).
  bool elastic = false;
  bool tee = false;     ///< prefix the workers' lines with `[rank N] `
  std::string log_dir;  ///< also write <log_dir>/restart_<k>/rank_<N>.log
  std::chrono::milliseconds grace_period{};
  std::chrono::milliseconds heartbeat_timeout{};
};

/// One restart round: starting → running → stopping → ended. start() starts
/// the workers, supervise() watches them, the store and the signals until
/// the round ends on every node, stops what is left and says how it ended.
/// Destroyed before it ended, the round stops its workers with the signal
/// the agent received (SIGTERM if none), drains their output and ends its
/// warden: every resource is released once, on every path.
class agent_round {
 public:
  enum class state { starting, running, stopping, ended };

  /// Forks the warden, before the relay starts a thread. The warden's child
  /// makes only async-signal-safe calls, so other threads (the store's) may run.
  explicit agent_round(round_settings settings)
      : settings_(std::move(settings)),
        warden_(settings_.nproc),
        relay_(settings_.tee, settings_.log_dir),
        beats_(settings_.members) {}
  agent_round(const agent_round&) = delete;
  agent_round& operator=(const agent_round&) = delete;
  ~agent_round();

  [[nodiscard]] state current() const noexcept { return state_; }
  /// The workers started so far (each with its wait status once reaped).
  [[nodiscard]] const std::vector<worker_process>& workers() const noexcept { return workers_; }

  /// Starts the workers (starting → running). Throws program_error when one
  /// cannot be started, config_error when its log file cannot be written;
  /// the workers already started are stopped when the round is destroyed.
  void start(const std::vector<worker_start>& workers);

  /// Supervises the running workers until the round ends on every node
  /// (running → ended): the first failure anywhere, a signal to the agent or
  /// a lost node stops them; success waits for every node's workers. Throws
  /// rendezvous_error when the store is gone.
  round_end supervise(agent_store& store);

 private:
  void say(const std::string& text) const {
    agent_say(settings_.node_rank, settings_.nnodes, text);
  }

  // A node whose agent is gone (its lease ended with its connection: at
  // once) or went silent (its heartbeat) fails the round for everyone (read
  // by on_failure). First, about once a second, whether this agent still
  // holds its node's place (agent_store::check_place(): agent_replaced; and
  // on_failure, before the round ends).
  void watch_peers(agent_store& store);
  // Elastic, node 0: a node waiting for the next round ends this one (a regroup).
  void watch_joiners(agent_store& store);

  // A signal to the agent ends the job: forwarded to the workers, and told to the other nodes.
  std::optional<round_end> on_signal(agent_store& store);

  void forward_diagnostics_requests();

  // Waits a moment for a worker to exit; the first that failed is recorded. A
  // dtrain worker has recorded its own failure, with its reason, before it exits.
  void note_exits(agent_store& store);

  std::optional<round_end> on_failure(agent_store& store);

  std::optional<round_end> on_success(agent_store& store);

  // Sends `sig` to the workers' groups (0: none, they are done), kills and
  // reaps what is left, and drains their output. Once: later calls do nothing.
  void stop(int sig);

  round_settings settings_;
  worker_warden warden_;  // before the relay: forked before its thread starts
  output_relay relay_;
  std::vector<worker_process> workers_;
  heartbeat beats_;
  std::chrono::steady_clock::time_point last_join_check_{};
  std::chrono::steady_clock::time_point last_lease_check_{};
  std::chrono::steady_clock::time_point last_place_check_{};  // agent_store::check_place()
  std::vector<int> lost_;   // the nodes watch_peers() found gone or silent
  bool peer_lost_ = false;  // recorded: no more checks this round
  bool reported_success_ = false;
  state state_ = state::starting;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/round-inl.hpp>
#endif
