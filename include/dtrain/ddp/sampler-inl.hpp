#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/sampler.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/sampler.hpp, not this file.

#include <dtrain/ddp/sampler.hpp>

namespace dtrain {

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

}  // namespace dtrain
