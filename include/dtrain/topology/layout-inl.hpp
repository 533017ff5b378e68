#pragma once
/// @file
/// The non-template bodies of dtrain/topology/layout.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/topology/layout.hpp, not this file.

#include <dtrain/topology/layout.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::optional<node_layout> node_layout::of(const world& w) {
  if (!w.node_rank || !w.num_nodes || !w.local_rank || !w.local_world_size) return std::nullopt;
  return node_layout{*w.node_rank, *w.num_nodes, *w.local_rank, *w.local_world_size};
}
}  // namespace dtrain

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::string hierarchy_problem(std::span<const node_layout> table) {
  const auto rank = [](std::size_t r) { return "rank " + std::to_string(r); };
  if (table.empty()) return "no ranks";
  std::map<int, std::vector<int>> nodes;  // node rank -> the local ranks seen there
  for (std::size_t r = 0; r < table.size(); ++r) {
    const node_layout& l = table[r];
    if (l.num_nodes != table[0].num_nodes) {
      return rank(r) + " says there are " + std::to_string(l.num_nodes) + " nodes, rank 0 " +
             std::to_string(table[0].num_nodes);
    }
    if (l.node_rank < 0 || l.node_rank >= l.num_nodes || l.local_rank < 0 ||
        l.local_rank >= l.local_size) {
      return rank(r) + " has node rank " + std::to_string(l.node_rank) + " of " +
             std::to_string(l.num_nodes) + " and local rank " + std::to_string(l.local_rank) +
             " of " + std::to_string(l.local_size);
    }
    nodes[l.node_rank].push_back(l.local_rank);
  }
  const int n = table[0].num_nodes;
  if (static_cast<int>(nodes.size()) != n) {
    return std::to_string(nodes.size()) + " of the " + std::to_string(n) + " nodes have ranks";
  }
  const std::size_t first = nodes.begin()->second.size();
  for (const auto& [node, locals] : nodes) {
    if (locals.size() != first) {
      return "uneven nodes: node " + std::to_string(nodes.begin()->first) + " has " +
             std::to_string(first) + " ranks, node " + std::to_string(node) + " has " +
             std::to_string(locals.size()) +
             " (hierarchical needs the same number of ranks on every node)";
    }
    std::vector<char> seen(first, 0);
    for (int local : locals) {
      if (static_cast<std::size_t>(local) >= first || seen[static_cast<std::size_t>(local)]) {
        return "node " + std::to_string(node) + " does not number its " + std::to_string(first) +
               " ranks 0.." + std::to_string(first - 1) + " (local rank " + std::to_string(local) +
               ")";
      }
      seen[static_cast<std::size_t>(local)] = 1;
    }
  }
  for (std::size_t r = 0; r < table.size(); ++r) {
    if (static_cast<std::size_t>(table[r].local_size) != first) {
      return rank(r) + " says its node has " + std::to_string(table[r].local_size) +
             " ranks, but " + std::to_string(first) + " met there";
    }
  }
  if (n == 1) return "one node: nothing crosses nodes";
  if (first == 1) return "one rank per node: the cross-node communicator would be the world";
  return {};
}

DTRAIN_DETAIL_INLINE std::vector<node_layout> gather_layouts(control_plane& control,
                                                             const node_layout& mine) {
  const std::int64_t fields[4] = {mine.node_rank, mine.num_nodes, mine.local_rank, mine.local_size};
  std::vector<std::int64_t> all(4 * static_cast<std::size_t>(control.size()));
  control.allgather(fields, all);
  std::vector<node_layout> table(static_cast<std::size_t>(control.size()));
  for (std::size_t r = 0; r < table.size(); ++r) {
    const std::int64_t* f = &all[4 * r];
    table[r] = {static_cast<int>(f[0]), static_cast<int>(f[1]), static_cast<int>(f[2]),
                static_cast<int>(f[3])};
  }
  return table;
}

DTRAIN_DETAIL_INLINE node_layout layout_from_node_names(control_plane& control,
                                                        std::string_view node_name) {
  std::uint64_t hash = 1469598103934665603ull;
  for (char c : node_name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  const std::int64_t mine[1] = {static_cast<std::int64_t>(hash)};
  std::vector<std::int64_t> all(static_cast<std::size_t>(control.size()));
  control.allgather(mine, all);
  std::vector<rank_report> reports(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) reports[r].node_name = std::to_string(all[r]);
  const placement p = place_ranks(reports)[static_cast<std::size_t>(control.rank())];
  return {p.node_rank, p.num_nodes, p.local_rank, p.local_world_size};
}

}  // namespace detail
}  // namespace dtrain
