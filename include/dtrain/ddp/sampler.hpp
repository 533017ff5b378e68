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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE distributed_sampler::distributed_sampler(std::size_t dataset_size, int rank,
                                                              int world_size,
                                                              sampler_options options)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), options_(options) {
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw config_error("distributed_sampler: rank " + std::to_string(rank) + " of world size " +
                       std::to_string(world_size) + " is not a rank of a world");
  }
  const auto n = static_cast<std::size_t>(world_size);
  const std::size_t per_rank = options.drop_last ? dataset_size / n : (dataset_size + n - 1) / n;
  if (per_rank == 0) {
    throw config_error("distributed_sampler: " + std::to_string(dataset_size) + " samples for " +
                       std::to_string(world_size) + " ranks leaves rank " + std::to_string(rank) +
                       " nothing" + (options.drop_last ? " with drop_last" : ""));
  }
  set_epoch(0);
}

DTRAIN_DETAIL_INLINE void distributed_sampler::set_position(sampler_position p) {
  std::vector<std::size_t> all(dataset_size_);
  std::iota(all.begin(), all.end(), std::size_t{0});
  if (options_.shuffle) shuffle(all, options_.seed + p.epoch);
  const auto n = static_cast<std::size_t>(world_size_);
  const std::size_t start =
      static_cast<std::size_t>(std::min<std::uint64_t>(p.offset, dataset_size_));
  std::size_t left = dataset_size_ - start;
  // Padding repeats the start of the permutation, as often as needed (tiny datasets).
  std::size_t total = options_.drop_last ? left / n * n : (left + n - 1) / n * n;
  indices_.clear();
  for (std::size_t i = static_cast<std::size_t>(rank_); i < total; i += n) {
    const std::size_t at = start + i;
    indices_.push_back(at < dataset_size_ ? all[at] : all[(at - dataset_size_) % dataset_size_]);
  }
  epoch_ = p.epoch;
  start_ = start;
  cursor_ = 0;
}

DTRAIN_DETAIL_INLINE sampler_position distributed_sampler::position() const noexcept {
  const std::size_t dealt = start_ + cursor_ * static_cast<std::size_t>(world_size_);
  return {.epoch = epoch_, .offset = std::min(dealt, dataset_size_)};
}

DTRAIN_DETAIL_INLINE std::span<const std::size_t> distributed_sampler::next_batch(
    std::size_t batch_size) {
  if (batch_size == 0) throw config_error("distributed_sampler::next_batch: batch_size is 0");
  const std::span<const std::size_t> rest = std::span<const std::size_t>(indices_).subspan(cursor_);
  const std::span<const std::size_t> batch = rest.first(std::min(batch_size, rest.size()));
  cursor_ += batch.size();
  return batch;
}

DTRAIN_DETAIL_INLINE std::vector<std::span<const std::size_t>> distributed_sampler::batches(
    std::size_t batch_size) const {
  if (batch_size == 0) throw config_error("distributed_sampler::batches: batch_size is 0");
  std::vector<std::span<const std::size_t>> out;
  std::span<const std::size_t> all = indices();
  for (std::size_t at = 0; at < all.size(); at += batch_size) {
    out.push_back(all.subspan(at, std::min(batch_size, all.size() - at)));
  }
  return out;
}

DTRAIN_DETAIL_INLINE void distributed_sampler::shuffle(std::vector<std::size_t>& v,
                                                       std::uint64_t seed) {
  std::uint64_t state = seed;
  auto next = [&state] {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (std::size_t i = v.size(); i > 1; --i) {
    auto j = static_cast<std::size_t>(next() % i);  // bias below 2^-40 for any real dataset
    std::swap(v[i - 1], v[j]);
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
