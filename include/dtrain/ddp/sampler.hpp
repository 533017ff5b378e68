#pragma once
/// @file
/// distributed_sampler: each rank's share of a dataset's indices, as
/// torch.utils.data.DistributedSampler — disjoint, shuffled by seed and
/// epoch the same way on every rank, and equally long on every rank.

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

/// Splits the indices 0..dataset_size-1 among the ranks.
class distributed_sampler {
 public:
  /// This rank's share, with rank and world size from `w`. Throws
  /// config_error when `w` lacks them or drop_last leaves a rank nothing.
  distributed_sampler(std::size_t dataset_size, const world& w, sampler_options options = {})
      : distributed_sampler(dataset_size, w.rank.value_or(-1), w.world_size.value_or(0), options) {}

  distributed_sampler(std::size_t dataset_size, int rank, int world_size,
                      sampler_options options = {})
      : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), options_(options) {
    if (world_size <= 0 || rank < 0 || rank >= world_size) {
      throw config_error("distributed_sampler: rank " + std::to_string(rank) + " of world size " +
                         std::to_string(world_size) + " is not a rank of a world");
    }
    const auto n = static_cast<std::size_t>(world_size);
    per_rank_ = options.drop_last ? dataset_size / n : (dataset_size + n - 1) / n;
    if (per_rank_ == 0) {
      throw config_error("distributed_sampler: " + std::to_string(dataset_size) + " samples for " +
                         std::to_string(world_size) + " ranks leaves rank " + std::to_string(rank) +
                         " nothing" + (options.drop_last ? " with drop_last" : ""));
    }
    set_epoch(0);
  }

  /// Reshuffles for `epoch` (with shuffle on): every rank computes the same
  /// permutation from seed + epoch, then takes every world_size-th index.
  void set_epoch(std::uint64_t epoch) {
    epoch_ = epoch;
    std::vector<std::size_t> all(dataset_size_);
    std::iota(all.begin(), all.end(), std::size_t{0});
    if (options_.shuffle) shuffle(all, options_.seed + epoch);
    const auto n = static_cast<std::size_t>(world_size_);
    const std::size_t total = per_rank_ * n;
    // Padding repeats the start of the list, as often as needed (tiny datasets).
    for (std::size_t i = 0; all.size() < total; ++i) all.push_back(all[i]);
    indices_.clear();
    for (std::size_t i = static_cast<std::size_t>(rank_); i < total; i += n)
      indices_.push_back(all[i]);
  }

  /// This rank's indices for the current epoch; size() of them.
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept { return indices_; }
  /// Samples per rank: the same on every rank, so every rank runs the same steps.
  [[nodiscard]] std::size_t size() const noexcept { return per_rank_; }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// indices() cut into batches of `batch_size` (the last one may be shorter;
  /// every rank gets the same number of batches of the same sizes).
  [[nodiscard]] std::vector<std::span<const std::size_t>> batches(std::size_t batch_size) const {
    if (batch_size == 0) throw config_error("distributed_sampler::batches: batch_size is 0");
    std::vector<std::span<const std::size_t>> out;
    std::span<const std::size_t> all = indices_;
    for (std::size_t at = 0; at < all.size(); at += batch_size) {
      out.push_back(all.subspan(at, std::min(batch_size, all.size() - at)));
    }
    return out;
  }

 private:
  // Fisher-Yates driven by splitmix64: the same permutation with every
  // standard library (std::shuffle's algorithm is unspecified).
  static void shuffle(std::vector<std::size_t>& v, std::uint64_t seed) {
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

  std::size_t dataset_size_;
  int rank_;
  int world_size_;
  sampler_options options_;
  std::size_t per_rank_ = 0;
  std::uint64_t epoch_ = 0;
  std::vector<std::size_t> indices_;
};

}  // namespace dtrain
