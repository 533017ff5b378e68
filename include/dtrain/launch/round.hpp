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
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void agent_say(int node_rank, int nnodes, const std::string& text) {
  std::fprintf(stderr, "[dtrain agent node %d/%d] %s\n", node_rank, nnodes, text.c_str());
  std::fflush(stderr);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How a restart round ended.
struct round_end {
  bool succeeded = false;
  int status = 0;        ///< exit status for the agent when the job ends here
  bool final = false;    ///< no restart: a signal or a lost peer ended the job
  bool regroup = false;  ///< elastic: the nodes change; the next round, no restart counted
  std::string message;   ///< who failed how
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

  // A node whose agent went silent fails the round for everyone (read by on_failure).
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
  bool reported_success_ = false;
  state state_ = state::starting;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE agent_round::~agent_round() {
  try {
    const int sig = pending_agent_signal();
    stop(sig != 0 ? sig : SIGTERM);
  } catch (...) {
    // Out of memory while stopping: the warden still kills the groups when it ends.
  }
}

DTRAIN_DETAIL_INLINE void agent_round::start(const std::vector<worker_start>& workers) {
  if (relay_.active()) {
    std::vector<int> ranks;
    for (const worker_start& w : workers) ranks.push_back(w.rank);
    relay_.open_logs(settings_.restart, ranks);
  }
  workers_.reserve(workers.size());
  for (const worker_start& w : workers) {
    const pid_t pid = spawn_worker(w.command, relay_.active() ? &relay_ : nullptr, w.rank);
    worker_process& p = workers_.emplace_back();
    p.rank = w.rank;
    p.local_rank = w.local_rank;
    p.pid = pid;
    p.exit_fd = open_exit_fd(pid);
    warden_.guard(w.local_rank, pid);
  }
  state_ = state::running;
}

DTRAIN_DETAIL_INLINE round_end agent_round::supervise(agent_store& store) {
  while (true) {
    watch_peers(store);
    watch_joiners(store);
    if (auto end = on_signal(store)) return *end;
    forward_diagnostics_requests();
    note_exits(store);
    if (auto end = on_failure(store)) return *end;
    if (auto end = on_success(store)) return *end;
  }
}

DTRAIN_DETAIL_INLINE void agent_round::watch_peers(agent_store& store) {
  store.beat();
  const auto silent =
      beats_.check(store.client(), settings_.node_rank, settings_.heartbeat_timeout);
  if (!silent) return;
  store.lose_nodes(beats_.silent());
  // Elastic: the round ends, and the next one is formed of the nodes present.
  store.record_failure(
      settings_.restart, 1, !settings_.elastic,
      "node " + std::to_string(*silent) + "'s agent stopped responding: no heartbeat for " +
          seconds_text(settings_.heartbeat_timeout) + " s (DTRAIN_HEARTBEAT_TIMEOUT)");
}

DTRAIN_DETAIL_INLINE void agent_round::watch_joiners(agent_store& store) {
  if (!settings_.elastic || settings_.node_rank != 0 ||
      settings_.members.size() >= static_cast<std::size_t>(settings_.nnodes)) {
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (now - last_join_check_ < std::chrono::seconds(1)) return;
  last_join_check_ = now;
  if (!store.node_waiting(settings_.restart)) return;
  failure_record regroup{0, false,
                         "a node is ready to join: every node stops its workers, "
                         "and the next round is formed with it (no restart counted)"};
  regroup.regroup = true;
  detail::record_failure(store.client(), settings_.restart, regroup);
}

DTRAIN_DETAIL_INLINE std::optional<round_end> agent_round::on_signal(agent_store& store) {
  const int sig = pending_agent_signal();
  if (sig == 0) return std::nullopt;
  const std::string message = "node " + std::to_string(settings_.node_rank) +
                              "'s agent received signal " + std::to_string(sig) +
                              " and stopped its workers";
  stop(sig);
  try {
    store.record_failure(settings_.restart, 128 + sig, true, message);
  } catch (const rendezvous_error&) {
    // Node 0 is gone: nobody is left to tell.
  }
  return round_end{false, 128 + sig, true, false, message};
}

DTRAIN_DETAIL_INLINE void agent_round::forward_diagnostics_requests() {
  if (!take_diagnostics_request()) return;
  for (const worker_process& w : workers_) {
    if (!w.status) (void)::kill(w.pid, SIGUSR1);  // the worker only, not what it started
  }
  say("forwarded SIGUSR1 to the workers: each prints its part of the desync diagnostics");
}

DTRAIN_DETAIL_INLINE void agent_round::note_exits(agent_store& store) {
  for (const worker_process* w : reap_exited(workers_, agent_poll_interval)) {
    if (*w->status == 0) continue;
    store.record_failure(settings_.restart, exit_code_of(*w->status), false,
                         worker_label(w->rank, settings_.node_rank, w->local_rank, w->pid) + " " +
                             describe_wait_status(*w->status));
    break;
  }
}

DTRAIN_DETAIL_INLINE std::optional<round_end> agent_round::on_failure(agent_store& store) {
  const auto failure = store.failure(settings_.restart);
  if (!failure) return std::nullopt;
  stop(SIGTERM);
  return round_end{false, failure->status, failure->final, failure->regroup, failure->message};
}

DTRAIN_DETAIL_INLINE std::optional<round_end> agent_round::on_success(agent_store& store) {
  const bool all_done = std::all_of(workers_.begin(), workers_.end(),
                                    [](const worker_process& w) { return w.status.has_value(); });
  if (!all_done) return std::nullopt;
  if (!reported_success_) {
    store.report_success(settings_.restart);
    reported_success_ = true;
  }
  if (store.all_succeeded(settings_.restart)) {
    stop(0);  // what the workers left running
    return round_end{true, 0, false, false, {}};
  }
  std::this_thread::sleep_for(agent_poll_interval);
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE void agent_round::stop(int sig) {
  if (state_ == state::stopping || state_ == state::ended) return;
  state_ = state::stopping;
  if (sig != 0) stop_workers(workers_, sig, settings_.grace_period);
  kill_leftovers(workers_, settings_.grace_period);
  relay_.finish(std::chrono::milliseconds(200));
  state_ = state::ended;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
