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
  void set_epoch(std::uint64_t epoch) {
    state_->shard.set_epoch(epoch);
    state_->next = 0;
  }
  /// Starts the epoch over (the data loader calls it as each epoch begins);
  /// a new dataset size lays the shards out again.
  void reset(::torch::optional<std::size_t> new_size = ::torch::nullopt) override {
    state& s = *state_;
    if (new_size && *new_size != s.dataset_size) {
      const std::uint64_t epoch = s.shard.epoch();
      s.shard = dtrain::distributed_sampler(*new_size, s.rank, s.world_size, s.options);
      s.dataset_size = *new_size;
      s.shard.set_epoch(epoch);
    }
    s.next = 0;
  }
  /// The next `batch_size` indices of this rank's shard (fewer at its end);
  /// none when the epoch is over.
  ::torch::optional<std::vector<std::size_t>> next(std::size_t batch_size) override {
    state& s = *state_;
    const auto all = s.shard.indices();
    if (s.next >= all.size()) return ::torch::nullopt;
    const std::size_t n = std::min(batch_size, all.size() - s.next);
    std::vector<std::size_t> out(all.begin() + static_cast<std::ptrdiff_t>(s.next),
                                 all.begin() + static_cast<std::ptrdiff_t>(s.next + n));
    s.next += n;
    return out;
  }
  void save(::torch::serialize::OutputArchive& archive) const override {
    archive.write("epoch", ::torch::tensor(static_cast<std::int64_t>(state_->shard.epoch())),
                  /*is_buffer=*/true);
    archive.write("index", ::torch::tensor(static_cast<std::int64_t>(state_->next)),
                  /*is_buffer=*/true);
  }
  void load(::torch::serialize::InputArchive& archive) override {
    ::torch::Tensor epoch = ::torch::empty({}, ::torch::kInt64);
    ::torch::Tensor index = ::torch::empty({}, ::torch::kInt64);
    archive.read("epoch", epoch, /*is_buffer=*/true);
    archive.read("index", index, /*is_buffer=*/true);
    set_epoch(static_cast<std::uint64_t>(epoch.item<std::int64_t>()));
    state_->next = static_cast<std::size_t>(index.item<std::int64_t>());
  }

  /// Samples per rank and epoch.
  [[nodiscard]] std::size_t size() const noexcept { return state_->shard.size(); }
  [[nodiscard]] const dtrain::distributed_sampler& shard() const noexcept { return state_->shard; }

 private:
  struct state {
    dtrain::distributed_sampler shard;
    sampler_options options;
    std::size_t dataset_size;
    int rank;
    int world_size;
    std::size_t next = 0;  // into this epoch's shard
  };
  std::shared_ptr<state> state_;
};

}  // namespace dtrain::torch
