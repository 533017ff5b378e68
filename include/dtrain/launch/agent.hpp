#pragma once
/// @file
/// node_agent: the per-node launcher (launch::per_node, dtrun). It starts the
/// node's workers with torchrun's environment, hosts the rendezvous store on
/// node 0, supervises the workers, stops the whole job on the first failure
/// (on every node), restarts it up to a limit, and forwards signals.

#include <dtrain/detail/sys.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/process.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/server.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain {

namespace detail {

inline volatile std::sig_atomic_t agent_signal = 0;

inline void record_agent_signal(int sig) { agent_signal = sig; }

/// SIGUSR1s the agent received and has not forwarded yet: they ask the
/// workers for desync diagnostics and stop nothing.
inline volatile std::sig_atomic_t agent_diagnostics_requests = 0;

inline void record_diagnostics_request(int) { agent_diagnostics_requests = 1; }

/// Catches SIGINT, SIGTERM and SIGHUP while the agent runs, so it can forward
/// them to the workers, and SIGUSR1, which it forwards without stopping them
/// (desync diagnostics); restores the previous handlers afterwards.
class agent_signal_scope {
 public:
  agent_signal_scope() {
    agent_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = record_agent_signal;
    sigemptyset(&sa.sa_mask);
    for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &sa, &previous_[i]);
    agent_diagnostics_requests = 0;
    sa.sa_handler = record_diagnostics_request;
    ::sigaction(SIGUSR1, &sa, &previous_usr1_);
  }
  agent_signal_scope(const agent_signal_scope&) = delete;
  agent_signal_scope& operator=(const agent_signal_scope&) = delete;
  ~agent_signal_scope() {
    for (std::size_t i = 0; i < signals.size(); ++i)
      ::sigaction(signals[i], &previous_[i], nullptr);
    ::sigaction(SIGUSR1, &previous_usr1_, nullptr);
  }
  static constexpr std::array<int, 3> signals{SIGINT, SIGTERM, SIGHUP};

 private:
  std::array<struct sigaction, 3> previous_{};
  struct sigaction previous_usr1_ {};
};

/// A port nobody listens on now (it may be taken before it is used: the
/// same race torchrun accepts for --standalone).
inline int pick_free_port() {
  unique_fd fd(DTRAIN_SYSCALL(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  DTRAIN_SYSCALL(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr));
  DTRAIN_SYSCALL(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len));
  return ntohs(addr.sin_port);
}

/// How a restart round ended.
struct round_end {
  bool succeeded = false;
  int status = 0;       ///< exit status for the agent when the job ends here
  bool final = false;   ///< no restart: a signal or a lost peer ended the job
  std::string message;  ///< who failed how
};

/// "2" for 2 s, "0.5" for 500 ms: a duration as a user would have written it.
inline std::string seconds_text(std::chrono::milliseconds t) {
  std::string text = std::to_string(t.count() / 1000);
  if (auto ms = t.count() % 1000; ms != 0) {
    std::string frac = std::to_string(1000 + ms).substr(1);
    while (frac.back() == '0') frac.pop_back();
    text += "." + frac;
  }
  return text;
}

}  // namespace detail

/// The agent of one node. run() starts `nproc_per_node` workers running
/// `command`, and returns the exit status the agent should exit with: 0 when
/// every worker of every node succeeded, else the failing worker's status
/// (128 + signal for a killed one). Throws config_error on bad options.
///
/// Each worker gets torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
/// ROLE_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, plus
/// DTRAIN_RESTART_COUNT and DTRAIN_AGENT_STORE. MASTER_PORT is a port that
/// node 0's agent picks for the workers in each round (a PyTorch worker's
/// rank 0 binds its own store there); dtrain workers meet at the agent's
/// store instead, which outlives restarts.
class node_agent {
 public:
  /// `command` is the worker's argv; `env` the environment the workers
  /// inherit (and where NODE_RANK, MASTER_ADDR, ... are read); `options` are
  /// final (apply with_env() before).
  node_agent(std::vector<std::string> command, agent_options options,
             environment env = environment::from_process(), store_options store = {})
      : command_(std::move(command)),
        options_(std::move(options)),
        env_(std::move(env)),
        store_options_(std::move(store)) {
    if (command_.empty()) throw config_error("node_agent: no worker command to run");
    options_.check();
    node_ = discover_world(env_, {},
                           discover_options{.mode = launch_mode::per_node,
                                            .nproc_per_node = options_.nproc_per_node.value_or(1),
                                            .nnodes = options_.nnodes,
                                            .node_rank = options_.node_rank});
    if (!node_.node_rank || !node_.num_nodes) {
      throw config_error(
          "the node agent cannot tell which node it is: give node_rank and nnodes "
          "(--node-rank, --nnodes; NODE_RANK) or start one agent per node with "
          "mpirun or srun");
    }
    nproc_ = *node_.local_world_size;
    const bool single = *node_.num_nodes == 1;
    if (options_.master_addr) {
      master_addr_ = *options_.master_addr;
    } else if (node_.master_addr) {
      master_addr_ = *node_.master_addr;
    } else if (single) {
      master_addr_ = "127.0.0.1";
    } else {
      throw config_error("a job of " + std::to_string(*node_.num_nodes) +
                         " nodes needs the address of node 0: set MASTER_ADDR or --master-addr");
    }
    if (options_.master_port) {
      master_port_ = *options_.master_port;
    } else if (node_.master_port) {
      master_port_ = *node_.master_port;
    } else {
      master_port_ = single ? 0 : default_master_port;
    }
    if (master_port_ == 0 && !single) {
      throw config_error(
          "master_port 0 (a free port) works only on a single node: the other "
          "nodes cannot learn which port node 0 picked; give --master-port or MASTER_PORT");
    }
  }

  /// The node as the agent sees it (node_rank, num_nodes, nproc as local_world_size).
  [[nodiscard]] const world& node() const noexcept { return node_; }

  /// Runs the job to the end; see the class comment for the exit status.
  int run() {
    if (store_options_.token.empty()) {
      // One node: a fresh token, which reaches the workers only through their
      // environment. Several: the agents must already share one.
      if (nnodes() > 1) {
        throw config_error(
            "a job of " + std::to_string(nnodes()) +
            " nodes needs DTRAIN_STORE_TOKEN: the same secret in every node agent's environment "
            "(e.g. `export DTRAIN_STORE_TOKEN=$(openssl rand -hex 16)` where the job is "
            "submitted); it authenticates every connection to node 0's store");
      }
      store_options_.token = detail::new_store_token();
    }
    detail::agent_signal_scope signals;
    // Orphans of the workers come to this agent, and the warden takes the
    // workers' groups down with it if it is SIGKILLed. The warden is forked
    // first, before the store or the relay start a thread.
    detail::become_subreaper();
    detail::worker_warden warden(nproc_);
    warden_ = &warden;
    detail::output_relay relay(options_.tee, options_.log_dir);
    relay_ = &relay;
    std::optional<store_server> server;
    const std::string bind = detail::store_bind_address(env_, master_addr_, nnodes() > 1);
    if (node_rank() == 0) {
      server.emplace(bind, master_port_, store_options_);
      master_port_ = server->port();
    }
    store_client store(node_rank() == 0 ? detail::local_store_address(bind) : master_addr_,
                       master_port_, store_options_);
    say("node " + std::to_string(node_rank()) + " of " + std::to_string(nnodes()) + ", " +
            std::to_string(nproc_) + " workers, store at " +
            detail::endpoint_text(master_addr_, master_port_),
        true);
    int status = 1;
    try {
      join(store);
      for (int restart = 0;; ++restart) {
        round_ = restart;
        detail::round_end end = run_round(store, restart);
        if (end.succeeded) {
          status = 0;
          break;
        }
        if (end.final || restart >= options_.max_restarts) {
          say(end.message + "; ending the job" +
              (end.final ? std::string()
                         : " (restarts used: " + std::to_string(restart) + " of " +
                               std::to_string(options_.max_restarts) + ")"));
          status = end.status;
          break;
        }
        say(end.message + "; restarting every node's workers (restart " +
            std::to_string(restart + 1) + " of " + std::to_string(options_.max_restarts) + ")");
        meet(store, detail::agent_keys::stopped(restart), "every node to stop its workers");
      }
      leave(store, node_rank() == 0);
    } catch (const rendezvous_error& e) {
      stop(SIGTERM);
      say(std::string("lost the rendezvous store (node 0's agent) at ") +
          detail::endpoint_text(master_addr_, master_port_) + ": " + e.what());
      status = 1;
    } catch (...) {
      // A signal that interrupted a wait ends the job like one during the run.
      const int sig = detail::agent_signal;
      stop(sig != 0 ? sig : SIGTERM);
      std::string what = "received signal " + std::to_string(sig);
      status = 128 + sig;
      if (sig == 0) std::tie(status, what) = detail::current_failure();
      // Tell the other nodes, so that they end too instead of waiting for this one.
      try {
        detail::record_failure(store, round_, status, true,
                               "node " + std::to_string(node_rank()) + "'s agent failed: " + what);
        leave(store, node_rank() == 0);
      } catch (...) {
        // The store is gone too: the other agents notice that themselves.
      }
      relay.finish(std::chrono::milliseconds(200));
      if (sig == 0) throw;
      say(what + "; stopped this node's workers");
    }
    relay.finish(std::chrono::milliseconds(200));
    relay_ = nullptr;
    warden_ = nullptr;
    return status;
  }

 private:
  [[nodiscard]] int node_rank() const { return *node_.node_rank; }
  [[nodiscard]] int nnodes() const { return *node_.num_nodes; }

  void say(const std::string& text, bool verbose = false) const {
    if (verbose && !options_.tee) return;
    std::fprintf(stderr, "[dtrain agent node %d/%d] %s\n", node_rank(), nnodes(), text.c_str());
    std::fflush(stderr);
  }

  /// Waits, polling the store, until `done()`; a signal to the agent or the
  /// store timeout ends the wait with an exception.
  template <class Done>
  void wait_for(Done done, const std::string& what) {
    auto deadline = std::chrono::steady_clock::now() + store_options_.timeout;
    while (!done()) {
      if (detail::agent_signal != 0) {
        throw error("received signal " + std::to_string(detail::agent_signal) +
                    " while waiting for " + what);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw timeout_error("the node agent waited " +
                            std::to_string(store_options_.timeout.count() / 1000) + " s for " +
                            what + " (DTRAIN_STORE_TIMEOUT)");
      }
      std::this_thread::sleep_for(poll_interval);
    }
  }

  /// A barrier of all agents that a signal can interrupt.
  void meet(store_client& store, const std::string& key, const std::string& what) {
    store.add(key, 1);
    wait_for([&] { return store.add(key, 0) >= nnodes(); }, what);
  }

  /// Registers this node and checks that every node runs the same job shape.
  void join(store_client& store) {
    const detail::node_record me{nproc_, options_.max_restarts, detail::host_name().value_or("?"),
                                 ::getpid()};
    const std::string key = detail::agent_keys::node(node_rank());
    const std::string holder = store.compare_set(key, "", me.encode());
    if (holder != me.encode()) {
      throw config_error("node_rank " + std::to_string(node_rank()) +
                         " is taken twice: by the agent " +
                         detail::node_record::decode(key, holder).who() + " and by this one (" +
                         me.who() + "); give each agent its own --node-rank / NODE_RANK");
    }
    meet(store, std::string(detail::agent_keys::joined),
         "all " + std::to_string(nnodes()) + " node agents to join");
    for (int n = 0; n < nnodes(); ++n) {
      const std::string other_key = detail::agent_keys::node(n);
      const detail::node_record other =
          detail::node_record::decode(other_key, store.get(other_key));
      if (other.nproc != nproc_) {
        throw config_error("node " + std::to_string(n) + " (" + other.who() + ") runs " +
                           std::to_string(other.nproc) + " workers, this node " +
                           std::to_string(nproc_) +
                           "; every node must run the same nproc_per_node");
      }
      if (other.max_restarts != options_.max_restarts) {
        throw config_error("node " + std::to_string(n) + " (" + other.who() + ") allows " +
                           std::to_string(other.max_restarts) + " restarts, this node " +
                           std::to_string(options_.max_restarts) +
                           "; every node must use the same max_restarts");
      }
    }
  }

  /// Node 0 keeps the store up until every agent has read how the job ended.
  void leave(store_client& store, bool hosting) {
    const std::string key(detail::agent_keys::left);
    try {
      store.add(key, 1);
      if (!hosting) return;
      auto deadline =
          std::chrono::steady_clock::now() + options_.grace_period + std::chrono::seconds(10);
      while (store.add(key, 0) < nnodes() - lost_nodes_ &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(poll_interval);
      }
    } catch (const rendezvous_error&) {
      // The job has ended; a peer that cannot be told is not a new failure.
    }
  }

  std::vector<std::string> worker_environment(const world& w, int restart, int worker_port) const {
    auto vars = env_.vars();
    auto set = [&](std::string name, const std::string& value) {
      vars.insert_or_assign(std::move(name), value);
    };
    set("RANK", std::to_string(*w.rank));
    set("LOCAL_RANK", std::to_string(*w.local_rank));
    set("WORLD_SIZE", std::to_string(*w.world_size));
    set("LOCAL_WORLD_SIZE", std::to_string(nproc_));
    set("GROUP_RANK", std::to_string(node_rank()));
    set("GROUP_WORLD_SIZE", std::to_string(nnodes()));
    set("ROLE_RANK", std::to_string(*w.rank));
    set("ROLE_WORLD_SIZE", std::to_string(*w.world_size));
    set("ROLE_NAME", "default");
    set("NODE_RANK", std::to_string(node_rank()));
    set("MASTER_ADDR", master_addr_);
    set("MASTER_PORT", std::to_string(worker_port));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
    set(std::string(restart_count_variable), std::to_string(restart));
    set(std::string(agent_store_variable), detail::endpoint_text(master_addr_, master_port_));
    // The token goes in the environment only: never on argv or in a log.
    set(std::string(store_token_variable), store_options_.token);
    // As torchrun: one thread per worker unless the user chose, so N workers
    // do not each start one OpenMP thread per core.
    if (nproc_ > 1 && !vars.contains("OMP_NUM_THREADS")) set("OMP_NUM_THREADS", "1");
    std::vector<std::string> out;
    out.reserve(vars.size());
    for (const auto& [name, value] : vars) out.push_back(name + "=" + value);
    return out;
  }

  /// Starts this node's workers for one round and supervises them until the
  /// round ends on every node.
  detail::round_end run_round(store_client& store, int restart) {
    const std::string port_key = detail::agent_keys::worker_port(restart);
    if (node_rank() == 0) store.set(port_key, detail::encode_port(detail::pick_free_port()));
    wait_for([&] { return store.check(std::span<const std::string>(&port_key, 1)); },
             "node 0 to pick the workers' port");
    const int worker_port = detail::decode_port(port_key, store.get(port_key));

    const std::string program = detail::find_program(command_.front(), env_.get("PATH"));
    std::vector<int> ranks;
    for (int local = 0; local < nproc_; ++local) ranks.push_back(node_rank() * nproc_ + local);
    if (relay_->active()) relay_->open_logs(restart, ranks);
    workers_.clear();
    for (int local = 0; local < nproc_; ++local) {
      world w;
      w.rank = node_rank() * nproc_ + local;
      w.world_size = nnodes() * nproc_;
      w.local_rank = local;
      detail::worker_command cmd;
      cmd.argv = command_;
      cmd.argv.front() = program;
      if (options_.local_rank_arg)
        cmd.argv.insert(cmd.argv.begin() + 1, "--local_rank=" + std::to_string(local));
      cmd.env = worker_environment(w, restart, worker_port);
      detail::worker_process& p = workers_.emplace_back();
      p.rank = *w.rank;
      p.local_rank = local;
      p.pid = detail::spawn_worker(cmd, relay_->active() ? relay_ : nullptr, *w.rank);
      p.exit_fd = detail::open_exit_fd(p.pid);
      warden_->guard(local, p.pid);
    }
    return supervise(store, restart);
  }

  detail::round_end supervise(store_client& store, int restart) {
    const std::string failure_key = detail::agent_keys::failure(restart);
    const std::string success_key = detail::agent_keys::succeeded(restart);
    const std::span<const std::string> failure_keys(&failure_key, 1);
    bool reported_success = false;
    heartbeat beats(nnodes());
    while (true) {
      if (auto silent = beats.check(store, node_rank(), options_.heartbeat_timeout)) {
        lost_nodes_ = beats.silent();  // they will never leave(): node 0 must not wait for them
        std::string message =
            "node " + std::to_string(*silent) + "'s agent stopped responding: no heartbeat for " +
            detail::seconds_text(options_.heartbeat_timeout) + " s (DTRAIN_HEARTBEAT_TIMEOUT)";
        detail::record_failure(store, restart, 1, true, message);
      }
      if (int sig = detail::agent_signal; sig != 0) {
        std::string message = "node " + std::to_string(node_rank()) + "'s agent received signal " +
                              std::to_string(sig) + " and stopped its workers";
        stop(sig);
        try {
          detail::record_failure(store, restart, 128 + sig, true, message);
        } catch (const rendezvous_error&) {
          // Node 0 is gone: nobody is left to tell.
        }
        return {false, 128 + sig, true, message};
      }
      if (detail::agent_diagnostics_requests != 0) {
        detail::agent_diagnostics_requests = 0;
        for (const detail::worker_process& w : workers_) {
          if (!w.status) (void)::kill(w.pid, SIGUSR1);  // the worker only, not what it started
        }
        say("forwarded SIGUSR1 to the workers: each prints its part of the desync diagnostics");
      }
      for (detail::worker_process* w : detail::reap_exited(workers_, poll_interval)) {
        if (*w->status == 0) continue;
        // A dtrain worker records its own failure, with its reason, before it exits.
        std::string message = detail::worker_label(w->rank, node_rank(), w->local_rank, w->pid) +
                              " " + detail::describe_wait_status(*w->status);
        detail::record_failure(store, restart, detail::exit_code_of(*w->status), false, message);
        break;
      }
      if (store.check(failure_keys)) {
        detail::round_end end = read_failure(failure_key, store.get(failure_key));
        stop(SIGTERM);
        return end;
      }
      const bool all_done =
          std::all_of(workers_.begin(), workers_.end(),
                      [](const detail::worker_process& w) { return w.status.has_value(); });
      if (all_done && !reported_success) {
        store.add(success_key, 1);
        reported_success = true;
      }
      if (reported_success) {
        if (store.add(success_key, 0) >= nnodes()) {
          detail::kill_leftovers(workers_, options_.grace_period);  // what the workers left running
          return {true, 0, false, {}};
        }
        std::this_thread::sleep_for(poll_interval);
      }
    }
  }

  static detail::round_end read_failure(const std::string& key, const std::string& value) {
    try {
      const detail::failure_record f = detail::failure_record::decode(key, value);
      return {false, f.status, f.final, f.message};
    } catch (const rendezvous_error& e) {
      return {false, 1, true, e.what()};
    }
  }

  void stop(int sig) {
    detail::stop_workers(workers_, sig, options_.grace_period);
    detail::kill_leftovers(workers_, options_.grace_period);
  }

  /// Every agent bumps its counter about once a second and watches the
  /// others': a node whose agent died (and with it its workers) is noticed
  /// even while the other nodes' workers are busy computing.
  class heartbeat {
   public:
    explicit heartbeat(int nodes)
        : seen_(static_cast<std::size_t>(nodes), -1),
          since_(static_cast<std::size_t>(nodes), std::chrono::steady_clock::now()) {}

    /// Beats for `me`; returns the first node silent for longer than `limit`.
    std::optional<int> check(store_client& store, int me, std::chrono::milliseconds limit) {
      auto now = std::chrono::steady_clock::now();
      if (now - last_ < std::chrono::seconds(1)) return std::nullopt;
      last_ = now;
      store.add(key(me), 1);
      std::optional<int> first;
      silent_ = 0;
      for (int n = 0; n < static_cast<int>(seen_.size()); ++n) {
        if (n == me) continue;
        std::int64_t beat = store.add(key(n), 0);
        auto i = static_cast<std::size_t>(n);
        if (beat != seen_[i]) {
          seen_[i] = beat;
          since_[i] = now;
        } else if (now - since_[i] > limit) {
          if (!first) first = n;
          ++silent_;
        }
      }
      return first;
    }

    /// How many nodes the last check() found silent.
    [[nodiscard]] int silent() const noexcept { return silent_; }

   private:
    static std::string key(int node) { return detail::agent_keys::beat(node); }
    std::vector<std::int64_t> seen_;
    std::vector<std::chrono::steady_clock::time_point> since_;
    std::chrono::steady_clock::time_point last_{};
    int silent_ = 0;
  };

  static constexpr std::chrono::milliseconds poll_interval{20};

  std::vector<std::string> command_;
  agent_options options_;
  environment env_;
  store_options store_options_;
  world node_;
  int nproc_ = 1;
  std::string master_addr_;
  int master_port_ = 0;
  int round_ = 0;       // the restart round under way
  int lost_nodes_ = 0;  // agents found silent: node 0 does not wait for them to leave
  std::vector<detail::worker_process> workers_;
  detail::output_relay* relay_ = nullptr;
  detail::worker_warden* warden_ = nullptr;  // run()'s, while it runs
};

}  // namespace dtrain
