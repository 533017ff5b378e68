#pragma once
/// @file
/// Completing the world at rendezvous: every rank reports what its launcher
/// told it and the name of its node; ranks that share a node name share a
/// node. Open MPI and Hydra give no node index (and with `--map-by node`
/// rank arithmetic is wrong), so this is how those fields become known.
/// Pure functions; the runtime (run.hpp) carries the reports through the store.

#include <dtrain/detail/sys.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <array>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// The variable that overrides the host name as the node's identity (for
/// containers that share a host name, or several "nodes" on one machine).
inline constexpr std::string_view node_name_variable = "DTRAIN_NODE_NAME";

/// This process's node name: DTRAIN_NODE_NAME, else the host name.
[[nodiscard]] inline std::string node_name(const environment& env) {
  if (auto name = env.get(node_name_variable); name && !name->empty()) return std::string(*name);
  auto host = detail::host_name();
  if (!host) throw error("gethostname failed; set DTRAIN_NODE_NAME");
  return *host;
}

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

  /// One line per entry, each `<length>:<text>`, so origins may hold anything.
  [[nodiscard]] std::string encode() const {
    std::string out;
    auto put = [&](std::string_view text) {
      out += std::to_string(text.size());
      out += ':';
      out += text;
    };
    put(node_name);
    const auto numbers = slots(self);
    for (std::size_t i = 0; i < numbers.size(); ++i) {
      put(*numbers[i] ? std::to_string(**numbers[i]) : std::string());
      put(self.origin(fields[i]));
    }
    return out;
  }

  /// The inverse of encode(); `what` names the input (e.g. the store key) in errors.
  [[nodiscard]] static rank_report decode(std::string_view text, const std::string& what) {
    rank_report r;
    std::size_t at = 0;
    auto take = [&]() -> std::string {
      auto colon = text.find(':', at);
      std::size_t length = 0;
      bool ok = colon != std::string_view::npos && colon > at;
      for (std::size_t i = at; ok && i < colon; ++i) {
        ok = text[i] >= '0' && text[i] <= '9' && length < (1u << 24);
        length = length * 10 + static_cast<std::size_t>(text[i] - '0');
      }
      if (!ok || colon + 1 + length > text.size())
        throw rendezvous_error(what + " is not a dtrain rank report");
      std::string out(text.substr(colon + 1, length));
      at = colon + 1 + length;
      return out;
    };
    r.node_name = take();
    const auto numbers = slots(r.self);
    for (std::size_t i = 0; i < numbers.size(); ++i) {
      std::string value = take();
      if (!value.empty()) {
        try {
          *numbers[i] = std::stoi(value);
        } catch (const std::exception&) {
          throw rendezvous_error(what + " is not a dtrain rank report");
        }
      }
      r.self.origins[static_cast<std::size_t>(fields[i])] = take();
    }
    if (at != text.size()) throw rendezvous_error(what + " is not a dtrain rank report");
    return r;
  }

  /// Whether the launcher placed this rank fully (its node and its place there).
  [[nodiscard]] bool placed() const noexcept {
    return self.local_rank && self.local_world_size && self.node_rank && self.num_nodes;
  }
};

/// Where one rank sits.
struct placement {
  int node_rank = 0;
  int num_nodes = 1;
  int local_rank = 0;
  int local_world_size = 1;

  friend bool operator==(const placement&, const placement&) = default;
};

/// Places every rank (reports[i] is rank i). When every report is complete,
/// each keeps what its launcher said. Otherwise ranks are grouped by node
/// name: nodes are numbered in the order of their lowest rank, local ranks
/// follow the rank order within a node. Throws config_error, naming the
/// ranks and variables, when the ranks disagree about the world size or a
/// known field contradicts the grouping.
[[nodiscard]] inline std::vector<placement> place_ranks(const std::vector<rank_report>& reports) {
  const int n = static_cast<int>(reports.size());
  for (int r = 0; r < n; ++r) {
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
    for (int r = 0; r < n; ++r) {
      const world& w = reports[r].self;
      out[r] = {*w.node_rank, *w.num_nodes, *w.local_rank, *w.local_world_size};
    }
    return out;
  }
  std::map<std::string, int> node_of;  // node name -> node index
  std::vector<int> node_size;
  for (int r = 0; r < n; ++r) {
    auto [it, fresh] =
        node_of.try_emplace(reports[r].node_name, static_cast<int>(node_size.size()));
    if (fresh) node_size.push_back(0);
    out[r].node_rank = it->second;
    out[r].local_rank = node_size[it->second]++;
  }
  for (int r = 0; r < n; ++r) {
    out[r].num_nodes = static_cast<int>(node_size.size());
    out[r].local_world_size = node_size[out[r].node_rank];
  }
  // A field the launcher did give must match: otherwise the node names are wrong.
  for (int r = 0; r < n; ++r) {
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

}  // namespace dtrain
