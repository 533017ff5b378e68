#pragma once
/// @file
/// dtrain::torch::distributed_sampler: dtrain::distributed_sampler as a
/// torch::data sampler.

#include <dtrain/dtrain.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace dtrain::torch {

/// dtrain::distributed_sampler as a torch::data sampler (for
/// torch::data::make_data_loader, or next() by hand): this rank's shard of
/// each epoch, the same number of batches on every rank. Call set_epoch(e)
/// before each epoch to reshuffle.
///
/// Copies share one state, as copies of a torch::nn module holder share the
/// module: make_data_loader keeps a copy of the sampler, and set_epoch(e) on
/// yours reaches it (PyTorch's DataLoader holds the sampler itself).
class distributed_sampler final
    : public ::torch::data::samplers::Sampler<std::vector<std::size_t>> {
 public:
  /// This rank's shard, with rank and world size from `w`. Throws
  /// config_error as dtrain::distributed_sampler does.
  distributed_sampler(std::size_t dataset_size, const world& w, sampler_options options = {})
      : distributed_sampler(dataset_size, w.rank.value_or(-1), w.world_size.value_or(0), options) {}
  distributed_sampler(std::size_t dataset_size, int rank, int world_size,
                      sampler_options options = {})
      : state_(std::make_shared<state>(
            state{.shard = dtrain::distributed_sampler(dataset_size, rank, world_size, options),
                  .options = options,
                  .dataset_size = dataset_size,
                  .rank = rank,
                  .world_size = world_size})) {}

  /// Reshuffles for `epoch` and starts over (every copy).
  void set_epoch(std::uint64_t epoch) { state_->shard.set_epoch(epoch); }
  /// Starts the epoch over (the data loader calls it as each epoch begins);
  /// a new dataset size lays the shards out again.
  void reset(::torch::optional<std::size_t> new_size = ::torch::nullopt) override {
    state& s = *state_;
    const std::uint64_t epoch = s.shard.epoch();
    if (new_size && *new_size != s.dataset_size) {
      s.shard = dtrain::distributed_sampler(*new_size, s.rank, s.world_size, s.options);
      s.dataset_size = *new_size;
    }
    s.shard.set_epoch(epoch);
  }
  /// The next `batch_size` indices of this rank's shard (fewer at its end);
  /// none when the epoch is over.
  ::torch::optional<std::vector<std::size_t>> next(std::size_t batch_size) override {
    const std::span<const std::size_t> batch = state_->shard.next_batch(batch_size);
    if (batch.empty()) return ::torch::nullopt;
    return std::vector<std::size_t>(batch.begin(), batch.end());
  }
  /// The position (dtrain::sampler_position: the epoch and the samples of its
  /// global order handed out), as LibTorch's serialisation of a sampler.
  void save(::torch::serialize::OutputArchive& archive) const override {
    const sampler_position p = state_->shard.position();
    archive.write("epoch", ::torch::tensor(static_cast<std::int64_t>(p.epoch)), /*is_buffer=*/true);
    archive.write("offset", ::torch::tensor(static_cast<std::int64_t>(p.offset)),
                  /*is_buffer=*/true);
  }
  void load(::torch::serialize::InputArchive& archive) override {
    ::torch::Tensor epoch = ::torch::empty({}, ::torch::kInt64);
    ::torch::Tensor offset = ::torch::empty({}, ::torch::kInt64);
    archive.read("epoch", epoch, /*is_buffer=*/true);
    archive.read("offset", offset, /*is_buffer=*/true);
    state_->shard.set_position({.epoch = static_cast<std::uint64_t>(epoch.item<std::int64_t>()),
                                .offset = static_cast<std::uint64_t>(offset.item<std::int64_t>())});
  }

  /// Samples per rank left in this epoch.
  [[nodiscard]] std::size_t size() const noexcept { return state_->shard.size(); }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return state_->shard.epoch(); }
  /// The dtrain sampler underneath, which every copy shares (a checkpoint
  /// registers it: dtrain::torch::add_sampler).
  [[nodiscard]] const dtrain::distributed_sampler& shard() const noexcept { return state_->shard; }
  [[nodiscard]] dtrain::distributed_sampler& shard() noexcept { return state_->shard; }

 private:
  struct state {
    dtrain::distributed_sampler shard;
    sampler_options options;
    std::size_t dataset_size;
    int rank;
    int world_size;
  };
  std::shared_ptr<state> state_;
};

}  // namespace dtrain::torch
