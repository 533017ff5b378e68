#pragma once
/// @file
/// The job's protocol: the variables a node agent hands its workers
/// (agent_store_variable, restart_count_variable and store_token_variable,
/// named in env/names.hpp, next to torchrun's), the store keys that the agents,
/// the workers (runtime/context.hpp) and the diagnostics share, and the format of
/// every value under them. Every value is written and read here (or by the
/// codec next to its type: rank_report and placements in env/placement.hpp,
/// rings in diagnostics/desync.hpp), through detail::wire; a malformed one is a
/// rendezvous_error naming the key.
///
/// ```text
///   agent keys (unprefixed; one store per job, outliving restarts)
///     dtrain/agent/node/<n>         nproc i64, max_restarts i64, host bytes32, pid i64,
///                                   rdzv_id bytes32, buddy bytes32, round i64: the node's
///                                   place; an agent that finds another's record here leaves
///                                   the job (agent_store::check_place)
///     dtrain/agent/joined, left     counters (store add)
///     dtrain/agent/beat/<n>         counter: node n's heartbeat
///     dtrain/agent/alive/<n>        i64 1, leased by node n's agent: erased when its
///                                   connection closes
///     dtrain/agent/current_round    i64: the newest round formed (elastic) or started (fixed:
///                                   a replacement agent comes into the round after it); an
///                                   elastic agent back from a lost store raises it to the
///                                   round it ran (never lowered: agent_store::raise_round)
///     dtrain/agent/<r>/worker_port  i64: MASTER_PORT of round r's workers
///     dtrain/agent/<r>/failure      status i64, kind u8 (0 restartable, 1 final, 2 regroup),
///                                   message bytes32, rank i64, collective i64,
///                                   communicator bytes32
///     dtrain/agent/<r>/silent/<n>   counter: agents that found node n silent in round r (no
///                                   heartbeat): every agent then names it as lost
///   and in elastic jobs (dtrun --nnodes MIN:MAX; node 0 forms each round):
///     dtrain/agent/<r>/ready        counter: nodes ready for round r
///     dtrain/agent/<r>/ready/<n>    i64 1: node n is ready for round r
///     dtrain/agent/<r>/members      n u32, n x node i64 (ascending): round r's nodes (none:
///                                   node 0 passed round r over for a later one)
///     dtrain/agent/<r>/exited       rank i64, label bytes32, n u32, n x (communicator
///                                   bytes32, collectives i64): the first worker of round r
///                                   that ended well
///     dtrain/agent/<r>/stopped      counter: agents that stopped round r
///     dtrain/agent/<r>/succeeded    counter: agents whose workers all succeeded
///   worker keys (under runtime/context.hpp's job_store_prefix)
///     world/<rank>                  rank_report (env/placement.hpp)
///     world/joined                  counter: ranks whose report is set
///     world/joined/all              i64 1, once every rank has joined
///     world/placement               placement table (env/placement.hpp)
///     nccl/unique_id                outcome: the NCCL unique id (nccl_options::store_key)
///     finished                      counter
///     finished/all                  i64 1, once every rank is done
///   diagnostics keys (under the job prefix + "diag/", diagnostics.hpp)
///     round                         counter
///     open/<n>, <n>/printer         i64: a rank
///     <n>/reason                    bytes32
///     <n>/ring/<rank>               rings (diagnostics/desync.hpp)
///     <n>/closed                    i64 1
///   broadcasts from rank 0 over MPI, before any store (traits' pre_store_relay)
///     the store token               outcome: the token's bytes
///     the store's address           outcome: store_address (host bytes32, port i64)
/// ```
///
/// An "outcome" (wire::outcome, detail/wire.hpp) is what broadcast_or_fail
/// sends (rendezvous/broadcast.hpp): u8 1 and the value as bytes32, or u8 0
/// and rank 0's error as bytes32, so that every rank fails at once with rank
/// 0's message when rank 0 cannot produce the value.

#include <dtrain/config.hpp>
#include <dtrain/detail/wire.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {
namespace detail {

/// The agents' keys (see the table above).
struct agent_keys {
  /// Key `what` of restart round `restart`: "dtrain/agent/3/failure".
  static std::string of_round(int restart, std::string_view what) {
    return "dtrain/agent/" + std::to_string(restart) + "/" + std::string(what);
  }
  static std::string failure(int restart) { return of_round(restart, "failure"); }
  static std::string worker_port(int restart) { return of_round(restart, "worker_port"); }
  static std::string stopped(int restart) { return of_round(restart, "stopped"); }
  static std::string succeeded(int restart) { return of_round(restart, "succeeded"); }
  static std::string exited(int restart) { return of_round(restart, "exited"); }
  static std::string silent(int restart, int node) {
    return of_round(restart, "silent/" + std::to_string(node));
  }
  // Elastic jobs (dtrun --nnodes MIN:MAX): the nodes ready for a round (a
  // counter, and one key per node), the members node 0 chose ("0,2"), and
  // the newest round formed.
  static std::string ready(int restart) { return of_round(restart, "ready"); }
  static std::string ready_node(int restart, int node) {
    return of_round(restart, "ready/" + std::to_string(node));
  }
  static std::string members(int restart) { return of_round(restart, "members"); }
  static constexpr std::string_view current_round = "dtrain/agent/current_round";
  static std::string node(int node) { return "dtrain/agent/node/" + std::to_string(node); }
  static std::string beat(int node) { return "dtrain/agent/beat/" + std::to_string(node); }
  // Leased by node `node`'s agent (store_client::lease): gone the moment its
  // connection to the store closes.
  static std::string alive(int node) { return "dtrain/agent/alive/" + std::to_string(node); }
  static constexpr std::string_view joined = "dtrain/agent/joined";
  static constexpr std::string_view left = "dtrain/agent/left";
};

/// The workers' keys under the job prefix (see the table above).
struct job_keys {
  static std::string report(int rank) { return std::string("world/").append(std::to_string(rank)); }
  static constexpr std::string_view joined = "world/joined";
  static constexpr std::string_view joined_all = "world/joined/all";
  static constexpr std::string_view placement = "world/placement";
  static constexpr std::string_view finished = "finished";
  static constexpr std::string_view finished_all = "finished/all";
};

/// The store keys of the diagnostics rounds, under the job's prefix + "diag/":
/// "round" counts the rounds, "open/<n>" elects the rank that opens round n,
/// "<n>/ring/<rank>" holds a rank's rings (encode_rings), "<n>/reason" why it
/// was asked, "<n>/printer" the rank that prints, "<n>/closed" once printed.
struct diagnostics_keys {
  static std::string open(std::int64_t round) { return "open/" + std::to_string(round); }
  static std::string ring(std::int64_t round, int rank) {
    return std::to_string(round) + "/ring/" + std::to_string(rank);
  }
  static std::string of(std::int64_t round, std::string_view what) {
    return std::to_string(round) + "/" + std::string(what);
  }
};

/// The value of a key that only has to exist ("finished/all", "<n>/closed").
inline std::string present_value() { return wire::encode_int(1); }

/// The first failure of a restart round, as the agents and the workers record it.
struct failure_record {
  int status = 1;               ///< exit status for the job
  bool final = false;           ///< no restart: a signal or a lost peer ended the job
  std::string message;          ///< who failed how
  int rank = -1;                ///< the worker that recorded it; -1: an agent
  std::int64_t collective = 0;  ///< its first collective that failed or timed out (#N); 0: none
  std::string communicator{};   ///< the ring name of that collective's communicator ("world")
  /// Not a failure: an elastic job's nodes change (a node waits to join), so
  /// every node stops its workers and the next round is formed; no restart is counted.
  bool regroup = false;

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static failure_record decode(const std::string& key, std::string_view value);
};

/// Records a failure of round `restart` unless one is recorded already: the
/// first one is the root cause, later ones are usually its consequences.
template <store Store>
void record_failure(Store& store, int restart, const failure_record& failure) {
  store.compare_set(agent_keys::failure(restart), "", failure.encode());
}

/// A worker whose training function returned 0, and how many collectives it
/// had issued on each communicator: when a peer then fails in a later
/// collective, the agents name this worker first (it left early), not the
/// peer that waited for it.
struct exit_record {
  int rank = 0;
  std::string label;  ///< worker_label()
  /// Collectives issued, by communicator (its ring's name: "world", "world/split 1 (color 0)").
  std::vector<std::pair<std::string, std::int64_t>> issued;

  /// The collectives issued on `communicator` (0 when it had none).
  [[nodiscard]] std::int64_t issued_on(std::string_view communicator) const;

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static exit_record decode(const std::string& key, std::string_view value);
};

/// Records that a worker of round `restart` ended well, unless one did already:
/// the first one is the one that may have left its peers waiting.
template <store Store>
void record_exit(Store& store, int restart, const exit_record& exit) {
  store.compare_set(agent_keys::exited(restart), "", exit.encode());
}

/// What a node agent says about itself when it joins: every node must run
/// the same number of workers, allow the same restarts and give the same job
/// id (--rdzv-id).
struct node_record {
  std::int64_t nproc = 0;
  std::int64_t max_restarts = 0;
  std::string host;
  std::int64_t pid = 0;
  std::string rdzv_id{};  // empty: none given
  /// HOST:PORT where this agent holds the memory copies that the workers of
  /// the node before it send (checkpoint_options::memory_buddy); empty: none.
  std::string buddy{};
  /// The round this agent comes into: 0 when it starts, the one after its
  /// last when it comes back to the store of an agent that took node 0's
  /// place (the job's rounds go on from the newest any node ran).
  std::int64_t round = 0;

  /// "host:pid", how messages name the agent.
  [[nodiscard]] std::string who() const { return host + ":" + std::to_string(pid); }

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static node_record decode(const std::string& key, std::string_view value);
};

/// A port, as the agents share the workers' MASTER_PORT.
inline std::string encode_port(int port) { return wire::encode_int(port); }
DTRAIN_DETAIL_INLINE int decode_port(const std::string& key, std::string_view value);

/// An elastic round's members: node ranks, ascending, each below `nnodes`;
/// none for a round that node 0 passed over (agent_store::form_round()).
DTRAIN_DETAIL_INLINE std::string encode_members(const std::vector<int>& nodes);
DTRAIN_DETAIL_INLINE std::vector<int> decode_members(const std::string& key, std::string_view value,
                                                     int nnodes);

/// Where rank 0 serves the store, as it tells the other ranks through the
/// backend's pre-store channel when no MASTER_ADDR does (inside an outcome).
struct store_address {
  std::string host;  ///< rank 0's host name
  int port = 0;      ///< the port it listens on

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static store_address decode(std::string_view value);
};

/// How a worker prefixes the lines it prints: "[rank 3/8]", or what is known of it.
DTRAIN_DETAIL_INLINE std::string rank_label(const world* w);

/// How one worker is named in failure messages, by its agent and by itself.
DTRAIN_DETAIL_INLINE std::string worker_label(int rank, int node_rank, int local_rank, long pid);

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/protocol-inl.hpp>
#endif
