#pragma once
/// @file
/// The non-template bodies of dtrain/launch/agent_store.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/agent_store.hpp, not this file.

#include <dtrain/launch/agent_store.hpp>

namespace dtrain::detail {

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

DTRAIN_DETAIL_INLINE std::string seconds_text(std::chrono::milliseconds t) {
  std::string text = std::to_string(t.count() / 1000);
  if (auto ms = t.count() % 1000; ms != 0) {
    std::string frac = std::to_string(1000 + ms).substr(1);
    while (frac.back() == '0') frac.pop_back();
    text += "." + frac;
  }
  return text;
}

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

DTRAIN_DETAIL_INLINE std::optional<int> heartbeat::check(store_client& store, int me,
                                                         std::chrono::milliseconds limit) {
  auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::seconds(1)) return std::nullopt;
  last_ = now;
  std::optional<int> first;
  silent_.clear();
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const int n = nodes_[i];
    if (n == me) continue;
    std::int64_t beat = store.add(agent_keys::beat(n), 0);
    if (beat != seen_[i]) {
      seen_[i] = beat;
      since_[i] = now;
    } else if (now - since_[i] > limit) {
      if (!first) first = n;
      silent_.push_back(n);
    }
  }
  return first;
}

DTRAIN_DETAIL_INLINE void agent_store::report_silent(int restart, const std::vector<int>& nodes) {
  for (const int n : nodes) client_.add(agent_keys::silent(restart, n), 1);
}

DTRAIN_DETAIL_INLINE std::vector<int> agent_store::silent_nodes(int restart,
                                                                const std::vector<int>& nodes) {
  std::vector<int> out;
  for (const int n : nodes) {
    const std::string key = agent_keys::silent(restart, n);
    if (client_.check(std::span<const std::string>(&key, 1))) out.push_back(n);
  }
  return out;
}

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
  static_cast<void>(take_place(me, window));
  // Back from a store that is gone (node 0's agent was replaced): the rounds
  // go on from the one this agent ran.
  if (me.round > 0) raise_round(static_cast<int>(me.round) - 1);
}

DTRAIN_DETAIL_INLINE bool agent_store::take_place(const node_record& me,
                                                  std::chrono::milliseconds window) {
  const std::string mine = agent_keys::node(node_rank_);
  place_ = me.encode();
  const std::string holder = client_.compare_set(mine, "", place_);
  if (holder == place_) {
    take_lease(me);
    return false;
  }
  // Held before: by an agent of this node that is gone (it comes back, or a
  // replacement comes), or by another agent started with this node rank, which still beats.
  const node_record other = node_record::decode(mine, holder);
  auto gone = [&] {  // its lease ended (the holder leases right after it registers)
    const std::string alive = agent_keys::alive(node_rank_);
    return !client_.check(std::span<const std::string>(&alive, 1));
  };
  if (gone()) {
    poll_until(
        std::chrono::steady_clock::now() + std::chrono::milliseconds(200), [] { return false; },
        "the agent that held node_rank " + std::to_string(node_rank_) + " to take its lease",
        false);
    if (gone()) {
      client_.set(mine, me.encode());
      take_lease(me);
      return true;
    }
  }
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
  take_lease(me);
  return true;
}

DTRAIN_DETAIL_INLINE void agent_store::check_place() {
  if (place_.empty()) return;
  const std::string key = agent_keys::node(node_rank_);
  const std::string holder = client_.get(key);
  if (holder == place_) return;
  std::string by = "another agent";
  try {
    by = "the agent " + node_record::decode(key, holder).who();
  } catch (const rendezvous_error&) {
    // A record this agent cannot read is still not its own.
  }
  throw agent_replaced("node " + std::to_string(node_rank_) + "'s place was taken by " + by +
                       " while this agent (" + node_record::decode(key, place_).who() +
                       ") did not respond (frozen, or cut off from the store): the job goes on "
                       "with that agent, and this one stops its workers and leaves");
}

DTRAIN_DETAIL_INLINE void agent_store::take_lease(const node_record& me) {
  client_.lease(agent_keys::alive(node_rank_), me.encode());
}

DTRAIN_DETAIL_INLINE std::vector<int> agent_store::gone_nodes(const std::vector<int>& nodes) {
  std::vector<std::string> keys;
  for (const int n : nodes) {
    if (n != node_rank_) keys.push_back(agent_keys::alive(n));
  }
  std::vector<int> gone;
  if (keys.empty() || client_.check(keys)) return gone;  // one request while all are there
  for (const int n : nodes) {
    const std::string key = agent_keys::alive(n);
    if (n != node_rank_ && !client_.check(std::span<const std::string>(&key, 1))) gone.push_back(n);
  }
  return gone;
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

DTRAIN_DETAIL_INLINE void agent_store::raise_round(int round) {
  const std::string key(agent_keys::current_round);
  const std::string want = wire::encode_int(round);
  std::string now = client_.check(std::span<const std::string>(&key, 1)) ? client_.get(key) : "";
  while (now.empty() || first_round() <= round) {
    const std::string after = client_.compare_set(key, now, want);
    if (after == want) return;
    now = after;  // another agent's, meanwhile: look again
  }
}

DTRAIN_DETAIL_INLINE std::vector<int> agent_store::form_round(int& restart, int min_nodes,
                                                              std::chrono::milliseconds last_call) {
  if (const int asked = node_rank_ == 0 ? first_round() : restart; asked > restart) {
    // Another agent asks for a later round (raise_round()): a node that
    // waits for this one learns that it was passed over.
    client_.set(agent_keys::members(restart), encode_members({}));
    restart = asked;
  }
  client_.set(agent_keys::ready_node(restart, node_rank_), wire::encode_int(1));
  client_.add(agent_keys::ready(restart), 1);
  const std::string members_key = agent_keys::members(restart);
  const std::string round = "round " + std::to_string(restart);
  if (node_rank_ == 0) {
    auto ready = [&] { return client_.add(agent_keys::ready(restart), 0); };
    // An agent that asks for a later round: form that one instead.
    auto later = [&] { return first_round() > restart; };
    wait_for([&] { return ready() >= min_nodes || later(); },
             "at least " + std::to_string(min_nodes) + " of " + std::to_string(nnodes_) +
                 " nodes to be ready for " + round);
    if (later()) return form_round(restart, min_nodes, last_call);
    // The last call, for nodes still starting: a time-out here is no
    // failure, the round is who came. After node 0's first round, the nodes
    // whose agents are gone are not waited for: every one connected is.
    const std::vector<int> everyone = all_nodes();
    auto connected_ready = [&] {
      if (!formed_) return false;
      const std::vector<int> gone = gone_nodes(everyone);
      for (int n = 0; n < nnodes_; ++n) {
        if (std::find(gone.begin(), gone.end(), n) != gone.end()) continue;
        const std::string key = agent_keys::ready_node(restart, n);
        if (!client_.check(std::span<const std::string>(&key, 1))) return false;
      }
      return true;
    };
    static_cast<void>(poll_until(
        std::chrono::steady_clock::now() + last_call,
        [&] { return ready() >= nnodes_ || connected_ready() || later(); },
        "the other nodes to be ready for " + round));
    if (later()) return form_round(restart, min_nodes, last_call);
    const bool first = !std::exchange(formed_, true);
    std::vector<int> nodes;
    for (int n = 0; n < nnodes_; ++n) {
      const std::string key = agent_keys::ready_node(restart, n);
      if (client_.check(std::span<const std::string>(&key, 1))) nodes.push_back(n);
    }
    // A node ready and then gone is a member: the round ends at once (agent_round::watch_peers).
    passed_over_.clear();
    if (!first) {
      for (const int n : gone_nodes(everyone)) {
        if (std::find(nodes.begin(), nodes.end(), n) == nodes.end()) passed_over_.push_back(n);
      }
    }
    client_.set(members_key, encode_members(nodes));
    raise_round(restart);
  } else {
    wait_for([&] { return client_.check(std::span<const std::string>(&members_key, 1)); },
             "node 0 to form " + round);
  }
  std::vector<int> nodes = decode_members(members_key, client_.get(members_key), nnodes_);
  round_size_ = static_cast<int>(nodes.size());
  lost_nodes_ = 0;  // of an earlier round: not among these
  return nodes;
}

DTRAIN_DETAIL_INLINE void agent_store::join(const node_record& me,
                                            std::chrono::milliseconds window) {
  replacing_ = take_place(me, window);
  const std::string joined(agent_keys::joined);
  const std::string what = "all " + std::to_string(nnodes_) + " node agents to join";
  if (replacing_) {
    // The agent it replaces was counted.
    wait_for([&] { return client_.add(joined, 0) >= nnodes_; }, what);
  } else {
    meet(joined, what);
  }
  resume_round_ = 0;
  for (int n = 0; n < nnodes_; ++n) {
    const std::string other_key = agent_keys::node(n);
    const node_record other = node_record::decode(other_key, client_.get(other_key));
    check_same_shape(n, other, me);
    resume_round_ = std::max(resume_round_, static_cast<int>(other.round));
  }
}

DTRAIN_DETAIL_INLINE void agent_store::start_round(int restart) {
  client_.set(std::string(agent_keys::current_round), wire::encode_int(restart));
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

DTRAIN_DETAIL_INLINE node_record agent_store::record(int node) {
  const std::string key = agent_keys::node(node);
  return node_record::decode(key, client_.get(key));
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

}  // namespace dtrain::detail
