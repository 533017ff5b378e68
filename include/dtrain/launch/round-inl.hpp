#pragma once
/// @file
/// The non-template bodies of dtrain/launch/round.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/round.hpp, not this file.

#include <dtrain/launch/round.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE void agent_say(int node_rank, int nnodes, const std::string& text) {
  std::fprintf(stderr, "[dtrain agent node %d/%d] %s\n", node_rank, nnodes, text.c_str());
  std::fflush(stderr);
}

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
  const auto now = std::chrono::steady_clock::now();
  // Before anything else after a silence: an agent frozen for long enough
  // that another took its place must not beat, or act, as this node.
  if (now - last_place_check_ >= std::chrono::seconds(1)) {
    last_place_check_ = now;
    store.check_place();
  }
  store.beat();
  if (peer_lost_) return;
  // Elastic: the round ends, and the next one is formed of the nodes present.
  if (now - last_lease_check_ >= std::chrono::milliseconds(100)) {
    last_lease_check_ = now;
    const std::vector<int> gone = store.gone_nodes(settings_.members);
    // An agent leaves once every node's workers succeeded: then it is done, not lost.
    if (!gone.empty() && !store.all_succeeded(settings_.restart)) {
      peer_lost_ = true;
      lost_ = gone;
      store.lose_nodes(static_cast<int>(gone.size()));
      // Restartable: an elastic job goes on without it; a fixed-size one
      // waits for an agent that takes its place (a replacement node).
      store.record_failure(settings_.restart, 1, false,
                           "node " + std::to_string(gone.front()) +
                               "'s agent is gone: its connection to the store closed (the "
                               "agent was killed, or its host went away)");
      return;
    }
  }
  const auto silent =
      beats_.check(store.client(), settings_.node_rank, settings_.heartbeat_timeout);
  if (!silent) return;
  peer_lost_ = true;
  lost_ = beats_.silent();
  store.lose_nodes(static_cast<int>(lost_.size()));
  store.report_silent(settings_.restart, lost_);  // before the failure: others read it after
  store.record_failure(
      settings_.restart, 1, false,
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
  // Failed while this agent was silent, maybe: and another took its place.
  store.check_place();
  // The nodes another agent found silent first: lost here too (named in the
  // call for a replacement; node 0 does not wait for them to leave).
  std::vector<int> silent = store.silent_nodes(settings_.restart, settings_.members);
  std::erase(silent, settings_.node_rank);
  for (const int n : silent) {
    if (std::find(lost_.begin(), lost_.end(), n) == lost_.end()) lost_.push_back(n);
  }
  std::sort(lost_.begin(), lost_.end());
  if (!silent.empty()) store.lose_nodes(static_cast<int>(lost_.size()));
  stop(SIGTERM);
  return round_end{false, failure->status, failure->final, failure->regroup, failure->message,
                   lost_};
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

}  // namespace dtrain::detail
