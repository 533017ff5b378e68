#pragma once
/// @file
/// Where each rank sits among the nodes, as a topology needs it: the
/// `node_layout` of one rank, every rank's gathered over the host control
/// plane, and the check that the nodes are alike enough for a hierarchical
/// collective (every node the same number of ranks, local ranks 0..L-1).

#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// One rank's place among the nodes: what topology::hierarchical groups by.
struct node_layout {
  int node_rank = 0;
  int num_nodes = 1;
  int local_rank = 0;
  int local_size = 1;

  /// The layout of a complete world (as dtrain::run hands it over); nullopt
  /// when a field is unknown.
  [[nodiscard]] static std::optional<node_layout> of(const world& w);
  friend bool operator==(const node_layout&, const node_layout&) = default;
};

namespace detail {

/// Why `table` (table[r]: rank r's layout) cannot run hierarchically, or an
/// empty string when it can: N nodes of L ranks each, node ranks 0..N-1,
/// local ranks 0..L-1 once per node, every rank agreeing on N and L, N > 1
/// and L > 1 (with one node, or one rank per node, the hierarchy is flat).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string hierarchy_problem(
    std::span<const node_layout> table);

/// Every rank's layout, in rank order, over `control` (collective).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<node_layout> gather_layouts(control_plane& control,
                                                                           const node_layout& mine);

/// The layout of every rank from its node name alone (FNV-1a of it, gathered
/// over `control`), placed by place_ranks() as dtrain::run completes a world:
/// nodes numbered by their lowest rank, local ranks in rank order. For
/// communicators made without a context, which knows the launcher's own placement.
[[nodiscard]] DTRAIN_DETAIL_INLINE node_layout layout_from_node_names(control_plane& control,
                                                                      std::string_view node_name);

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/topology/layout-inl.hpp>
#endif
