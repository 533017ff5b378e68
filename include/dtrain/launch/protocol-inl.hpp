#pragma once
/// @file
/// The non-template bodies of dtrain/launch/protocol.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/protocol.hpp, not this file.

#include <dtrain/launch/protocol.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::string failure_record::encode() const {
  std::string out;
  wire::writer(out)
      .i64(status)
      .u8(regroup ? 2
          : final ? 1
                  : 0)
      .bytes32(message)
      .i64(rank)
      .i64(collective)
      .bytes32(communicator);
  return out;
}

DTRAIN_DETAIL_INLINE failure_record failure_record::decode(const std::string& key,
                                                           std::string_view value) {
  return wire::decode_value("store key " + key, value, "a failure record", [](wire::reader& r) {
    failure_record f;
    const std::int64_t code = r.i64("the exit status");
    if (code < 0 || code > 255) {
      throw wire::violation("the exit status " + std::to_string(code) + " is not in 0..255");
    }
    f.status = static_cast<int>(code);
    const std::uint8_t flag = r.u8("the kind");
    if (flag > 2) {
      throw wire::violation("the kind is " + std::to_string(flag) +
                            ", not 0 (restartable), 1 (final) or 2 (regroup)");
    }
    f.final = flag == 1;
    f.regroup = flag == 2;
    f.message = r.bytes32("the message");
    const std::int64_t raw_rank = r.i64("the rank");
    if (raw_rank < -1 || raw_rank > INT32_MAX)
      throw wire::violation("the rank " + std::to_string(raw_rank) + " is not a rank or -1");
    f.rank = static_cast<int>(raw_rank);
    f.collective = r.i64("the collective");
    if (f.collective < 0)
      throw wire::violation("the collective #" + std::to_string(f.collective) + " is negative");
    f.communicator = r.bytes32("the communicator");
    return f;
  });
}

DTRAIN_DETAIL_INLINE std::int64_t exit_record::issued_on(std::string_view communicator) const {
  for (const auto& [name, count] : issued) {
    if (name == communicator) return count;
  }
  return 0;
}

DTRAIN_DETAIL_INLINE std::string exit_record::encode() const {
  std::string out;
  wire::writer w(out);
  w.i64(rank).bytes32(label).u32(static_cast<std::uint32_t>(issued.size()));
  for (const auto& [name, count] : issued) w.bytes32(name).i64(count);
  return out;
}

DTRAIN_DETAIL_INLINE exit_record exit_record::decode(const std::string& key,
                                                     std::string_view value) {
  return wire::decode_value("store key " + key, value, "a worker's exit", [](wire::reader& r) {
    exit_record e;
    const std::int64_t raw_rank = r.i64("the rank");
    if (raw_rank < 0 || raw_rank > INT32_MAX)
      throw wire::violation("the rank " + std::to_string(raw_rank) + " is not a rank");
    e.rank = static_cast<int>(raw_rank);
    e.label = r.bytes32("the worker");
    const std::uint32_t n = r.u32("the communicator count");
    if (n > 1024) throw wire::violation(std::to_string(n) + " communicators is more than 1024");
    for (std::uint32_t i = 0; i < n; ++i) {
      std::string name(r.bytes32("a communicator"));
      const std::int64_t count = r.i64("its collectives");
      if (count < 0) throw wire::violation(std::to_string(count) + " collectives is negative");
      e.issued.emplace_back(std::move(name), count);
    }
    return e;
  });
}

DTRAIN_DETAIL_INLINE std::string node_record::encode() const {
  std::string out;
  wire::writer(out)
      .i64(nproc)
      .i64(max_restarts)
      .bytes32(host)
      .i64(pid)
      .bytes32(rdzv_id)
      .bytes32(buddy)
      .i64(round);
  return out;
}

DTRAIN_DETAIL_INLINE node_record node_record::decode(const std::string& key,
                                                     std::string_view value) {
  return wire::decode_value(
      "store key " + key, value, "a node agent's record", [](wire::reader& r) {
        node_record n;
        n.nproc = r.i64("nproc");
        n.max_restarts = r.i64("max_restarts");
        n.host = r.bytes32("the host name");
        n.pid = r.i64("the pid");
        n.rdzv_id = r.bytes32("the rdzv id");
        n.buddy = r.bytes32("the buddy store");
        n.round = r.i64("the round");
        if (n.round < 0 || n.round > INT32_MAX - 1) {
          throw wire::violation("round " + std::to_string(n.round) + " is out of range");
        }
        return n;
      });
}

DTRAIN_DETAIL_INLINE int decode_port(const std::string& key, std::string_view value) {
  return wire::decode_value("store key " + key, value, "a port", [](wire::reader& r) {
    const std::int64_t port = r.i64("the port");
    if (port < 1 || port > 65535) {
      throw wire::violation("the port " + std::to_string(port) + " is not in 1..65535");
    }
    return static_cast<int>(port);
  });
}

DTRAIN_DETAIL_INLINE std::string encode_members(const std::vector<int>& nodes) {
  std::string out;
  wire::writer w(out);
  w.u32(static_cast<std::uint32_t>(nodes.size()));
  for (const int n : nodes) w.i64(n);
  return out;
}

DTRAIN_DETAIL_INLINE std::vector<int> decode_members(const std::string& key, std::string_view value,
                                                     int nnodes) {
  return wire::decode_value("store key " + key, value, "a round's nodes", [&](wire::reader& r) {
    const std::uint32_t count = r.u32("the number of nodes");
    if (count > static_cast<std::uint32_t>(nnodes)) {
      throw wire::violation(std::to_string(count) + " nodes, not 0.." + std::to_string(nnodes));
    }
    std::vector<int> nodes;
    for (std::uint32_t i = 0; i < count; ++i) {
      const std::int64_t n = r.i64("a node rank");
      if (n < 0 || n >= nnodes || (!nodes.empty() && n <= nodes.back())) {
        throw wire::violation("node " + std::to_string(n) + " is not in 0.." +
                              std::to_string(nnodes - 1) + " or not ascending");
      }
      nodes.push_back(static_cast<int>(n));
    }
    return nodes;
  });
}

DTRAIN_DETAIL_INLINE std::string store_address::encode() const {
  std::string out;
  wire::writer(out).bytes32(host).i64(port);
  return out;
}

DTRAIN_DETAIL_INLINE store_address store_address::decode(std::string_view value) {
  return wire::decode_value(
      "rank 0's broadcast", value, "the store's address", [](wire::reader& r) {
        store_address a;
        a.host = r.bytes32("the host name");
        const std::int64_t number = r.i64("the port");
        if (number < 1 || number > 65535) {
          throw wire::violation("the port " + std::to_string(number) + " is not in 1..65535");
        }
        a.port = static_cast<int>(number);
        return a;
      });
}

DTRAIN_DETAIL_INLINE std::string rank_label(const world* w) {
  if (w == nullptr || !w->rank) return "[rank ?]";
  return "[rank " + std::to_string(*w->rank) + "/" +
         (w->world_size ? std::to_string(*w->world_size) : "?") + "]";
}

DTRAIN_DETAIL_INLINE std::string worker_label(int rank, int node_rank, int local_rank, long pid) {
  return "rank " + std::to_string(rank) + " (node " + std::to_string(node_rank) + ", local rank " +
         std::to_string(local_rank) + ", pid " + std::to_string(pid) + ")";
}

}  // namespace detail
}  // namespace dtrain
