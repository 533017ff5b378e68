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
/// node_name(env), or "?" where there is none: for a name in a report or a
/// metrics label, which is not worth failing the training for.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string node_name_or_unknown(const environment& env);

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
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string encode_placement_error(std::string_view message);

/// Rank `rank`'s entry of a table of `size` ranks; throws rank 0's
/// config_error when placing failed there, and a rendezvous_error naming
/// `where` ("store key dtrain/job/world/placement") when the value is malformed.
[[nodiscard]] DTRAIN_DETAIL_INLINE placement decode_placement(const std::string& where,
                                                              std::string_view value, int rank,
                                                              int size);

/// Places every rank (reports[i] is rank i). When every report is complete,
/// each keeps what its launcher said. Otherwise ranks are grouped by node
/// name: nodes are numbered in the order of their lowest rank, local ranks
/// follow the rank order within a node. Throws config_error, naming the
/// ranks and variables, when the ranks disagree about the world size or a
/// known field contradicts the grouping.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<placement> place_ranks(
    const std::vector<rank_report>& reports);

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/placement-inl.hpp>
#endif
