#pragma once
/// @file
/// Reductions with float32 accumulation, for 16-bit data: each rank receives
/// the 16-bit blocks of its part from every rank (an alltoall), sums them in
/// float32 in rank order, and (an allreduce) the results travel back in 16
/// bits by an allgather. Half of float32's bytes on the wire, one rounding
/// whatever the number of ranks, the same bits on every rank (each part is
/// summed by one rank). Megatron-LM's reduce-scatter with float32
/// accumulation; the engines' own 16-bit reductions round every partial sum.
///
/// The sum is the caller's (`accumulate_sum`: DistributedDataParallel passes
/// its memory space's accumulate(), a loop on the host, a kernel on a GPU):
/// on an engine that orders collectives on streams it is enqueued on the
/// stream of the communicator whose alltoall it follows, so every step is
/// enqueued at once; otherwise it runs on the thread that drives the work,
/// once the alltoall has finished. topology::flat and topology::hierarchical
/// call these; the hierarchical topology runs one level per communicator
/// (node-local, then cross-node, the partial sums crossing in float32).

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/error.hpp>
#include <dtrain/topology/sequence.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// out[j] = Out(sum over `blocks` blocks of `in` (out.count elements each),
/// added in block order in float32, / divisor), enqueued on `stream` where
/// the memory has streams. out.type and in.type: float32, float16 or bfloat16.
using accumulate_sum =
    std::function<void(buffer out, buffer in, std::size_t blocks, float divisor, stream_handle)>;

/// Scratch offsets are kept on this alignment (device kernels read whole words).
inline constexpr std::size_t accumulate_alignment = 256;

[[nodiscard]] constexpr std::size_t accumulate_align(std::size_t bytes) noexcept {
  return (bytes + accumulate_alignment - 1) / accumulate_alignment * accumulate_alignment;
}

/// A byte range of `scratch` as `count` elements of `type`.
[[nodiscard]] inline buffer scratch_part(const buffer& scratch, std::size_t offset,
                                         std::size_t count, dtype type) noexcept {
  return {static_cast<std::byte*>(scratch.data) + offset, count, type, scratch.where,
          scratch.device};
}

/// The checks every accumulated reduction shares: op, types, counts, scratch.
inline void check_accumulated(const argument_check& check, const buffer& data,
                              const buffer& scratch, std::size_t needed, reduce_op op,
                              std::size_t ranks) {
  if (op != reduce_op::sum && op != reduce_op::avg)
    check.fail("float32 accumulation sums: the op must be sum or avg");
  if (data.type != dtype::float16 && data.type != dtype::bfloat16 && data.type != dtype::float32)
    check.fail("float32 accumulation takes float16, bfloat16 or float32 data, not " +
               std::string(to_string(data.type)));
  if (data.count % ranks != 0)
    check.fail("the data has " + std::to_string(data.count) + " elements, not a multiple of the " +
               std::to_string(ranks) + " ranks (one part each)");
  check.reachable(scratch, "scratch", memory_reach{});
  if (scratch.where != data.where)
    check.fail("scratch and data live in different memories (host and device)");
  if (scratch.bytes() < needed)
    check.fail("scratch has " + std::to_string(scratch.bytes()) + " bytes, needs " +
               std::to_string(needed));
}

/// Appends one level's two steps on `c` (lane `lane`): the alltoall of `in`
/// into `received` (after `after` where the engine takes a stream), then the
/// float32 sum of its c.size() blocks into `out`, divided by `divisor`.
template <communicator C>
void push_accumulated_level(std::vector<work_sequence::step>& steps, C& c, int lane,
                            const std::string& where, buffer in, buffer received, buffer out,
                            float divisor, stream_handle after, const accumulate_sum& sum,
                            std::function<void()> before = {}) {
  const std::string level = where.empty() ? where : where + " ";
  steps.push_back({level + "alltoall over " + std::to_string(c.size()) + " ranks",
                   [&c, in, received, after, before = std::move(before)] {
                     if (before) before();
                     if constexpr (requires { c.alltoall(in, received, after); }) {
                       return c.alltoall(in, received, after);
                     } else {
                       (void)after;
                       return c.alltoall(in, received);
                     }
                   },
                   lane, work_sequence::chain});
  steps.push_back({level + "float32 sum of " + std::to_string(c.size()) + " blocks",
                   [&c, received, out, divisor, sum] {
                     sum(out, received, static_cast<std::size_t>(c.size()), divisor,
                         stream_after(c));
                     return work{};  // on the host: done; on a stream: ordered before what follows
                   },
                   lane, work_sequence::chain});
}

/// Scratch bytes of a flat accumulated reduction of `count` elements of `wire`.
[[nodiscard]] constexpr std::size_t flat_accumulate_bytes(std::size_t count, dtype wire) noexcept {
  return accumulate_align(count * size_of(wire));
}

/// In place on `data` (size() parts): alltoall into scratch, the float32 sum
/// of this rank's part (divided by size() for avg) rounded once into
/// scratch, allgather of the parts back into `data`.
template <communicator C>
work accumulated_allreduce(C& world, buffer data, buffer scratch, reduce_op op,
                           stream_handle stream, const accumulate_sum& sum) {
  const auto ranks = static_cast<std::size_t>(world.size());
  const std::string what = describe("allreduce with float32 accumulation",
                                    std::string(to_string(op)) + ", " + shape(data), world.rank(),
                                    world.size(), C::name);
  check_accumulated(argument_check{what}, data, scratch,
                    flat_accumulate_bytes(data.count, data.type), op, ranks);
  const std::size_t q = data.count / ranks;
  const buffer received = scratch_part(scratch, 0, data.count, data.type);
  const buffer mine = scratch_part(scratch, 0, q, data.type);  // block 0, summed in place
  const float divisor = op == reduce_op::avg ? static_cast<float>(ranks) : 1.0f;
  std::vector<work_sequence::step> steps;
  push_accumulated_level(steps, world, 0, "", data, received, mine, divisor, stream, sum);
  steps.push_back(
      {"allgather over " + std::to_string(world.size()) + " ranks",
       [&world, mine, data] { return allgather_on(world, mine, data, stream_after(world)); }, 0,
       work_sequence::chain});
  return work(std::make_shared<work_sequence>(what, std::move(steps), stream_ordered<C>, nullptr));
}

/// This rank's part (part world.rank() of size()) of the reduction of `data`
/// into `out` (its own type: float32 keeps the sum unrounded).
template <communicator C>
work accumulated_reduce_scatter(C& world, buffer data, buffer scratch, buffer out, reduce_op op,
                                stream_handle stream, const accumulate_sum& sum) {
  const auto ranks = static_cast<std::size_t>(world.size());
  const std::string what = describe("reduce_scatter with float32 accumulation",
                                    std::string(to_string(op)) + ", " + shape(data), world.rank(),
                                    world.size(), C::name);
  const argument_check check{what};
  check_accumulated(check, data, scratch, flat_accumulate_bytes(data.count, data.type), op, ranks);
  check.count(out, data.count / ranks, "output");
  const buffer received = scratch_part(scratch, 0, data.count, data.type);
  const float divisor = op == reduce_op::avg ? static_cast<float>(ranks) : 1.0f;
  std::vector<work_sequence::step> steps;
  push_accumulated_level(steps, world, 0, "", data, received, out, divisor, stream, sum);
  return work(std::make_shared<work_sequence>(what, std::move(steps), stream_ordered<C>, nullptr));
}

}  // namespace dtrain::detail
