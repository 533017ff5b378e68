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

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
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

/// "2" for 2 s, "0.5" for 500 ms: a duration as a user would have written it.
DTRAIN_DETAIL_INLINE std::string seconds_text(std::chrono::milliseconds t);

/// The agents' summary of a round's first failure. When the failing worker
/// gave up a collective that a worker which had already ended well never
/// issued, that worker comes first: it left early (it skipped a step, say),
/// and the failure is the consequence.
DTRAIN_DETAIL_INLINE std::string describe_failure(const failure_record& failure,
                                                  const std::optional<exit_record>& first_exit);

/// What agent_store::check_place() throws: another agent took this node's
/// place while this one was silent, and the job goes on with that one. Not a
/// dtrain::error: the agent stops its workers and leaves, recording no
/// failure (which would end the others' round) and counting in nothing.
struct agent_replaced : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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

  /// The nodes the last check() found silent.
  [[nodiscard]] const std::vector<int>& silent() const noexcept { return silent_; }

 private:
  std::vector<int> nodes_;
  std::vector<std::int64_t> seen_;
  std::vector<std::chrono::steady_clock::time_point> since_;
  std::chrono::steady_clock::time_point last_{};
  std::vector<int> silent_;
};

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

  /// Every node of the job: 0 .. nnodes - 1 (the most, in an elastic one).
  [[nodiscard]] std::vector<int> all_nodes() const {
    std::vector<int> nodes(static_cast<std::size_t>(nnodes_));
    for (int n = 0; n < nnodes_; ++n) nodes[static_cast<std::size_t>(n)] = n;
    return nodes;
  }
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
  /// An agent started with the --node-rank of a node whose agent is gone
  /// takes its place, as join_elastic() says (a replacement node: replacing()).
  void join(const node_record& me,
            std::chrono::milliseconds window = std::chrono::milliseconds(2500));
  /// Whether join() took the place of a node whose agent was gone.
  [[nodiscard]] bool replacing() const noexcept { return replacing_; }
  /// After join(): the round the job goes on with, the newest any node's
  /// record comes into (node_record::round). 0 for a new job; after node 0's
  /// agent was replaced, the round after the one the others ran.
  [[nodiscard]] int resume_round() const noexcept { return resume_round_; }
  /// Throws agent_replaced when this node's place (agent_keys::node) holds
  /// another agent's record: that one took it while this agent did not beat
  /// (frozen, or cut off from the store) for the replacement's window, and the
  /// job goes on with it. This agent must then act no more as the node: not
  /// beat, start workers or count itself in a round. Nothing to check before
  /// join() or join_elastic().
  void check_place();
  /// Node 0: round `restart` of a fixed-size job starts (agent_keys::current_round,
  /// which a replacement reads to learn the round it comes into).
  void start_round(int restart);

  /// The MASTER_PORT of round `restart`'s workers: node 0 picks a free port,
  /// every node reads it.
  int worker_port(int restart);

  /// Node `node`'s record, as its agent registered it (join()).
  node_record record(int node);

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

  /// Tells every agent that this one found `nodes` silent in round `restart`
  /// (the heartbeat: a frozen agent keeps its connection, so gone_nodes() does
  /// not see it); call it before recording the failure that it causes.
  void report_silent(int restart, const std::vector<int>& nodes);
  /// Of `nodes`, those that some agent found silent in round `restart`.
  [[nodiscard]] std::vector<int> silent_nodes(int restart, const std::vector<int>& nodes);

  /// Of `nodes`, those (but this one) whose agent is gone: its lease
  /// (agent_keys::alive, taken when it joined) ended with its connection to
  /// the store, so it was killed or its host went away. Known at once, where
  /// the heartbeat takes DTRAIN_HEARTBEAT_TIMEOUT; a host that vanishes
  /// without closing its connections is left to the heartbeat.
  [[nodiscard]] std::vector<int> gone_nodes(const std::vector<int>& nodes);

  // ---- elastic jobs (dtrun --nnodes MIN:MAX) ----------------------------

  /// Registers this node without waiting for the others (a node may come
  /// and go), after checking that it runs the job's shape (node 0's record;
  /// config_error naming what differs). A node that comes back takes its old
  /// place at once when the agent that held it is gone (its lease,
  /// agent_keys::alive, ended with its connection), else once that agent is
  /// found silent for `window` (its heartbeat, which every agent beats while
  /// it waits or runs a round); an agent still beating holds it, and this
  /// one is refused by name. Then it takes its own lease.
  void join_elastic(const node_record& me,
                    std::chrono::milliseconds window = std::chrono::milliseconds(2500));

  /// The round a node that starts now joins: the one after the newest round
  /// formed (or asked for, raise_round()), or round 0.
  int first_round();
  /// Makes `round` the newest (agent_keys::current_round) unless a later one
  /// is: never lowers it. An agent that comes back to the store of an agent
  /// that took node 0's place raises it to the round it ran, so that the
  /// rounds go on from there (join_elastic()).
  void raise_round(int round);

  /// Says that this node is ready for round `restart` and returns the
  /// round's nodes (ascending), which node 0 chooses: once at least
  /// `min_nodes` are ready, every node ready within `last_call` after that.
  /// The last call is for nodes still starting: it ends at once when all
  /// nnodes are ready, and, for every round after node 0's first, when every
  /// node whose agent is connected (its lease) is ready: survivors of a lost
  /// node do not wait for it. Every agent counts the round's nodes from then
  /// on (success, leaving). A node not among them joins a later round.
  /// Node 0 forms a later round than `restart` when another agent asks for
  /// one (raise_round(): it came back to this store, which serves the job
  /// since node 0's agent was replaced): `restart` becomes that round. A
  /// round node 0 passed over that way has no nodes: empty.
  std::vector<int> form_round(int& restart, int min_nodes, std::chrono::milliseconds last_call);

  /// Node 0, after form_round(): the nodes it did not wait for because their
  /// agents were gone.
  [[nodiscard]] const std::vector<int>& passed_over() const noexcept { return passed_over_; }

  /// Whether a node is ready for the round after `restart`, or asks for a
  /// later one (raise_round()): one waits to join.
  [[nodiscard]] bool node_waiting(int restart) {
    return client_.add(agent_keys::ready(restart + 1), 0) > 0 || first_round() > restart + 1;
  }

  /// Says this agent is done. Node 0 keeps the store up until every agent
  /// has read how the job ended, at most `grace` + 10 s.
  void leave(std::chrono::milliseconds grace);

 private:
  // Leases agent_keys::alive for this node, valued with its record.
  void take_lease(const node_record& me);
  // Registers this node at agent_keys::node and takes its lease. When the
  // place is held, takes it from an agent that is gone (its lease ended, or
  // its heartbeat silent for `window`), else throws config_error naming both.
  // Returns whether it took the place from another agent.
  bool take_place(const node_record& me, std::chrono::milliseconds window);

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
  bool formed_ = false;           // node 0: it formed a round before
  bool replacing_ = false;        // join() took a gone agent's place
  int resume_round_ = 0;          // join(): the newest round of the nodes' records
  std::string place_;             // this agent's record, as take_place() registered it
  std::vector<int> passed_over_;  // node 0: form_round()'s nodes whose agents were gone
  std::chrono::steady_clock::time_point last_beat_{};
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/agent_store-inl.hpp>
#endif
