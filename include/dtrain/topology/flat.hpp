#pragma once
/// @file
/// topology::flat: every collective runs on one communicator over the world.
/// A hierarchical topology (node-local and cross-node communicators built
/// with split) is the other model of this slot, to come.

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>

#include <string_view>

namespace dtrain::topology {

/// One communicator over the world; collectives go to it unchanged.
struct flat {
  static constexpr std::string_view name = "flat";

  /// How this topology runs an allreduce on `world`: directly.
  template <communicator C>
  static work allreduce(C& world, buffer in, buffer out, reduce_op op) {
    return world.allreduce(in, out, op);
  }
  template <communicator C>
  static work broadcast(C& world, buffer data, int root) {
    return world.broadcast(data, root);
  }
};

}  // namespace dtrain::topology
