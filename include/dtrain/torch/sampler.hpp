#pragma once
/// @file
/// dtrain::torch::distributed_sampler: dtrain::distributed_sampler as a
/// torch::data sampler.

#include <dtrain/dtrain.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtrain::torch {

/// dtrain::distributed_sampler as a torch::data sampler (for
/// torch::data::make_data_loader, or next() by hand): this rank's shard of
/// each epoch, the same number of batches on every rank. Call set_epoch(e)
/// before each epoch to reshuffle.
class distributed_sampler final
    : public ::torch::data::samplers::Sampler<std::vector<std::size_t>> {
 public:
  distributed_sampler(std::size_t dataset_size, const world& w, sampler_options options = {})
      : distributed_sampler(dataset_size, w.rank.value_or(-1), w.world_size.value_or(0), options) {}
  distributed_sampler(std::size_t dataset_size, int rank, int world_size,
                      sampler_options options = {})
      : shard_(dataset_size, rank, world_size, options),
        options_(options),
        dataset_size_(dataset_size),
        rank_(rank),
        world_size_(world_size) {}

  /// Reshuffles for `epoch` and starts over.
  void set_epoch(std::uint64_t epoch) {
    shard_.set_epoch(epoch);
    next_ = 0;
  }
  /// Starts the epoch over; a new dataset size lays the shards out again.
  void reset(::torch::optional<std::size_t> new_size) override {
    if (new_size && *new_size != dataset_size_) {
      const std::uint64_t epoch = shard_.epoch();
      shard_ = dtrain::distributed_sampler(*new_size, rank_, world_size_, options_);
      dataset_size_ = *new_size;
      shard_.set_epoch(epoch);
    }
    next_ = 0;
  }
  /// The next `batch_size` indices of this rank's shard (fewer at its end);
  /// none when the epoch is over.
  ::torch::optional<std::vector<std::size_t>> next(std::size_t batch_size) override {
    const auto all = shard_.indices();
    if (next_ >= all.size()) return ::torch::nullopt;
    const std::size_t n = std::min(batch_size, all.size() - next_);
    std::vector<std::size_t> out(all.begin() + static_cast<std::ptrdiff_t>(next_),
                                 all.begin() + static_cast<std::ptrdiff_t>(next_ + n));
    next_ += n;
    return out;
  }
  void save(::torch::serialize::OutputArchive& archive) const override {
    archive.write("epoch", ::torch::tensor(static_cast<std::int64_t>(shard_.epoch())),
                  /*is_buffer=*/true);
    archive.write("index", ::torch::tensor(static_cast<std::int64_t>(next_)), /*is_buffer=*/true);
  }
  void load(::torch::serialize::InputArchive& archive) override {
    ::torch::Tensor epoch = ::torch::empty({}, ::torch::kInt64);
    ::torch::Tensor index = ::torch::empty({}, ::torch::kInt64);
    archive.read("epoch", epoch, /*is_buffer=*/true);
    archive.read("index", index, /*is_buffer=*/true);
    set_epoch(static_cast<std::uint64_t>(epoch.item<std::int64_t>()));
    next_ = static_cast<std::size_t>(index.item<std::int64_t>());
  }

  /// Samples per rank and epoch.
  [[nodiscard]] std::size_t size() const noexcept { return shard_.size(); }
  [[nodiscard]] const dtrain::distributed_sampler& shard() const noexcept { return shard_; }

 private:
  dtrain::distributed_sampler shard_;
  sampler_options options_;
  std::size_t dataset_size_;
  int rank_;
  int world_size_;
  std::size_t next_ = 0;
};

}  // namespace dtrain::torch
