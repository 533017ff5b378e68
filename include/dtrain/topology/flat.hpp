#pragma once
/// @file
/// topology::flat: every collective runs on one communicator over the world.
/// The other model of the slot is topology::hierarchical (hierarchical.hpp).

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/topology/accumulate.hpp>
#include <dtrain/topology/layout.hpp>
#include <dtrain/topology/sequence.hpp>

#include <cstddef>
#include <string>
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

  /// The communicators a topology runs its collectives on, made once per
  /// user (DistributedDataParallel makes one). Flat: the world itself.
  template <communicator C>
  class group {
   public:
    /// Nothing collective happens: flat needs no layout and no new communicator.
    group(C& world, control_plane /*control*/, const node_layout& /*mine*/) noexcept
        : world_(&world) {}

    [[nodiscard]] C& world() noexcept { return *world_; }
    /// Whether collectives run hierarchically (never, here).
    [[nodiscard]] static constexpr bool hierarchical() noexcept { return false; }
    /// A buffer whose length is a multiple of this many elements needs no extra collective.
    [[nodiscard]] static constexpr std::size_t granularity() noexcept { return 1; }
    /// Elements of scratch (`shard`) an allreduce of `count` elements needs: none.
    [[nodiscard]] static constexpr std::size_t shard_count(std::size_t /*count*/) noexcept {
      return 0;
    }
    /// "flat (gloo, 4 ranks)"
    [[nodiscard]] std::string describe() const {
      return "flat (" + std::string(C::name) + ", " + std::to_string(world_->size()) + " ranks)";
    }

    /// In place on `data`, ordered after `stream` where the engine takes one.
    work allreduce(buffer data, buffer /*shard*/, reduce_op op, stream_handle stream = nullptr) {
      return detail::allreduce_on(*world_, data, data, op, stream);
    }
    /// The same without scratch (flat needs none).
    work allreduce(buffer data, reduce_op op) { return world_->allreduce(data, data, op); }
    /// Where this rank's part of a reduce_scatter() lies: part world().rank().
    [[nodiscard]] std::size_t shard_position() const {
      return static_cast<std::size_t>(world_->rank());
    }
    /// The reduction of `data` over every rank, this rank's part of it
    /// (part shard_position() of size()) into `out`.
    work reduce_scatter(buffer data, buffer /*shard*/, buffer out, reduce_op op,
                        stream_handle stream = nullptr) {
      return detail::reduce_scatter_on(*world_, data, out, op, stream);
    }
    /// Every rank's `in` into `data`, each at its shard_position().
    work allgather(buffer in, buffer /*shard*/, buffer data, stream_handle stream = nullptr) {
      return detail::allgather_on(*world_, in, data, stream);
    }

    // With float32 accumulation (topology/accumulate.hpp): `data` is size()
    // parts of 16-bit (or float32) elements; `scratch` holds at least
    // accumulate_scratch_bytes() bytes in data's memory; `sum` is the memory
    // space's float32 sum.

    /// Bytes of scratch an accumulated reduction of `count` elements of `wire` needs.
    [[nodiscard]] std::size_t accumulate_scratch_bytes(std::size_t count, dtype wire) const {
      return detail::flat_accumulate_bytes(count, wire);
    }
    /// In place on `data`: the mean (avg) or sum, summed in float32, rounded once.
    work allreduce_accumulated(buffer data, buffer scratch, reduce_op op, stream_handle stream,
                               const detail::accumulate_sum& sum) {
      return detail::accumulated_allreduce(*world_, data, scratch, op, stream, sum);
    }
    /// This rank's part (shard_position()) into `out`, in out's type.
    work reduce_scatter_accumulated(buffer data, buffer scratch, buffer out, reduce_op op,
                                    stream_handle stream, const detail::accumulate_sum& sum) {
      return detail::accumulated_reduce_scatter(*world_, data, scratch, out, op, stream, sum);
    }
    /// Makes `stream` wait for every collective so far (engines on streams).
    void stream_wait(stream_handle stream) requires requires(C& c, stream_handle s) {
      c.stream_wait(s);
    }
    { world_->stream_wait(stream); }

   private:
    C* world_;
  };
};

}  // namespace dtrain::topology
