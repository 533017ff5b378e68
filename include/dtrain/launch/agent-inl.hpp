#pragma once
/// @file
/// The non-template bodies of dtrain/launch/agent.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/agent.hpp, not this file.

#include <dtrain/launch/agent.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE node_agent::node_agent(std::vector<std::string> command, agent_options options,
                                            environment env, store_options store)
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
        "the node agent cannot tell which node it is: give node_rank and nnodes (--node-rank, "
        "--nnodes; NODE_RANK) or start one agent per node with mpirun or srun");
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
        "master_port 0 (a free port) works only on a single node: "
        "the other nodes cannot learn which port node 0 picked; give --master-port or MASTER_PORT");
  }
}

DTRAIN_DETAIL_INLINE int node_agent::run() {
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
  // The memory tier's copies outlive the workers in this agent's directory,
  // unless the user chose one (the variable in the agent's environment).
  std::optional<detail::memory_directory> memory;
  if (!env_.get(memory_checkpoint_variable)) {
    memory.emplace(node_rank());
    memory_dir_ = memory->path();
  }
  // The metrics endpoint serves the files the workers write in a directory
  // of this agent's, unless the user chose one.
  std::optional<detail::memory_directory> metrics_files;
  std::optional<detail::metrics_endpoint> endpoint;
  if (options_.metrics_port) {
    if (auto dir = env_.get(metrics_dir_variable); dir && !dir->empty()) {
      metrics_dir_ = std::string(*dir);
    } else {
      metrics_dir_ = metrics_files.emplace(node_rank(), "metrics").path();
      if (metrics_dir_.empty()) {
        throw config_error(
            "--metrics-port: no directory for the workers' metrics files in "
            "/dev/shm or the temporary directory; set DTRAIN_METRICS_DIR");
      }
    }
    const std::string bind = std::string(env_.get(metrics_bind_variable).value_or("127.0.0.1"));
    endpoint.emplace(bind, *options_.metrics_port, metrics_dir_,
                     std::string(env_.get(metrics_token_variable).value_or("")));
    say("node " + std::to_string(node_rank()) + "'s workers' metrics at http://" +
        detail::endpoint_text(bind, endpoint->port()) + "/metrics" +
        (env_.get(metrics_token_variable) ? " (a token is needed)" : ""));
  }
  // Orphans of the workers come to this agent, which kills and reaps them.
  detail::become_subreaper();
  const std::string bind = detail::store_bind_address(env_, master_addr_, nnodes() > 1);
  std::optional<detail::agent_store> store;
  store.emplace(node_rank(), nnodes(), bind, master_addr_, master_port_, client_options());
  master_port_ = store->port();
  say("node " + std::to_string(node_rank()) + " of " + std::to_string(nnodes()) + ", " +
          std::to_string(nproc_) + " workers, store at " +
          detail::endpoint_text(master_addr_, master_port_),
      true);
  // Several nodes: this agent holds, in its memory, the 2 newest memory copies
  // of each worker of the node before it (their buddy), for a node that
  // replaces a lost one, or a round without it that re-cuts their shards;
  // the address goes into its node record, and to its own workers.
  std::optional<store_server> buddies;
  buddy_at_ = nnodes() > 1 ? serve_buddies(buddies) : std::string();
  int restart = 0;     // the round under way, for a failure outside it
  int comes_into = 0;  // the round this agent comes into (node_record::round)
  for (;;) {
    std::string lost;     // why node 0's store is gone, when this agent waits for a new one
    bool silent = false;  // it is there, but does not answer
    try {
      if (!store)
        store.emplace(node_rank(), nnodes(), bind, master_addr_, master_port_, client_options());
      const detail::node_record me{
          nproc_,     options_.max_restarts, detail::host_name().value_or("?"),
          ::getpid(), options_.rdzv_id,      buddy_at_,
          comes_into};
      if (elastic()) {
        store->join_elastic(me);
      } else {
        store->join(me);
      }
      const int status =
          elastic() ? run_elastic_rounds(*store, restart) : run_rounds(*store, restart);
      store->leave(options_.grace_period);
      return status;
    } catch (const detail::agent_replaced& e) {
      // The round (if one ran) stopped its workers while unwinding; the job is
      // the other agent's now: nothing goes to the store.
      say(e.what());
      return 1;
    } catch (const rendezvous_error& e) {
      // Node 0 serves the store itself: a failed call there is no lost store.
      if (!store || node_rank() == 0 || !store_lost(*store)) {
        say("lost the rendezvous store (node 0's agent) at " +
            detail::endpoint_text(master_addr_, master_port_) + ": " + e.what());
        return 1;
      }
      lost = e.what();
    } catch (const timeout_error& e) {
      // No reply from node 0's store within the heartbeat timeout
      // (client_options()): node 0's agent is frozen, or its host is gone
      // without closing its connections. Any other timeout (a wait for the
      // nodes, while the store answers) is this agent's failure.
      if (!store || node_rank() == 0 || !store_lost(*store)) return fail(store, restart);
      lost = std::string(e.what()) + " (DTRAIN_HEARTBEAT_TIMEOUT " +
             detail::seconds_text(options_.heartbeat_timeout) + " s)";
      silent = true;
    } catch (...) {
      return fail(store, restart);
    }
    // A restart, as any lost node is: in a fixed-size job the rounds count
    // them, in an elastic one the failures.
    if (const int used = elastic() ? failures_ : restart; used >= options_.max_restarts) {
      say("lost the rendezvous store (node 0's agent) at " +
          detail::endpoint_text(master_addr_, master_port_) + ": " + lost +
          "; no restart is left to wait for an agent to take node 0's place (restarts used: " +
          std::to_string(used) + " of " + std::to_string(options_.max_restarts) + ")");
      return 1;
    }
    // Node 0's agent is gone, and with it the store (a restart left): the
    // round under way has stopped this node's workers. The agent that takes
    // node 0's place serves a new store at the same address; this one joins
    // it, and the rounds go on from the one after its last (a fixed-size
    // job: join() takes the newest of the nodes' records; an elastic one:
    // join_elastic() raises the newest round, and node 0 forms the next).
    const std::uint64_t known = store->client().instance();
    store.reset();
    if (elastic()) ++failures_;
    if (const int status = await_new_store(lost, silent, restart, known); status != 0)
      return status;
    comes_into = restart + 1;
  }
}

DTRAIN_DETAIL_INLINE int node_agent::fail(std::optional<detail::agent_store>& store, int restart) {
  // The round (if one ran) has stopped its workers while unwinding. A
  // signal that interrupted a wait ends the job like one during the run.
  const int sig = detail::pending_agent_signal();
  auto [status, what] = sig != 0 ? std::pair(128 + sig, "received signal " + std::to_string(sig))
                                 : detail::current_failure();
  // Tell the other nodes, so that they end too instead of waiting for this one.
  try {
    if (store) {
      store->record_failure(restart, status, true,
                            "node " + std::to_string(node_rank()) + "'s agent failed: " + what);
      store->leave(options_.grace_period);
    }
  } catch (...) {
    // The store is gone too: the other agents notice that themselves.
  }
  if (sig == 0) throw;
  say(what + "; stopped this node's workers");
  return status;
}

DTRAIN_DETAIL_INLINE store_options node_agent::client_options() const {
  store_options options = store_options_;
  if (node_rank() != 0)
    options.io_timeout = std::min(options.io_timeout, options_.heartbeat_timeout);
  return options;
}

DTRAIN_DETAIL_INLINE store_options node_agent::probe_options() const {
  store_options probe = store_options_;
  probe.timeout = std::chrono::seconds(1);
  probe.progress_interval = std::chrono::milliseconds(0);
  return probe;
}

DTRAIN_DETAIL_INLINE bool node_agent::store_lost(detail::agent_store& store) const {
  try {
    const store_client now(master_addr_, master_port_, probe_options());
    return now.instance() != store.client().instance();
  } catch (const token_error&) {
    return false;  // a store answers there (with another token): not a lost one
  } catch (const error&) {
    return true;  // nothing answers there
  }
}

DTRAIN_DETAIL_INLINE int node_agent::await_new_store(const std::string& why, bool silent,
                                                     int restart, std::uint64_t known) {
  const std::string where = detail::endpoint_text(master_addr_, master_port_);
  say((silent ? "node 0's store at " + where + " does not answer (" + why +
                    "): node 0's agent is frozen, or its host is gone"
              : "node 0's agent is gone, and with it the store at " + where + " (" + why + ")") +
      ": this node's workers are stopped; waiting for an agent to take the place of node 0 "
      "(start one there or on another host with that address, with --node-rank 0)" +
      (silent ? ", or for node 0's to answer again" : "") +
      ", at most the store timeout (DTRAIN_STORE_TIMEOUT); the job then goes on with round " +
      std::to_string(restart + 1) + " (restart " +
      std::to_string(elastic() ? failures_ : restart + 1) + " of " +
      std::to_string(options_.max_restarts) + ")");
  const store_options probe = probe_options();
  const auto deadline = std::chrono::steady_clock::now() + store_options_.timeout;
  for (;;) {
    if (const int sig = detail::pending_agent_signal(); sig != 0) {
      say("received signal " + std::to_string(sig) +
          " while waiting for an agent to take the place of node 0; stopped this node's workers");
      return 128 + sig;
    }
    try {
      const store_client now(master_addr_, master_port_, probe);
      // A new store (or the old one, reachable again after all: this agent
      // then takes its own place back, as a replacement would).
      if (now.instance() != known) say("a new store answers at " + where + ": joining it", true);
      return 0;
    } catch (const token_error&) {
      throw;  // a store with another secret: not this job's
    } catch (const error&) {
      // Not up yet.
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw timeout_error("the node agent waited " +
                          std::to_string(store_options_.timeout.count() / 1000) +
                          " s for an agent to take the place of node 0 and serve the store at " +
                          where + " (DTRAIN_STORE_TIMEOUT)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

DTRAIN_DETAIL_INLINE detail::memory_directory::memory_directory(int node_rank,
                                                                std::string_view what) {
  const std::string prefix = "dtrain-" + std::string(what) + "-";
  std::error_code ec;
  std::vector<std::filesystem::path> places{"/dev/shm"};
  if (auto tmp = std::filesystem::temp_directory_path(ec); !ec) places.push_back(tmp);
  for (const std::filesystem::path& place : places) {
    // Those of agents that are gone: "dtrain-<what>-<pid>-node<N>-XXXXXX".
    for (std::filesystem::directory_iterator it(place, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string left = it->path().filename().string();
      if (!left.starts_with(prefix)) continue;
      const long pid = std::strtol(left.c_str() + prefix.size(), nullptr, 10);
      struct stat st {};
      if (pid <= 0 || ::lstat(it->path().c_str(), &st) != 0 || st.st_uid != ::getuid()) continue;
      if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        static_cast<void>(detail::remove_tree(it->path().c_str()));
      }
    }
    ec.clear();
    std::string name = (place / (prefix + std::to_string(::getpid()) + "-node" +
                                 std::to_string(node_rank) + "-XXXXXX"))
                           .string();
    if (::mkdtemp(name.data()) != nullptr) {  // mode 0700
      path_ = std::move(name);
      return;
    }
  }
}

DTRAIN_DETAIL_INLINE detail::memory_directory::~memory_directory() {
  if (!path_.empty()) static_cast<void>(detail::remove_tree(path_.c_str()));
}

DTRAIN_DETAIL_INLINE std::string node_agent::serve_buddies(std::optional<store_server>& server) {
  // On the address that reaches node 0's store: the other nodes reach it too.
  const detail::route_source route = detail::local_address_to(master_addr_, master_port_);
  const std::string lost = "; a lost node's per-rank state (a ZeRO shard) resumes from the disk";
  if (!route.error.empty()) {
    say("holds no memory copies for the node before it: no address of this host reaches "
        "node 0's store (" +
        route.error + ")" + lost);
    return {};
  }
  store_options options = store_options_;
  options.log = [this](std::string_view line) {
    say("memory copies' store: " + std::string(line), true);
  };
  try {
    server.emplace(route.address, 0, options);
  } catch (const std::exception& e) {
    say("holds no memory copies for the node before it: " + std::string(e.what()) + lost);
    return {};
  }
  const std::string at = detail::endpoint_text(route.address, server->port());
  say("holds the memory copies of the node before it at " + at, true);
  return at;
}

DTRAIN_DETAIL_INLINE void node_agent::say(const std::string& text, bool verbose) const {
  if (verbose && !options_.tee) return;
  detail::agent_say(node_rank(), nnodes(), text);
}

DTRAIN_DETAIL_INLINE bool node_agent::ends_job(const detail::round_end& end, int used) const {
  if (!end.final && used < options_.max_restarts) return false;
  say(end.message + "; ending the job" +
      (end.final ? std::string()
                 : " (restarts used: " + std::to_string(used) + " of " +
                       std::to_string(options_.max_restarts) + ")"));
  return true;
}

DTRAIN_DETAIL_INLINE int node_agent::run_rounds(detail::agent_store& store, int& restart) {
  const std::vector<int> everyone = store.all_nodes();
  // 0, unless this store is that of an agent that took node 0's place: the
  // job goes on with the round after the one the other nodes ran.
  restart = store.resume_round();
  if (restart > 0 && node_rank() == 0) {
    say("takes the place of node 0's agent, which is gone (with its store): the other nodes' "
        "agents came back from round " +
        std::to_string(restart - 1) + ", and the job goes on with round " +
        std::to_string(restart) + " (restart " + std::to_string(restart) + " of " +
        std::to_string(options_.max_restarts) + ")");
  }
  if (store.replacing()) {
    // This agent takes the place of one that is gone: it comes into the
    // job when the round under way, which had that agent's workers, ends.
    if (const int under_way = store.first_round() - 1; under_way >= 0) {
      say("takes the place of node " + std::to_string(node_rank()) +
          "'s agent, which is gone: waiting for round " + std::to_string(under_way) + " to end");
      std::optional<detail::failure_record> ended;
      store.wait_for([&] { return (ended = store.failure(under_way)).has_value(); },
                     "round " + std::to_string(under_way) + " to end");
      const detail::failure_record& f = *ended;
      if (ends_job({false, f.status, f.final, false, f.message}, under_way)) return f.status;
      store.meet(detail::agent_keys::stopped(under_way), "every node to stop its workers");
      restart = under_way + 1;
    }
  }
  for (;; ++restart) {
    if (node_rank() == 0) store.start_round(restart);
    const detail::round_end end = run_round(store, restart, everyone);
    if (end.succeeded) return 0;
    if (ends_job(end, restart)) return end.status;
    say(end.message + "; restarting every node's workers (restart " + std::to_string(restart + 1) +
        " of " + std::to_string(options_.max_restarts) + ")");
    // Those whose agents are gone, and those this agent found silent (a
    // frozen agent keeps its connection open: unless it wakes, a replacement).
    std::vector<int> lost = store.gone_nodes(everyone);
    lost.insert(lost.end(), end.lost.begin(), end.lost.end());
    std::sort(lost.begin(), lost.end());
    lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
    std::string gone;
    for (const int n : lost) gone += (gone.empty() ? "" : ", ") + std::to_string(n);
    if (!gone.empty()) {
      // A fixed-size job needs every node: a replacement takes the lost one's place.
      say("waiting for an agent to take the place of node " + gone +
          " (start one there or on another host, with --node-rank " + gone +
          "), at most the store timeout (DTRAIN_STORE_TIMEOUT)");
    }
    store.meet(detail::agent_keys::stopped(restart),
               gone.empty() ? "every node to stop its workers"
                            : "an agent to take the place of node " + gone);
    store.lose_nodes(0);  // every node met: none is lost now
  }
}

DTRAIN_DETAIL_INLINE int node_agent::run_elastic_rounds(detail::agent_store& store, int& restart) {
  // How long node 0 waits, once enough nodes are ready, for the others.
  constexpr std::chrono::milliseconds last_call{2000};
  for (restart = store.first_round();; ++restart) {
    const int asked = restart;
    const std::vector<int> members = store.form_round(restart, *options_.min_nnodes, last_call);
    if (members.empty()) {
      // Node 0 went on with a later round, which another agent asked for.
      restart = store.first_round() - 1;
      continue;
    }
    if (restart > asked && node_rank() == 0) {
      say("the other nodes' agents came back from round " + std::to_string(restart - 1) +
          " (node 0's agent, and its store, were replaced): the rounds go on from there");
    }
    std::string names;
    for (const int n : members) names += (names.empty() ? "" : ", ") + std::to_string(n);
    if (std::find(members.begin(), members.end(), node_rank()) == members.end()) {
      say("round " + std::to_string(restart) + " was formed of nodes " + names +
          " before this one was ready: joining the next");
      continue;
    }
    std::string passed;
    for (const int n : store.passed_over())
      passed += (passed.empty() ? "" : ", ") + std::to_string(n);
    say("round " + std::to_string(restart) + ": nodes " + names + " (" +
        std::to_string(members.size()) + " of at most " + std::to_string(nnodes()) + "), " +
        std::to_string(members.size() * static_cast<std::size_t>(nproc_)) + " workers" +
        (passed.empty() ? std::string()
                        : "; formed without waiting for node" +
                              std::string(store.passed_over().size() == 1 ? " " : "s ") + passed +
                              " (agent gone)"));
    const detail::round_end end = run_round(store, restart, members);
    if (end.succeeded) return 0;
    if (end.regroup) {
      say(end.message);
      continue;
    }
    if (ends_job(end, failures_)) return end.status;
    ++failures_;
    say(end.message + "; forming the next round of the nodes present (restart " +
        std::to_string(failures_) + " of " + std::to_string(options_.max_restarts) + ")");
  }
}

DTRAIN_DETAIL_INLINE detail::round_end node_agent::run_round(detail::agent_store& store,
                                                             int restart,
                                                             const std::vector<int>& members) {
  // An agent that was frozen in a wait may have been replaced meanwhile.
  store.check_place();
  const int group =
      static_cast<int>(std::find(members.begin(), members.end(), node_rank()) - members.begin());
  const int groups = static_cast<int>(members.size());
  const int worker_port = store.worker_port(restart);
  // The workers' buddy: the next node of the round (a ring), whose agent
  // holds their memory copies of per-rank state.
  std::string buddy;
  if (groups > 1) {
    const int next = members[static_cast<std::size_t>((group + 1) % groups)];
    buddy = store.record(next).buddy;
    if (buddy.empty()) {
      say("node " + std::to_string(next) +
              "'s agent holds no memory copies (it said why): a loss of this node resumes its "
              "per-rank state from the disk",
          true);
    }
  }
  const std::string program = detail::find_program(command_.front(), env_.get("PATH"));
  std::vector<detail::worker_start> workers;
  for (int local = 0; local < nproc_; ++local) {
    detail::worker_start& w = workers.emplace_back();
    w.rank = group * nproc_ + local;
    w.local_rank = local;
    w.command.argv = command_;
    w.command.argv.front() = program;
    if (options_.local_rank_arg)
      w.command.argv.insert(w.command.argv.begin() + 1, "--local_rank=" + std::to_string(local));
    w.command.env = worker_environment(w.rank, local, restart, worker_port, group, groups, buddy);
  }
  detail::agent_round round({.restart = restart,
                             .node_rank = node_rank(),
                             .nnodes = nnodes(),
                             .nproc = nproc_,
                             .members = members,
                             .elastic = elastic(),
                             .tee = options_.tee,
                             .log_dir = options_.log_dir,
                             .grace_period = options_.grace_period,
                             .heartbeat_timeout = options_.heartbeat_timeout});
  round.start(workers);
  return round.supervise(store);
}

DTRAIN_DETAIL_INLINE std::vector<std::string> node_agent::worker_environment(
    int rank, int local_rank, int restart, int worker_port, int group, int groups,
    const std::string& buddy) const {
  const int world_size = groups * nproc_;
  auto vars = env_.vars();
  auto set = [&](std::string name, const std::string& value) {
    vars.insert_or_assign(std::move(name), value);
  };
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(world_size));
  set("LOCAL_WORLD_SIZE", std::to_string(nproc_));
  set("GROUP_RANK", std::to_string(group));
  set("GROUP_WORLD_SIZE", std::to_string(groups));
  set("ROLE_RANK", std::to_string(rank));
  set("ROLE_WORLD_SIZE", std::to_string(world_size));
  set("ROLE_NAME", "default");
  set("NODE_RANK", std::to_string(group));
  set("MASTER_ADDR", master_addr_);
  set("MASTER_PORT", std::to_string(worker_port));
  // The agent's store is the workers' master: Azure ML's own names for the job's
  // master (inherited from a dtrun that an MPI job started) would contradict it.
  vars.erase("AZ_BATCH_MASTER_NODE");
  vars.erase("AZ_BATCHAI_MPI_MASTER_NODE");
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
  if (!options_.rdzv_id.empty()) set("TORCHELASTIC_RUN_ID", options_.rdzv_id);
  set(std::string(restart_count_variable), std::to_string(restart));
  if (!memory_dir_.empty()) set(std::string(memory_checkpoint_variable), memory_dir_);
  if (!buddy.empty() && !env_.get(memory_buddy_variable))
    set(std::string(memory_buddy_variable), buddy);
  if (!buddy_at_.empty() && !env_.get(memory_held_variable))
    set(std::string(memory_held_variable), buddy_at_);
  set(std::string(agent_store_variable), detail::endpoint_text(master_addr_, master_port_));
  if (!metrics_dir_.empty()) set(std::string(metrics_dir_variable), metrics_dir_);
  // With logs, each restart's directory also takes the ranks' flight records
  // (dtrun --flight-records <log_dir>/restart_<k>), unless the user chose a place.
  if (!options_.log_dir.empty() && !env_.get(diagnostics_dir_variable)) {
    set(std::string(diagnostics_dir_variable),
        (std::filesystem::path(options_.log_dir) / ("restart_" + std::to_string(restart)))
            .string());
  }
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

}  // namespace dtrain
