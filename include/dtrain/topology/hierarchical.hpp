#pragma once
/// @file
/// topology::hierarchical: an allreduce runs as a node-local reduce-scatter,
/// a cross-node allreduce of each shard (one communicator per local rank),
/// and a node-local allgather. Only 1/L of the data crosses the network per
/// rank (L ranks per node), and the links between nodes carry each shard
/// once per node rather than once per rank: the slow links carry (n-1)/n of
/// what a flat ring of n ranks puts on them, n = N nodes instead of N x L ranks.

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/error.hpp>
#include <dtrain/topology/accumulate.hpp>
#include <dtrain/topology/layout.hpp>
#include <dtrain/topology/sequence.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::topology {

/// Node-local and cross-node communicators, split from the world.
struct hierarchical {
  static constexpr std::string_view name = "hierarchical";
  /// On host engines, a buffer of more than this many bytes travels in chunks
  /// of about this size (at most 8), pipelined: a chunk's node-local steps run
  /// while another chunk crosses the nodes. 0: one piece.
  static constexpr std::size_t default_chunk_bytes = std::size_t{2} << 20;

  /// The communicators of one user (DistributedDataParallel makes one):
  /// `local` (the ranks of this node, by local rank) and `cross` (the ranks
  /// with this local rank, one per node, by node rank), or the world alone
  /// when the nodes do not allow a hierarchy (see hierarchical()).
  template <communicator C>
  class group {
   public:
    /// Collective over `world`: every rank's layout is gathered over
    /// `control`; when every node holds the same number L > 1 of ranks and
    /// there are N > 1 nodes, `world` is split into `local` (color: node rank,
    /// key: local rank) and `cross` (color: local rank, key: node rank).
    /// Otherwise collectives run flat on `world`, and rank 0 prints one line
    /// saying why. `world` must outlive the group. `chunk_bytes`: see
    /// default_chunk_bytes (every rank must pass the same). Throws what
    /// split() throws, and backend_error when a split does not give the expected size.
    group(C& world, control_plane control, const node_layout& mine,
          std::size_t chunk_bytes = default_chunk_bytes)
        : world_(&world), chunk_bytes_(chunk_bytes) {
      const std::vector<node_layout> table = detail::gather_layouts(control, mine);
      why_flat_ = detail::hierarchy_problem(table);
      if (!why_flat_.empty()) {
        if (world.rank() == 0) {
          std::fprintf(stderr, "dtrain: topology::hierarchical runs flat on %d ranks: %s\n",
                       world.size(), why_flat_.c_str());
          std::fflush(stderr);
        }
        return;
      }
      local_.emplace(world.split(mine.node_rank, mine.local_rank));
      cross_.emplace(world.split(mine.local_rank, mine.node_rank));
      if (local_->size() != mine.local_size || local_->rank() != mine.local_rank ||
          cross_->size() != mine.num_nodes || cross_->rank() != mine.node_rank) {
        throw backend_error(
            "topology::hierarchical on rank " + std::to_string(world.rank()) + ": splitting " +
                std::string(C::name) + " gave local rank " + std::to_string(local_->rank()) +
                " of " + std::to_string(local_->size()) + " and cross rank " +
                std::to_string(cross_->rank()) + " of " + std::to_string(cross_->size()) +
                ", the layout says " + std::to_string(mine.local_rank) + " of " +
                std::to_string(mine.local_size) + " and " + std::to_string(mine.node_rank) +
                " of " + std::to_string(mine.num_nodes),
            0);
      }
    }
    group(const group&) = delete;
    group& operator=(const group&) = delete;

    [[nodiscard]] C& world() noexcept { return *world_; }
    /// Whether collectives run hierarchically; false when they run flat (why_flat() says why).
    [[nodiscard]] bool hierarchical() const noexcept { return local_.has_value(); }
    [[nodiscard]] const std::string& why_flat() const noexcept { return why_flat_; }
    /// The node-local communicator; only when hierarchical().
    [[nodiscard]] C& local() { return *local_; }
    /// The cross-node communicator of this local rank; only when hierarchical().
    [[nodiscard]] C& cross() { return *cross_; }

    /// A buffer whose length is a multiple of this many elements (the ranks
    /// per node) needs no extra collectives for a remainder.
    [[nodiscard]] std::size_t granularity() const noexcept {
      return local_ ? static_cast<std::size_t>(local_->size()) : 1;
    }
    /// Elements of scratch (`shard`) an allreduce of `count` elements needs.
    [[nodiscard]] std::size_t shard_count(std::size_t count) const noexcept {
      return local_ ? count / granularity() : 0;
    }
    /// "hierarchical (gloo): 2 nodes x 2 ranks", or "flat (gloo, 3 ranks): uneven nodes: ..."
    [[nodiscard]] std::string describe() const {
      if (!local_) {
        return "flat (" + std::string(C::name) + ", " + std::to_string(world_->size()) +
               " ranks): " + why_flat_;
      }
      return "hierarchical (" + std::string(C::name) + "): " + std::to_string(cross_->size()) +
             " nodes x " + std::to_string(local_->size()) + " ranks";
    }

    /// In place on `data`: the reduction over every rank. `shard` is scratch
    /// of at least shard_count(data.count) elements of data's type in the
    /// same memory, untouched by anyone else until the work completes (one
    /// per collective in flight). Steps: node-local reduce_scatter of the
    /// first L x q elements (q = count / L) into `shard`, cross-node allreduce
    /// of `shard`, node-local allgather back into `data`; the last count - L x q
    /// elements (fewer than L) are reduced by a node-local and a cross-node
    /// allreduce of their own. avg is avg at each step (sum / L, then / N).
    /// On an engine that orders collectives on streams (NCCL) every step is
    /// enqueued now, the first after `stream`; otherwise each step starts when
    /// the previous one has finished, inside test() / wait() of the returned
    /// work, so drive it from the thread that issues this group's collectives.
    /// Throws config_error for a `shard` of the wrong type, memory or size.
    work allreduce(buffer data, buffer shard, reduce_op op, stream_handle stream = nullptr) {
      return run(data, shard, op, stream, nullptr);
    }

    /// The same for host memory, with scratch of its own (held by the work).
    work allreduce(buffer data, reduce_op op) {
      if (!local_ || data.count < granularity()) return run(data, {}, op, nullptr, nullptr);
      if (data.where != memory::host) {
        throw config_error(describe_call(data, op) +
                           ": device memory needs a shard buffer of the caller's "
                           "(allreduce(data, shard, op, stream))");
      }
      auto scratch =
          std::make_shared<std::vector<std::byte>>(shard_count(data.count) * size_of(data.type));
      buffer shard{scratch->data(), shard_count(data.count), data.type, memory::host};
      return run(data, shard, op, nullptr, std::move(scratch));
    }

    /// Where this rank's part of a reduce_scatter() lies (in parts of
    /// data.count / world().size()): local rank x nodes + node rank, so that
    /// a node-local reduce-scatter and then a cross-node one leave it there;
    /// the world rank when the collectives run flat.
    [[nodiscard]] std::size_t shard_position() const {
      if (!local_) return static_cast<std::size_t>(world_->rank());
      return static_cast<std::size_t>(local_->rank()) * static_cast<std::size_t>(cross_->size()) +
             static_cast<std::size_t>(cross_->rank());
    }

    /// The reduction of `data` over every rank, this rank's part of it (part
    /// shard_position() of world().size()) into `out`: a node-local
    /// reduce_scatter into `shard` (scratch of shard_count(data.count)
    /// elements, as for allreduce), then a cross-node reduce_scatter of it
    /// into `out`. Only 1/L of the data crosses the nodes, as in allreduce().
    /// data.count must be a multiple of world().size() (config_error).
    work reduce_scatter(buffer data, buffer shard, buffer out, reduce_op op,
                        stream_handle stream = nullptr) {
      if (!local_) return detail::reduce_scatter_on(*world_, data, out, op, stream);
      const std::string what = detail::describe(
          "hierarchical reduce_scatter", std::string(to_string(op)) + ", " + detail::shape(data),
          world_->rank(), world_->size(), C::name);
      buffer part = two_level_scratch(what, data, shard, out);
      C& local = *local_;
      C& cross = *cross_;
      std::vector<detail::work_sequence::step> steps;
      steps.push_back({"node-local reduce_scatter over " + std::to_string(local.size()) + " ranks",
                       [&local, &cross, data, part, op, stream] {
                         after_other_level(local, cross);
                         return detail::reduce_scatter_on(local, data, part, op, stream);
                       },
                       1, -1});
      steps.push_back({"cross-node reduce_scatter over " + std::to_string(cross.size()) + " nodes",
                       [&local, &cross, part, out, op] {
                         return detail::reduce_scatter_on(cross, part, out, op,
                                                          detail::stream_after(local));
                       },
                       2, 0});
      return work(std::make_shared<detail::work_sequence>(what, std::move(steps),
                                                          detail::stream_ordered<C>, nullptr));
    }

    /// Every rank's `in` into `data`, each at its shard_position(): a
    /// cross-node allgather into `shard` (scratch as for reduce_scatter()),
    /// then a node-local allgather of it into `data`.
    work allgather(buffer in, buffer shard, buffer data, stream_handle stream = nullptr) {
      if (!local_) return detail::allgather_on(*world_, in, data, stream);
      const std::string what = detail::describe("hierarchical allgather", detail::shape(data),
                                                world_->rank(), world_->size(), C::name);
      buffer part = two_level_scratch(what, data, shard, in);
      C& local = *local_;
      C& cross = *cross_;
      std::vector<detail::work_sequence::step> steps;
      steps.push_back({"cross-node allgather over " + std::to_string(cross.size()) + " nodes",
                       [&local, &cross, in, part, stream] {
                         after_other_level(cross, local);
                         return detail::allgather_on(cross, in, part, stream);
                       },
                       2, -1});
      steps.push_back({"node-local allgather over " + std::to_string(local.size()) + " ranks",
                       [&local, &cross, part, data] {
                         return detail::allgather_on(local, part, data,
                                                     detail::stream_after(cross));
                       },
                       1, 0});
      return work(std::make_shared<detail::work_sequence>(what, std::move(steps),
                                                          detail::stream_ordered<C>, nullptr));
    }

    // With float32 accumulation (topology/accumulate.hpp), at each level: the
    // node-local alltoall of the 16-bit parts and their float32 sum (one part
    // of L per rank), the cross-node alltoall of those float32 partial sums
    // and their sum (one part of N), rounded once; for allreduce() the
    // cross-node and then node-local allgathers in 16 bits. The slow links
    // carry the partial sums in float32 (1/L of the data per rank), so that
    // nothing is rounded before the end. The sum of element i: the node's
    // ranks in local order on each node, then the nodes in node order.

    /// Bytes of scratch an accumulated reduction of `count` elements of `wire` needs.
    [[nodiscard]] std::size_t accumulate_scratch_bytes(std::size_t count, dtype wire) const {
      if (!local_) return detail::flat_accumulate_bytes(count, wire);
      const std::size_t q = count / granularity();
      return accumulate_layout(count, wire).gathered + detail::accumulate_align(q * size_of(wire));
    }

    /// In place on `data` (world().size() parts): the mean (avg) or sum, summed
    /// in float32 at both levels, rounded once.
    work allreduce_accumulated(buffer data, buffer scratch, reduce_op op, stream_handle stream,
                               const detail::accumulate_sum& sum) {
      if (!local_) return detail::accumulated_allreduce(*world_, data, scratch, op, stream, sum);
      const std::string what =
          detail::describe("hierarchical allreduce with float32 accumulation",
                           std::string(to_string(op)) + ", " + detail::shape(data), world_->rank(),
                           world_->size(), C::name);
      std::vector<detail::work_sequence::step> steps;
      const buffer result =
          accumulated_levels(steps, what, data, scratch, op, stream, sum, nullptr);
      const accumulate_offsets at = accumulate_layout(data.count, data.type);
      const buffer gathered =
          detail::scratch_part(scratch, at.gathered, data.count / granularity(), data.type);
      C& local = *local_;
      C& cross = *cross_;
      steps.push_back({"cross-node allgather over " + std::to_string(cross.size()) + " nodes",
                       [&cross, result, gathered] {
                         return detail::allgather_on(cross, result, gathered,
                                                     detail::stream_after(cross));
                       },
                       2, detail::work_sequence::chain});
      steps.push_back({"node-local allgather over " + std::to_string(local.size()) + " ranks",
                       [&local, &cross, gathered, data] {
                         return detail::allgather_on(local, gathered, data,
                                                     detail::stream_after(cross));
                       },
                       1, detail::work_sequence::chain});
      return work(std::make_shared<detail::work_sequence>(what, std::move(steps),
                                                          detail::stream_ordered<C>, nullptr));
    }

    /// This rank's part (shard_position()) of the reduction into `out`, in
    /// out's type (float32 keeps the sum unrounded).
    work reduce_scatter_accumulated(buffer data, buffer scratch, buffer out, reduce_op op,
                                    stream_handle stream, const detail::accumulate_sum& sum) {
      if (!local_)
        return detail::accumulated_reduce_scatter(*world_, data, scratch, out, op, stream, sum);
      const std::string what =
          detail::describe("hierarchical reduce_scatter with float32 accumulation",
                           std::string(to_string(op)) + ", " + detail::shape(data), world_->rank(),
                           world_->size(), C::name);
      std::vector<detail::work_sequence::step> steps;
      (void)accumulated_levels(steps, what, data, scratch, op, stream, sum, &out);
      return work(std::make_shared<detail::work_sequence>(what, std::move(steps),
                                                          detail::stream_ordered<C>, nullptr));
    }

    /// Makes `stream` wait, on the device, for every collective so far (engines on streams).
    void stream_wait(stream_handle stream) requires requires(C& c, stream_handle s) {
      c.stream_wait(s);
    }
    {
      world_->stream_wait(stream);
      if (local_) {
        local_->stream_wait(stream);
        cross_->stream_wait(stream);
      }
    }

   private:
    // Engines on streams: `next`'s collectives from now on wait, on the
    // device, for `other`'s so far. The two levels' kernels then never run
    // at once on one GPU (NCCL's guide: two communicators' collectives in
    // flight together on a device can deadlock), also across buckets: a
    // bucket's first step waits for the previous bucket's last one, which ran
    // on the other level (allreduce's pipeline ends on the level it starts
    // on, and needs no such wait).
    static void after_other_level(C& next, C& other) {
      if constexpr (detail::stream_ordered<C>) other.stream_wait(next.stream());
    }

    [[nodiscard]] std::string describe_call(const buffer& data, reduce_op op) const {
      return detail::describe("hierarchical allreduce",
                              std::string(to_string(op)) + ", " + detail::shape(data),
                              world_->rank(), world_->size(), C::name);
    }

    work run(buffer data, buffer shard, reduce_op op, stream_handle stream,
             std::shared_ptr<void> keep_alive) {
      const std::size_t per_node = granularity();
      const std::size_t q = local_ ? data.count / per_node : 0;
      if (q == 0) return detail::allreduce_on(*world_, data, data, op, stream);
      detail::argument_check check{describe_call(data, op)};
      check.same_type(data, shard);
      if (shard.count < q) {
        check.fail("shard has " + std::to_string(shard.count) + " elements, needs " +
                   std::to_string(q) + " (shard_count(" + std::to_string(data.count) + "))");
      }
      check.op_fits(op, data.type);
      buffer head = data;
      head.count = q * per_node;
      buffer part = shard;
      part.count = q;
      buffer rest = data;
      rest.data = static_cast<std::byte*>(data.data) + head.bytes();
      rest.count = data.count - head.count;

      C& local = *local_;
      C& cross = *cross_;
      // Lanes: the communicators, each a queue of its own. On a host engine a
      // large buffer travels in chunks, so that a chunk's node-local
      // reduce-scatter overlaps the previous chunk's cross-node allreduce
      // (bound by the slow link) and its allgather the next one's.
      enum : int { on_local = 1, on_cross = 2 };
      const std::size_t chunks = detail::stream_ordered<C> ? 1 : chunk_count(head.bytes());
      std::vector<detail::work_sequence::step> rs, cross_steps, ag;
      for (std::size_t c = 0, begin = 0; c < chunks; ++c) {
        const std::size_t n = q / chunks + (c < q % chunks ? 1 : 0);  // shard elements of chunk c
        buffer in = head, mine = part;
        in.data = static_cast<std::byte*>(head.data) + begin * per_node * size_of(head.type);
        in.count = n * per_node;
        mine.data = static_cast<std::byte*>(part.data) + begin * size_of(part.type);
        mine.count = n;
        begin += n;
        const std::string which =
            chunks > 1 ? " (chunk " + std::to_string(c + 1) + " of " + std::to_string(chunks) + ")"
                       : "";
        rs.push_back(
            {"node-local reduce_scatter over " + std::to_string(local.size()) + " ranks" + which,
             [&local, in, mine, op, stream] {
               return detail::reduce_scatter_on(local, in, mine, op, stream);
             },
             on_local, -1});
        cross_steps.push_back(
            {"cross-node allreduce over " + std::to_string(cross.size()) + " nodes" + which,
             [&local, &cross, mine, op] {
               return detail::allreduce_on(cross, mine, mine, op, detail::stream_after(local));
             },
             on_cross, -1});
        ag.push_back(
            {"node-local allgather over " + std::to_string(local.size()) + " ranks" + which,
             [&local, &cross, mine, in] {
               return detail::allgather_on(local, mine, in, detail::stream_after(cross));
             },
             on_local, -1});
      }
      if (rest.count > 0) {
        rs.push_back(
            {"node-local allreduce of the last " + std::to_string(rest.count) + " elements",
             [&local, rest, op] {
               return detail::allreduce_on(local, rest, rest, op, detail::stream_after(local));
             },
             on_local, -1});
        cross_steps.push_back(
            {"cross-node allreduce of the last " + std::to_string(rest.count) + " elements",
             [&cross, rest, op] {
               return detail::allreduce_on(cross, rest, rest, op, detail::stream_after(cross));
             },
             on_cross, -1});
      }
      // List order is each lane's order: every reduce-scatter, then the
      // cross-node steps, then the allgathers; each waits for its own chunk's step before.
      std::vector<detail::work_sequence::step> steps;
      const int crosses = static_cast<int>(rs.size());
      for (auto& x : rs) steps.push_back(std::move(x));
      for (std::size_t i = 0; i < cross_steps.size(); ++i) {
        cross_steps[i].after = static_cast<int>(i);
        steps.push_back(std::move(cross_steps[i]));
      }
      for (std::size_t i = 0; i < ag.size(); ++i) {
        ag[i].after = crosses + static_cast<int>(i);
        steps.push_back(std::move(ag[i]));
      }
      return work(std::make_shared<detail::work_sequence>(describe_call(data, op), std::move(steps),
                                                          detail::stream_ordered<C>,
                                                          std::move(keep_alive)));
    }

    // Where an accumulated reduction of `count` elements of `wire` keeps its
    // parts in the scratch: what the node-local alltoall receives (later the
    // cross-node one's float32 blocks), the node-local float32 partial sums
    // (later the rounded result), the cross-node allgather's output.
    struct accumulate_offsets {
      std::size_t partial = 0;
      std::size_t gathered = 0;
    };
    [[nodiscard]] accumulate_offsets accumulate_layout(std::size_t count, dtype wire) const {
      const std::size_t q = count / granularity();
      const std::size_t received = std::max(count * size_of(wire), q * size_of(dtype::float32));
      const std::size_t partial = detail::accumulate_align(received);
      return {partial, partial + detail::accumulate_align(q * size_of(dtype::float32))};
    }

    // The two levels' alltoalls and sums of an accumulated reduction; the
    // result (this rank's part, rounded to data's type) goes to `*out`, or
    // to the scratch (returned) for the allgathers that follow.
    buffer accumulated_levels(std::vector<detail::work_sequence::step>& steps,
                              const std::string& what, const buffer& data, const buffer& scratch,
                              reduce_op op, stream_handle stream, const detail::accumulate_sum& sum,
                              const buffer* out) {
      const std::size_t ranks = static_cast<std::size_t>(world_->size());
      const detail::argument_check check{what};
      detail::check_accumulated(check, data, scratch,
                                accumulate_scratch_bytes(data.count, data.type), op, ranks);
      const std::size_t q = data.count / granularity();  // the node-local part
      const std::size_t r = data.count / ranks;          // this rank's part
      const accumulate_offsets at = accumulate_layout(data.count, data.type);
      const buffer received = detail::scratch_part(scratch, 0, data.count, data.type);
      const buffer partial = detail::scratch_part(scratch, at.partial, q, dtype::float32);
      const buffer crossed = detail::scratch_part(scratch, 0, q, dtype::float32);
      buffer result = detail::scratch_part(scratch, at.partial, r, data.type);
      if (out) {
        check.count(*out, r, "output");
        result = *out;
      }
      C& local = *local_;
      C& cross = *cross_;
      const float divisor = op == reduce_op::avg ? static_cast<float>(ranks) : 1.0f;
      detail::push_accumulated_level(steps, local, 1, "node-local", data, received, partial, 1.0f,
                                     stream, sum,
                                     [&local, &cross] { after_other_level(local, cross); });
      detail::push_accumulated_level(steps, cross, 2, "cross-node", partial, crossed, result,
                                     divisor, detail::stream_after(local), sum);
      return result;
    }

    // The node's part of `data` in `shard` for a two-level reduce_scatter or
    // allgather whose rank part is `part` (data.count / world size elements).
    [[nodiscard]] buffer two_level_scratch(const std::string& what, const buffer& data,
                                           const buffer& shard, const buffer& part) const {
      detail::argument_check check{what};
      check.same_type(data, shard);
      check.same_type(data, part);
      const auto ranks = static_cast<std::size_t>(world_->size());
      if (data.count % ranks != 0 || part.count != data.count / ranks) {
        check.fail("the whole has " + std::to_string(data.count) + " elements and a rank's part " +
                   std::to_string(part.count) + "; the whole must be " + std::to_string(ranks) +
                   " parts of that size");
      }
      buffer node = shard;
      node.count = shard_count(data.count);
      if (shard.count < node.count) {
        check.fail("shard has " + std::to_string(shard.count) + " elements, needs " +
                   std::to_string(node.count) + " (shard_count(" + std::to_string(data.count) +
                   "))");
      }
      return node;
    }

    // Chunks of a host buffer of `bytes`: about chunk_bytes_ each, at most 8.
    [[nodiscard]] std::size_t chunk_count(std::size_t bytes) const noexcept {
      if (chunk_bytes_ == 0) return 1;
      return std::clamp<std::size_t>(bytes / chunk_bytes_, 1, 8);
    }

    C* world_;
    std::optional<C> local_;
    std::optional<C> cross_;
    std::string why_flat_;
    std::size_t chunk_bytes_;
  };
};

}  // namespace dtrain::topology
