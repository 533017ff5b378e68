#pragma once
/// @file
/// Completing the world at rendezvous: every rank reports what its launcher
/// told it and the name of its node; ranks that share a node name share a
/// node. Open MPI and Hydra give no node index (and with `--map-by node`
/// rank arithmetic is wrong), so this is how those fields become known.
/// Pure functions and the codecs of the reports and the table; the runtime
/// (runtime/context.hpp) carries them through the store.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/detail/wire.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// This process's node name: DTRAIN_NODE_NAME, else the host name.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string node_name(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string node_name(const environment& env) {
  if (auto name = env.get(node_name_variable); name && !name->empty()) return std::string(*name);
  auto host = detail::host_name();
  if (!host) throw error("gethostname failed; set DTRAIN_NODE_NAME");
  return *host;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// What one rank says about itself at rendezvous.
struct rank_report {
  std::string node_name;
  world self;  ///< as discovered: fields may be unknown

  // The fields a report carries, in wire order (the world's own order).
  static constexpr std::array<world::field, 5> fields{
      world::field::world_size, world::field::local_rank, world::field::local_world_size,
      world::field::node_rank, world::field::num_nodes};
  template <class W>
  static auto slots(W& w) {
    return std::array{&w.world_size, &w.local_rank, &w.local_world_size, &w.node_rank,
                      &w.num_nodes};
  }

  /// The report as a store value (detail/wire.hpp): node name bytes32, then
  /// per field a known flag u8, the value i64 when known, its origin bytes32.
  [[nodiscard]] std::string encode() const;

  /// The inverse of encode(); `where` names the input ("store key world/3") in
  /// the rendezvous_error a malformed value gives.
  [[nodiscard]] static rank_report decode(std::string_view text, const std::string& where);

  /// Whether the launcher placed this rank fully (its node and its place there).
  [[nodiscard]] bool placed() const noexcept {
    return self.local_rank && self.local_world_size && self.node_rank && self.num_nodes;
  }
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string rank_report::encode() const {
  std::string out;
  detail::wire::writer w(out);
  w.bytes32(node_name);
  const auto numbers = slots(self);
  for (std::size_t i = 0; i < numbers.size(); ++i) {
    w.u8(*numbers[i] ? 1 : 0);
    if (*numbers[i]) w.i64(**numbers[i]);
    w.bytes32(self.origin(fields[i]));
  }
  return out;
}

DTRAIN_DETAIL_INLINE rank_report rank_report::decode(std::string_view text,
                                                     const std::string& where) {
  return detail::wire::decode_value(where, text, "a rank report", [](detail::wire::reader& in) {
    rank_report r;
    r.node_name = in.bytes32("the node name");
    const auto numbers = slots(r.self);
    for (std::size_t i = 0; i < numbers.size(); ++i) {
      const char* name = world::field_names[static_cast<std::size_t>(fields[i])].data();
      const std::uint8_t known = in.u8(name);
      if (known > 1)
        throw detail::wire::violation(std::string(name) + "'s known flag is not 0 or 1");
      if (known == 1) {
        const std::int64_t value = in.i64(name);
        if (value < 0 || value > max_world_size) {
          throw detail::wire::violation(std::string(name) + " " + std::to_string(value) +
                                        " is not in 0.." + std::to_string(max_world_size));
        }
        *numbers[i] = static_cast<int>(value);
      }
      r.self.origins[static_cast<std::size_t>(fields[i])] = in.bytes32(name);
    }
    return r;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where one rank sits.
struct placement {
  int node_rank = 0;
  int num_nodes = 1;
  int local_rank = 0;
  int local_world_size = 1;

  friend bool operator==(const placement&, const placement&) = default;
};

/// The placement table rank 0 publishes: u8 1 and, for every rank, node_rank,
/// num_nodes, local_rank, local_world_size as i64; or u8 0 and the
/// config_error that placing the ranks gave (bytes32), for every rank to throw.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string encode_placements(
    const std::vector<placement>& ranks);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_placements(const std::vector<placement>& ranks) {
  std::string out;
  detail::wire::writer w(out);
  w.u8(1).u32(static_cast<std::uint32_t>(ranks.size()));
  for (const placement& p : ranks)
    w.i64(p.node_rank).i64(p.num_nodes).i64(p.local_rank).i64(p.local_world_size);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string encode_placement_error(std::string_view message);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_placement_error(std::string_view message) {
  std::string out;
  detail::wire::writer(out).u8(0).bytes32(message);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Rank `rank`'s entry of a table of `size` ranks; throws rank 0's
/// config_error when placing failed there, and a rendezvous_error naming
/// `where` ("store key dtrain/job/world/placement") when the value is malformed.
[[nodiscard]] DTRAIN_DETAIL_INLINE placement decode_placement(const std::string& where,
                                                              std::string_view value, int rank,
                                                              int size);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE placement decode_placement(const std::string& where, std::string_view value,
                                                int rank, int size) {
  std::optional<std::string> failure;
  placement mine =
      detail::wire::decode_value(where, value, "a placement table", [&](detail::wire::reader& in) {
        placement out;
        if (in.u8("the ok flag") == 0) {
          failure = in.bytes32("rank 0's error");
          return out;
        }
        const std::uint32_t n = in.u32("the rank count");
        if (static_cast<std::int64_t>(n) != size) {
          throw detail::wire::violation("it places " + std::to_string(n) + " ranks, not " +
                                        std::to_string(size));
        }
        for (std::uint32_t r = 0; r < n; ++r) {
          std::int64_t f[4];
          for (std::int64_t& v : f) {
            v = in.i64("a placement");
            if (v < 0 || v > max_world_size)
              throw detail::wire::violation("a placement field is " + std::to_string(v));
          }
          if (static_cast<int>(r) == rank) {
            out = {static_cast<int>(f[0]), static_cast<int>(f[1]), static_cast<int>(f[2]),
                   static_cast<int>(f[3])};
          }
        }
        return out;
      });
  if (failure) throw config_error(*failure);
  return mine;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Places every rank (reports[i] is rank i). When every report is complete,
/// each keeps what its launcher said. Otherwise ranks are grouped by node
/// name: nodes are numbered in the order of their lowest rank, local ranks
/// follow the rank order within a node. Throws config_error, naming the
/// ranks and variables, when the ranks disagree about the world size or a
/// known field contradicts the grouping.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<placement> place_ranks(
    const std::vector<rank_report>& reports);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<placement> place_ranks(const std::vector<rank_report>& reports) {
  const int n = static_cast<int>(reports.size());
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const auto& ws = reports[r].self.world_size;
    if (ws && *ws != n) {
      throw config_error("rank " + std::to_string(r) + " says the world has " +
                         std::to_string(*ws) + " ranks (" +
                         reports[r].self.origin(world::field::world_size) + "), but " +
                         std::to_string(n) + " ranks met at rendezvous");
    }
  }
  std::vector<placement> out(static_cast<std::size_t>(n));
  bool all_complete = true;
  for (const auto& r : reports) all_complete = all_complete && r.placed();
  if (all_complete) {
    for (std::size_t r = 0; r < reports.size(); ++r) {
      const world& w = reports[r].self;
      out[r] = {*w.node_rank, *w.num_nodes, *w.local_rank, *w.local_world_size};
    }
    return out;
  }
  std::map<std::string, int> node_of;  // node name -> node index
  std::vector<int> node_size;
  for (std::size_t r = 0; r < reports.size(); ++r) {
    auto [it, fresh] =
        node_of.try_emplace(reports[r].node_name, static_cast<int>(node_size.size()));
    if (fresh) node_size.push_back(0);
    out[r].node_rank = it->second;
    out[r].local_rank = node_size[static_cast<std::size_t>(it->second)]++;
  }
  for (std::size_t r = 0; r < reports.size(); ++r) {
    out[r].num_nodes = static_cast<int>(node_size.size());
    out[r].local_world_size = node_size[static_cast<std::size_t>(out[r].node_rank)];
  }
  // A field the launcher did give must match: otherwise the node names are wrong.
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const world& w = reports[r].self;
    auto check = [&](world::field f, const std::optional<int>& known, int grouped,
                     std::string_view what) {
      if (known && *known != grouped) {
        throw config_error("rank " + std::to_string(r) + ": " + w.origin(f) + " gives " +
                           std::string(what) + " " + std::to_string(*known) +
                           ", but grouping the ranks by node name (\"" + reports[r].node_name +
                           "\", the host name unless DTRAIN_NODE_NAME is set) gives " +
                           std::to_string(grouped) +
                           "; give every node a distinct DTRAIN_NODE_NAME, or set NODE_RANK");
      }
    };
    check(world::field::local_rank, w.local_rank, out[r].local_rank, "local rank");
    check(world::field::local_world_size, w.local_world_size, out[r].local_world_size,
          "local world size");
    check(world::field::node_rank, w.node_rank, out[r].node_rank, "node rank");
    check(world::field::num_nodes, w.num_nodes, out[r].num_nodes, "node count");
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
