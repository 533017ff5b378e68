#pragma once
/// @file
/// The node agents' side of the job's store: node 0's agent serves it, every
/// agent joins it, meets the others there between restart rounds, beats its
/// heartbeat, records and reads how a round failed (naming the worker that
/// went wrong), and leaves. The keys and the format of their values are
/// launch/protocol.hpp's.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/launch/signals.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/server.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>

namespace dtrain::detail {

/// How often an agent looks at its workers and the store while it waits.
inline constexpr std::chrono::milliseconds agent_poll_interval{20};

/// A port nobody listens on now (it may be taken before it is used: the
/// same race torchrun accepts for --standalone).
DTRAIN_DETAIL_INLINE int pick_free_port();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int pick_free_port() {
  unique_fd fd(DTRAIN_SYSCALL(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  DTRAIN_SYSCALL(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr));
  DTRAIN_SYSCALL(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len));
  return ntohs(addr.sin_port);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// "2" for 2 s, "0.5" for 500 ms: a duration as a user would have written it.
DTRAIN_DETAIL_INLINE std::string seconds_text(std::chrono::milliseconds t);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string seconds_text(std::chrono::milliseconds t) {
  std::string text = std::to_string(t.count() / 1000);
  if (auto ms = t.count() % 1000; ms != 0) {
    std::string frac = std::to_string(1000 + ms).substr(1);
    while (frac.back() == '0') frac.pop_back();
    text += "." + frac;
  }
  return text;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The agents' summary of a round's first failure. When the failing worker
/// gave up a collective that a worker which had already ended well never
/// issued, that worker comes first: it left early (it skipped a step, say),
/// and the failure is the consequence.
DTRAIN_DETAIL_INLINE std::string describe_failure(const failure_record& failure,
                                                  const std::optional<exit_record>& first_exit);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe_failure(const failure_record& failure,
                                                  const std::optional<exit_record>& first_exit) {
  if (!first_exit || failure.rank < 0 || failure.collective <= 0 ||
      first_exit->rank == failure.rank) {
    return failure.message;
  }
  const std::int64_t issued = first_exit->issued_on(failure.communicator);
  if (issued >= failure.collective) return failure.message;
  return first_exit->label + " exited with status 0 after " + std::to_string(issued) +
         " collective" + (issued == 1 ? "" : "s") +
         (failure.communicator == "world" ? "" : " on communicator " + failure.communicator) +
         " while rank " + std::to_string(failure.rank) + " waited in collective #" +
         std::to_string(failure.collective) + "; then " + failure.message;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Every agent bumps its counter about once a second and watches the
/// others': a node whose agent died (and with it its workers) is noticed
/// even while the other nodes' workers are busy computing.
class heartbeat {
 public:
  /// Watches `nodes` (node ranks; this agent's own is skipped).
  explicit heartbeat(std::vector<int> nodes)
      : nodes_(std::move(nodes)),
        seen_(nodes_.size(), -1),
        since_(nodes_.size(), std::chrono::steady_clock::now()) {}

  /// About once a second, reads the others' beats (this agent beats its own
  /// through agent_store::beat()); returns the first node silent for longer than `limit`.
  std::optional<int> check(store_client& store, int me, std::chrono::milliseconds limit);

  /// How many nodes the last check() found silent.
  [[nodiscard]] int silent() const noexcept { return silent_; }

 private:
  std::vector<int> nodes_;
  std::vector<std::int64_t> seen_;
  std::vector<std::chrono::steady_clock::time_point> since_;
  std::chrono::steady_clock::time_point last_{};
  int silent_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<int> heartbeat::check(store_client& store, int me,
                                                         std::chrono::milliseconds limit) {
  auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::seconds(1)) return std::nullopt;
  last_ = now;
  std::optional<int> first;
  silent_ = 0;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const int n = nodes_[i];
    if (n == me) continue;
    std::int64_t beat = store.add(agent_keys::beat(n), 0);
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
#endif  // DTRAIN_DETAIL_BODIES()

/// One agent's connection to the job's store, which node 0's agent also
/// serves. Every wait is bounded by the store timeout and ends early when a
/// signal asks the agent to stop. Store operations throw rendezvous_error
/// when the store is gone.
class agent_store {
 public:
  /// Node 0 serves the store on `bind`:`port` (0: a free port) and connects
  /// to it; the other nodes connect to `master_addr`:`port`.
  agent_store(int node_rank, int nnodes, const std::string& bind, const std::string& master_addr,
              int port, const store_options& options)
      : node_rank_(node_rank),
        nnodes_(nnodes),
        round_size_(nnodes),
        timeout_(options.timeout),
        server_(node_rank == 0 ? std::optional<store_server>(std::in_place, bind, port, options)
                               : std::nullopt),
        port_(server_ ? server_->port() : port),
        client_(node_rank == 0 ? local_store_address(bind) : master_addr, port_, options) {}
  agent_store(const agent_store&) = delete;
  agent_store& operator=(const agent_store&) = delete;

  /// The port of the store (node 0's choice when it was 0).
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] store_client& client() noexcept { return client_; }

  /// Waits, polling, until `done()`; throws error when a signal asks the
  /// agent to stop, timeout_error after the store timeout.
  template <class Done>
  void wait_for(Done done, const std::string& what) {
    if (!poll_until(std::chrono::steady_clock::now() + timeout_, done, what)) {
      throw timeout_error("the node agent waited " + std::to_string(timeout_.count() / 1000) +
                          " s for " + what + " (DTRAIN_STORE_TIMEOUT)");
    }
  }

  /// Polls `done()` until it holds (true) or `until` passes (false), beating
  /// this node's heartbeat meanwhile (a waiting agent is alive too) unless
  /// `beat` is false; throws error when a signal asks the agent to stop.
  template <class Done>
  bool poll_until(std::chrono::steady_clock::time_point until, Done done, const std::string& what,
                  bool beat = true) {
    while (!done()) {
      if (beat) this->beat();
      if (const int sig = pending_agent_signal(); sig != 0) {
        throw error("received signal " + std::to_string(sig) + " while waiting for " + what);
      }
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(agent_poll_interval);
    }
    return true;
  }

  /// Beats this node's heartbeat (agent_keys::beat) if a second has passed
  /// since it last did: the agents watch each other's (class heartbeat).
  void beat() {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_beat_ < std::chrono::seconds(1)) return;
    last_beat_ = now;
    client_.add(agent_keys::beat(node_rank_), 1);
  }

  /// A barrier of all agents that a signal can interrupt.
  void meet(const std::string& key, const std::string& what);

  /// Registers this node, waits for every node, and checks that they all
  /// run the same job shape (config_error naming the node that differs).
  void join(const node_record& me);

  /// The MASTER_PORT of round `restart`'s workers: node 0 picks a free port,
  /// every node reads it.
  int worker_port(int restart);

  /// Records a failure of round `restart` unless one is recorded already.
  void record_failure(int restart, int status, bool final, const std::string& message) {
    detail::record_failure(client_, restart, {status, final, message});
  }

  /// Round `restart`'s first failure, if one is recorded, with its message
  /// as the agents print it (describe_failure). A record that cannot be read
  /// ends the job with its own reason.
  std::optional<failure_record> failure(int restart);

  /// Reports that this node's workers of round `restart` all succeeded.
  void report_success(int restart) { client_.add(agent_keys::succeeded(restart), 1); }
  /// Whether every node reported success for round `restart`.
  [[nodiscard]] bool all_succeeded(int restart) {
    return client_.add(agent_keys::succeeded(restart), 0) >= round_size_;
  }

  /// Nodes found silent (their agents will never leave()): node 0 does not wait for them.
  void lose_nodes(int nodes) noexcept { lost_nodes_ = nodes; }

  // ---- elastic jobs (dtrun --nnodes MIN:MAX) ----------------------------

  /// Registers this node without waiting for the others (a node may come
  /// and go), after checking that it runs the job's shape (node 0's record;
  /// config_error naming what differs). A node that comes back takes its old
  /// place once the agent that held it is found silent for `window` (its
  /// heartbeat, which every agent beats while it waits or runs a round); an
  /// agent still beating holds it, and this one is refused by name.
  void join_elastic(const node_record& me,
                    std::chrono::milliseconds window = std::chrono::milliseconds(2500));

  /// The round a node that starts now joins: the one after the newest round
  /// formed, or round 0.
  int first_round();

  /// Says that this node is ready for round `restart` and returns the
  /// round's nodes (ascending), which node 0 chooses: once at least
  /// `min_nodes` are ready, every node ready within `last_call` after that
  /// (at once when all nnodes are). Every agent counts the round's nodes from
  /// then on (success, leaving). A node not among them joins a later round.
  std::vector<int> form_round(int restart, int min_nodes, std::chrono::milliseconds last_call);

  /// Whether a node is ready for the round after `restart`: one waits to join.
  [[nodiscard]] bool node_waiting(int restart) {
    return client_.add(agent_keys::ready(restart + 1), 0) > 0;
  }

  /// Says this agent is done. Node 0 keeps the store up until every agent
  /// has read how the job ended, at most `grace` + 10 s.
  void leave(std::chrono::milliseconds grace);

 private:
  // config_error when node `n`'s record (`other`) runs another job shape than `me`.
  static void check_same_shape(int n, const node_record& other, const node_record& me);

  // The first worker of the round that ended well; a record that cannot be
  // read only loses that hint.
  std::optional<exit_record> first_exit(int restart);

  int node_rank_;
  int nnodes_;      // of the job (the most, in an elastic one)
  int round_size_;  // nodes of the round under way: nnodes_ unless elastic
  std::chrono::milliseconds timeout_;
  std::optional<store_server> server_;
  int port_;
  store_client client_;
  int lost_nodes_ = 0;
  std::chrono::steady_clock::time_point last_beat_{};
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void agent_store::meet(const std::string& key, const std::string& what) {
  client_.add(key, 1);
  wait_for([&] { return client_.add(key, 0) >= round_size_; }, what);
}

DTRAIN_DETAIL_INLINE void agent_store::join_elastic(const node_record& me,
                                                    std::chrono::milliseconds window) {
  if (node_rank_ != 0) {  // the job's shape first: a refused agent takes no place
    const std::string key = agent_keys::node(0);
    wait_for([&] { return client_.check(std::span<const std::string>(&key, 1)); },
             "node 0's agent to register");
    check_same_shape(0, node_record::decode(key, client_.get(key)), me);
  }
  const std::string mine = agent_keys::node(node_rank_);
  const std::string holder = client_.compare_set(mine, "", me.encode());
  if (holder == me.encode()) return;
  // Held before: by an agent of this node that is gone (it comes back), or
  // by another agent started with this node rank, which still beats.
  const node_record other = node_record::decode(mine, holder);
  const std::string beats = agent_keys::beat(node_rank_);
  const std::int64_t before = client_.add(beats, 0);
  // Without beating: only the holder's beats may move the count.
  poll_until(
      std::chrono::steady_clock::now() + window, [] { return false; },
      "the agent that held node_rank " + std::to_string(node_rank_) + " to beat", false);
  if (client_.add(beats, 0) != before) {
    throw config_error("node_rank " + std::to_string(node_rank_) + " is held by the agent " +
                       other.who() + ", which is running, and this one (" + me.who() +
                       ") asks for it too; give each agent its own --node-rank / NODE_RANK");
  }
  client_.set(mine, me.encode());
}

DTRAIN_DETAIL_INLINE int agent_store::first_round() {
  const std::string key(agent_keys::current_round);
  if (!client_.check(std::span<const std::string>(&key, 1))) return 0;
  const std::int64_t newest = wire::decode_int("store key " + key, client_.get(key), "a round");
  if (newest < 0 || newest > INT32_MAX - 1) {
    throw rendezvous_error("store key " + key + " holds round " + std::to_string(newest));
  }
  return static_cast<int>(newest) + 1;
}

DTRAIN_DETAIL_INLINE std::vector<int> agent_store::form_round(int restart, int min_nodes,
                                                              std::chrono::milliseconds last_call) {
  client_.set(agent_keys::ready_node(restart, node_rank_), wire::encode_int(1));
  client_.add(agent_keys::ready(restart), 1);
  const std::string members_key = agent_keys::members(restart);
  const std::string round = "round " + std::to_string(restart);
  if (node_rank_ == 0) {
    auto ready = [&] { return client_.add(agent_keys::ready(restart), 0); };
    wait_for([&] { return ready() >= min_nodes; }, "at least " + std::to_string(min_nodes) +
                                                       " of " + std::to_string(nnodes_) +
                                                       " nodes to be ready for " + round);
    // The last call: a time-out here is no failure, the round is who came.
    static_cast<void>(poll_until(
        std::chrono::steady_clock::now() + last_call, [&] { return ready() >= nnodes_; },
        "the other nodes to be ready for " + round));
    std::vector<int> nodes;
    for (int n = 0; n < nnodes_; ++n) {
      const std::string key = agent_keys::ready_node(restart, n);
      if (client_.check(std::span<const std::string>(&key, 1))) nodes.push_back(n);
    }
    client_.set(members_key, encode_members(nodes));
    client_.set(std::string(agent_keys::current_round), wire::encode_int(restart));
  } else {
    wait_for([&] { return client_.check(std::span<const std::string>(&members_key, 1)); },
             "node 0 to form " + round);
  }
  std::vector<int> nodes = decode_members(members_key, client_.get(members_key), nnodes_);
  round_size_ = static_cast<int>(nodes.size());
  lost_nodes_ = 0;  // of an earlier round: not among these
  return nodes;
}

DTRAIN_DETAIL_INLINE void agent_store::join(const node_record& me) {
  const std::string key = agent_keys::node(node_rank_);
  const std::string holder = client_.compare_set(key, "", me.encode());
  if (holder != me.encode()) {
    throw config_error("node_rank " + std::to_string(node_rank_) +
                       " is taken twice: by the agent " + node_record::decode(key, holder).who() +
                       " and by this one (" + me.who() +
                       "); give each agent its own --node-rank / NODE_RANK");
  }
  meet(std::string(agent_keys::joined), "all " + std::to_string(nnodes_) + " node agents to join");
  for (int n = 0; n < nnodes_; ++n) {
    const std::string other_key = agent_keys::node(n);
    check_same_shape(n, node_record::decode(other_key, client_.get(other_key)), me);
  }
}

DTRAIN_DETAIL_INLINE void agent_store::check_same_shape(int n, const node_record& other,
                                                        const node_record& me) {
  if (other.nproc != me.nproc) {
    throw config_error("node " + std::to_string(n) + " (" + other.who() + ") runs " +
                       std::to_string(other.nproc) + " workers, this node " +
                       std::to_string(me.nproc) + "; every node must run the same nproc_per_node");
  }
  if (other.max_restarts != me.max_restarts) {
    throw config_error("node " + std::to_string(n) + " (" + other.who() + ") allows " +
                       std::to_string(other.max_restarts) + " restarts, this node " +
                       std::to_string(me.max_restarts) +
                       "; every node must use the same max_restarts");
  }
  if (other.rdzv_id != me.rdzv_id) {
    auto id = [](const std::string& v) { return v.empty() ? std::string("none") : v; };
    throw config_error("node " + std::to_string(n) + " (" + other.who() + ") has --rdzv-id " +
                       id(other.rdzv_id) + ", this node " + id(me.rdzv_id) +
                       "; every node of a job must give the same --rdzv-id (PET_RDZV_ID)");
  }
}

DTRAIN_DETAIL_INLINE int agent_store::worker_port(int restart) {
  const std::string key = agent_keys::worker_port(restart);
  if (node_rank_ == 0) client_.set(key, encode_port(pick_free_port()));
  wait_for([&] { return client_.check(std::span<const std::string>(&key, 1)); },
           "node 0 to pick the workers' port");
  return decode_port(key, client_.get(key));
}

DTRAIN_DETAIL_INLINE std::optional<failure_record> agent_store::failure(int restart) {
  const std::string key = agent_keys::failure(restart);
  if (!client_.check(std::span<const std::string>(&key, 1))) return std::nullopt;
  const std::string value = client_.get(key);
  failure_record f;
  try {
    f = failure_record::decode(key, value);
  } catch (const rendezvous_error& e) {
    return failure_record{1, true, e.what()};
  }
  f.message = describe_failure(f, first_exit(restart));
  return f;
}

DTRAIN_DETAIL_INLINE void agent_store::leave(std::chrono::milliseconds grace) {
  const std::string key(agent_keys::left);
  try {
    client_.add(key, 1);
    if (!server_) return;
    const auto deadline = std::chrono::steady_clock::now() + grace + std::chrono::seconds(10);
    while (client_.add(key, 0) < round_size_ - lost_nodes_ &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(agent_poll_interval);
    }
  } catch (const rendezvous_error&) {
    // The job has ended; a peer that cannot be told is not a new failure.
  }
}

DTRAIN_DETAIL_INLINE std::optional<exit_record> agent_store::first_exit(int restart) {
  const std::string key = agent_keys::exited(restart);
  if (!client_.check(std::span<const std::string>(&key, 1))) return std::nullopt;
  try {
    return exit_record::decode(key, client_.get(key));
  } catch (const rendezvous_error&) {
    return std::nullopt;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
