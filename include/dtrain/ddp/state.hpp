#pragma once
/// @file
/// What DistributedDataParallel keeps per parameter and per bucket, each in
/// one struct (c10d's Reducer: VariableIndex and Bucket): where a gradient
/// sits in its bucket, and what the current step has done with it.

#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/storage.hpp>

#include <cstddef>
#include <cstdint>
#include <ranges>
#include <vector>

namespace dtrain::detail {

/// One parameter as DDP holds it.
struct ddp_variable {
  parameter param;  ///< as the model showed it; `param.gradient` is where the gradient is now
  void* original = nullptr;  ///< the model's own gradient pointer, given back at the end
  std::size_t bucket = 0;    ///< its bucket in the current layout
  std::size_t offset = 0;    ///< bytes into that bucket
  bool view = false;         ///< the gradient lives in the bucket (no copy in or out)
  // The current step; reset when it completes.
  bool marked = false;   ///< ready: counted in its bucket's pending count
  bool touched = false;  ///< this rank gave it a gradient (a mark, or one inside no_sync())
  bool zeroed = false;   ///< contributes zero: its bucket slice was zeroed, nothing to copy in
  bool unused = false;   ///< prepare_for_backward() said the coming backward pass does not reach it
  // Across steps.
  bool touched_last = false;  ///< `touched` in the last completed step (used_anywhere())
  bool used = false;          ///< some rank used it in the steps reported on (report_unused)
};

/// One bucket: its layout, its storage in the memory space of the backend,
/// and where the current step is with it.
template <class Memory>
struct ddp_bucket {
  bucket_info info;
  flat_storage<Memory> grads;  ///< the gradients, laid out as `info` says
  flat_storage<Memory> wire;   ///< their 16-bit copy, with gradient compression
  flat_storage<Memory> shard;  ///< the topology's scratch (hierarchical)
  std::size_t moved = 0;       ///< elements the collective moves: the slots, padded to the topology
  std::size_t pending = 0;     ///< its parameters not yet marked in this step
  bool ready = false;          ///< every parameter marked: may be launched in its turn
  std::uint64_t span = 0;      ///< its timeline span, from launch to completion
  std::int64_t span_reduce = 0;  ///< when its reduction started (timeline on)
};

/// The parameters of `variables`, as a random-access view (basic_ddp::parameters()).
using parameter_view =
    std::ranges::transform_view<std::ranges::ref_view<const std::vector<ddp_variable>>,
                                parameter ddp_variable::*>;

[[nodiscard]] inline parameter_view parameters_of(const std::vector<ddp_variable>& variables) {
  return parameter_view(std::ranges::ref_view(variables), &ddp_variable::param);
}

}  // namespace dtrain::detail
