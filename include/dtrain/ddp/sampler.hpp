#pragma once
/// @file
/// distributed_sampler: each rank's share of a dataset's indices, as
/// torch.utils.data.DistributedSampler — disjoint, shuffled by seed and
/// epoch the same way on every rank, and equally long on every rank.

#include <dtrain/config.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace dtrain {

/// Options of distributed_sampler. Aggregate: `{.seed = 42, .drop_last = true}`.
struct sampler_options {
  bool shuffle = true;     ///< a new permutation every epoch (seed + epoch)
  std::uint64_t seed = 0;  ///< must be the same on every rank
  /// Drop the tail that does not divide evenly among the ranks, instead of
  /// padding with indices from the start (which repeats a few samples).
  bool drop_last = false;
};

/// Where a sampler stands in the global sample order: the epoch, and how many
/// samples of that epoch's permutation the ranks together have been handed.
/// Independent of the world size, so a job that changes size continues the
/// same global order.
struct sampler_position {
  std::uint64_t epoch = 0;
  std::uint64_t offset = 0;
};

/// Splits the indices 0..dataset_size-1 among the ranks.
class distributed_sampler {
 public:
  /// This rank's share, with rank and world size from `w`. Throws
  /// config_error when `w` lacks them or drop_last leaves a rank nothing.
  distributed_sampler(std::size_t dataset_size, const world& w, sampler_options options = {})
      : distributed_sampler(dataset_size, w.rank.value_or(-1), w.world_size.value_or(0), options) {}

  distributed_sampler(std::size_t dataset_size, int rank, int world_size,
                      sampler_options options = {});

  /// Reshuffles for `epoch` (with shuffle on): every rank computes the same
  /// permutation from seed + epoch, then takes every world_size-th index.
  /// Starts the epoch from its beginning (position {epoch, 0}).
  void set_epoch(std::uint64_t epoch) { set_position({.epoch = epoch, .offset = 0}); }

  /// Continues `p.epoch` after its first `p.offset` samples of the global
  /// order (what position() said, on this world or another): the rest of the
  /// epoch's permutation is dealt among this world's ranks, padded (or, with
  /// drop_last, cut) to the same count on every rank. With the same world
  /// size, the ranks get exactly the indices they had left.
  void set_position(sampler_position p);

  /// Where this epoch stands: samples of the global order handed out by
  /// next_batch() on all ranks together (what a checkpoint saves).
  [[nodiscard]] sampler_position position() const noexcept;

  /// This rank's next batch of at most `batch_size` indices, empty once the
  /// epoch is done; moves position() on. Every rank gets batches of the same sizes.
  [[nodiscard]] std::span<const std::size_t> next_batch(std::size_t batch_size);

  /// This rank's indices for the current epoch (from the position set, all
  /// of them: next_batch() does not shorten them); size() of them.
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept { return indices_; }
  /// Samples per rank in this epoch (from the position set): the same on
  /// every rank, so every rank runs the same steps.
  [[nodiscard]] std::size_t size() const noexcept { return indices_.size(); }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// indices() cut into batches of `batch_size` (the last one may be shorter;
  /// every rank gets the same number of batches of the same sizes).
  [[nodiscard]] std::vector<std::span<const std::size_t>> batches(std::size_t batch_size) const;

 private:
  // Fisher-Yates driven by splitmix64: the same permutation with every
  // standard library (std::shuffle's algorithm is unspecified).
  static void shuffle(std::vector<std::size_t>& v, std::uint64_t seed);

  std::size_t dataset_size_;
  int rank_;
  int world_size_;
  sampler_options options_;
  std::uint64_t epoch_ = 0;
  std::size_t start_ = 0;   // samples of the global order before this rank's indices_
  std::size_t cursor_ = 0;  // indices_ handed out by next_batch()
  std::vector<std::size_t> indices_;
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/sampler-inl.hpp>
#endif
