#pragma once
/// @file
/// dtrain::checkpoint: one step's state of every rank, saved consistently and
/// resumed from. Register the state once (parameters, optimizer state, the
/// sampler, anything else); then restore() on start and step() after each
/// training step:
///
///   dtrain::checkpoint ckpt(ctx, {.dir = "ckpt", .every = 100});
///   ckpt.add(ddp.parameters()).add("momentum", velocity).add(sampler);
///   ckpt.restore();                        // the newest whole checkpoint, if any
///   for (; sampler.epoch() < epochs; sampler.set_epoch(sampler.epoch() + 1))
///     for (auto batch = sampler.next_batch(32); !batch.empty(); batch = sampler.next_batch(32)) {
///       ... forward, backward, synchronize, optimizer step ...
///       ckpt.step();                       // saves every 100th step
///     }
///
/// A save is a two-phase commit over the control plane: every rank writes its
/// part into `DIR/step-<N>.partial` (fsync'd, checksummed), the ranks agree that
/// all parts were written, and only then rank 0 writes the manifest and
/// renames the directory to `DIR/step-<N>`; the older checkpoints beyond `keep`
/// are removed after that. A rank that dies or fails during a save leaves no
/// committed step. restore() takes the newest step whose manifest and files
/// check out (naming each one it skips), checks that its entries are the
/// registered ones (names, types, shapes), and only then changes memory.
/// Every rank must see the same DIR (one machine, or a shared file system).
///
/// The memory tier (checkpoint_options::memory_every) saves as often as every
/// step into memory each node keeps beyond its workers' lives (dtrun's agent
/// owns it), in the same format, so that a restarted worker loses at most a
/// step and reads no disk.
///
/// The parts: the entries and what a save takes of them (registry.hpp), the
/// storage seam (tier.hpp) and its tiers (disk_tier.hpp, memory_tier.hpp),
/// what a directory keeps (retention.hpp), the files (format.hpp); this
/// class says when to save and which tier a restore takes.

#include <dtrain/backend/types.hpp>
#include <dtrain/checkpoint/disk_tier.hpp>
#include <dtrain/checkpoint/format.hpp>
#include <dtrain/checkpoint/interval.hpp>
#include <dtrain/checkpoint/memory_tier.hpp>
#include <dtrain/checkpoint/options.hpp>
#include <dtrain/checkpoint/registry.hpp>
#include <dtrain/checkpoint/tier.hpp>
#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/control/verdict.hpp>
#include <dtrain/ddp/loss_scaler.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/sampler.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/diagnostics/metrics.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain {

/// One step's state of every rank: saved consistently, resumed from. See the
/// file's comment. Every rank constructs it, registers the same entries (per
/// scope) in the same way, and calls restore(), step() and save() together.
class checkpoint {
 public:
  /// Every rank together. Throws config_error, on every rank, when the ranks'
  /// every, asynchronous, memory_every or memory_budget differ (naming rank
  /// 0's and the first that differs), or bad options (the rank's own).
  checkpoint(dtrain::control_plane plane, checkpoint_options options);
  /// From a dtrain::context (its control plane).
  template <class Context>
  requires requires(Context& c) {
    { c.control_plane() } -> std::same_as<dtrain::control_plane>;
  }
  checkpoint(Context& ctx, checkpoint_options options)
      : checkpoint(ctx.control_plane(), with_copy_threads(std::move(options), ctx)) {}

  checkpoint(const checkpoint&) = delete;
  checkpoint& operator=(const checkpoint&) = delete;
  checkpoint(checkpoint&&) = delete;  // its step entry points into it
  checkpoint& operator=(checkpoint&&) = delete;

  /// Values in host memory, restored in place: `name` must be unique.
  checkpoint& add(std::string name, buffer values,
                  checkpoint_scope scope = checkpoint_scope::replicated,
                  std::vector<std::size_t> shape = {});
  /// A contiguous range of elements (std::vector<float>, std::span<double>, ...).
  template <class R>
  requires detail::element_range<R> checkpoint& add(
      std::string name, R& values, checkpoint_scope scope = checkpoint_scope::replicated) {
    using T = detail::range_element<R>;
    return add(std::move(name),
               host_buffer(std::span<T>(std::ranges::data(values), std::ranges::size(values))),
               scope);
  }
  /// One value of a trivially copyable type (a counter, an RNG's state), as its bytes.
  template <class T>
  requires(std::is_trivially_copyable_v<T> && !std::ranges::range<T> && !std::same_as<T, buffer> &&
           !std::same_as<T, distributed_sampler>)
      checkpoint& add(std::string name, T& value,
                      checkpoint_scope scope = checkpoint_scope::replicated) {
    return add_values(
        std::move(name),
        {static_cast<void*>(std::addressof(value)), sizeof(T), dtype::uint8, memory::host}, scope,
        {});
  }
  /// Every parameter's values, under its name (replicated: DDP keeps them equal).
  template <class Params>
  requires detail::parameter_list<Params> checkpoint& add(const Params& params) {
    for (std::size_t i = 0; i < std::ranges::size(params); ++i) {
      const parameter& p = detail::parameter_at(params, i);
      if (!p.values.data && p.values.count > 0) {  // ZeRO stage 3 holds them sharded
        throw config_error("checkpoint on rank " + std::to_string(context_.plane.rank()) +
                           ": parameter '" + p.name +
                           "' has no values here (ddp_options::sharding = parameters holds "
                           "them as shards: add them with add_sharded(\"parameters\", ddp))");
      }
      add(p.name, p.values, checkpoint_scope::replicated, p.shape);
    }
    return *this;
  }
  /// A sharded array (the optimizer state of a sharded DDP): this rank holds
  /// `values` (host memory), its `ranges` of a whole array of `total`
  /// elements. Each rank saves its ranges; restore() gives each rank the
  /// ranges it holds now, whatever the world size and the cut the
  /// checkpoint was written with (it reads every rank's part when the world
  /// size differs), and refuses by name a checkpoint whose ranks did not hold
  /// every element it needs.
  checkpoint& add_sharded(std::string name, buffer values, std::vector<shard_range> ranges,
                          std::uint64_t total);
  /// A sharded DDP's optimizer state (`values`: an array of ddp.shard_elements()
  /// elements indexed by shard_piece::state_offset), cut as `ddp.shard()` is.
  template <class R, class DDP>
  requires detail::element_range<R> && requires(const DDP& d) {
    { d.shard_ranges() } -> std::convertible_to<std::vector<shard_range>>;
    { d.model_elements() } -> std::convertible_to<std::uint64_t>;
  }
  checkpoint& add_sharded(std::string name, R& values, const DDP& ddp) {
    using T = detail::range_element<R>;
    return add_sharded(
        std::move(name),
        host_buffer(std::span<T>(std::ranges::data(values), std::ranges::size(values))),
        ddp.shard_ranges(), ddp.model_elements());
  }

  /// The values of a sharded DDP's shard (`ddp.shard()`'s pieces): ZeRO
  /// stage 3's values, which only DDP holds, each rank its shard; with
  /// ddp_options::master_weights the float32 master copy (the pieces'
  /// `master`), from which a restore rounds the 16-bit values again. Saved as
  /// the sharded entry `name` over the whole model's elements, as the
  /// optimizer state is, and re-cut on restore for another world size.
  /// They travel through a shard-sized host array of this checkpoint's,
  /// copied from the pieces before each save and back after a restore
  /// (ddp.download_shard_values / upload_shard_values: from and to GPU
  /// memory too). The pieces must be of one type; the DDP must outlive
  /// this checkpoint's saves and restores.
  template <class DDP>
  requires requires(DDP& d, std::span<std::byte> out, std::span<const std::byte> in) {
    { d.shard() } -> std::convertible_to<std::span<const shard_piece>>;
    { d.shard_ranges() } -> std::convertible_to<std::vector<shard_range>>;
    { d.model_elements() } -> std::convertible_to<std::uint64_t>;
    { d.shard_elements() } -> std::convertible_to<std::size_t>;
    d.download_shard_values(out);
    d.upload_shard_values(in);
  }
  checkpoint& add_sharded(std::string name, DDP& ddp) {
    const std::span<const shard_piece> pieces = ddp.shard();
    const dtype type = pieces.empty() ? dtype::float32 : pieces.front().master.type;
    for (const shard_piece& piece : pieces) {
      if (piece.master.type != type) {
        throw config_error(
            "checkpoint on rank " + std::to_string(context_.plane.rank()) + ": add_sharded(\"" +
            name + "\", ddp) takes the pieces of one type, and parameter #" +
            std::to_string(piece.parameter) + "'s is " + std::string(to_string(piece.master.type)) +
            ", not " + std::string(to_string(type)));
      }
    }
    const std::span<std::byte> host = entries_.scratch(ddp.shard_elements() * size_of(type));
    add_sharded(std::move(name), buffer{host.data(), ddp.shard_elements(), type, memory::host},
                ddp.shard_ranges(), ddp.model_elements());
    return add_hooks([&ddp, host] { ddp.download_shard_values(host); },
                     [&ddp, host] { ddp.upload_shard_values(host); });
  }

  /// Functions run around the entries, on this rank: `before_save()` at each
  /// save, before any entry is read (to copy state that lives elsewhere, as
  /// on a GPU or inside a library's objects, into registered host memory);
  /// `after_restore()` once restore() has loaded every entry of every rank
  /// (to move it back). Either may be empty. What they throw fails the save
  /// or the restore on every rank, as an entry's error does.
  checkpoint& add_hooks(std::function<void()> before_save, std::function<void()> after_restore);

  /// The sampler's position in the global order (replicated: it is the same
  /// on every rank, and a job of another size continues it).
  checkpoint& add(distributed_sampler& sampler, std::string name = "sampler");
  /// The loss scaler's scale, growth tracker and skipped steps (replicated:
  /// every rank's scaler took the same decisions), as the step's update()
  /// leaves them, whether the save comes before update() or after it.
  checkpoint& add(loss_scaler& scaler, std::string name = "loss_scaler");
  /// State the program serialises itself (an optimizer's, a data loader's):
  /// save() returns its bytes at a save; load(bytes) gets them back at restore().
  checkpoint& add(std::string name, std::function<std::string()> save,
                  std::function<void(std::string_view)> load,
                  checkpoint_scope scope = checkpoint_scope::replicated);

  /// Loads the newest whole checkpoint of dir, on every rank, and returns its
  /// step; nullopt (and nothing changed) when there is none. Throws
  /// checkpoint_error, on every rank and with nothing changed, when it does
  /// not fit what is registered here (another model, or per-rank state from
  /// another world size).
  std::optional<std::uint64_t> restore();

  /// Counts a finished training step; saves when `every` divides the count,
  /// into memory when memory_interval() does (with memory_budget, the ranks
  /// agree on it again now and then, within step(): every rank together).
  /// Returns whether it saved to disk.
  /// With checkpoint_options::memory_beside_step, throws config_error (and
  /// drops that copy) when the step before began a memory copy and no
  /// before_update() came since.
  bool step();

  /// With checkpoint_options::memory_beside_step: waits until the memory
  /// copy that the last step() began has read the state, so that the caller
  /// may change it. Call it after the forward and backward passes and before
  /// the first change to a registered value (the optimizer's step, a ZeRO
  /// gather of updated values), on every step. Returns at once when no copy
  /// is being read (and without the option).
  void before_update();

  /// Saves now into the memory tier (checkpoint_options::memory_every), on
  /// every rank together (with checkpoint_options::asynchronous: copies the
  /// state and returns, and a thread writes it).
  /// A rank whose copy could not be written keeps its older ones and says so
  /// on stderr; the training goes on (the disk is the fallback). Throws
  /// config_error when the tier has no directory.
  void save_to_memory();

  /// Where the memory tier keeps this node's copies (empty: none).
  [[nodiscard]] std::filesystem::path memory_dir() const {
    return memory_ ? memory_->dir() : std::filesystem::path();
  }
  /// The steps between memory copies now: memory_every, or with
  /// memory_budget what the ranks last agreed on (the same on every rank);
  /// 0: no memory copies.
  [[nodiscard]] std::uint64_t memory_interval() const noexcept {
    return memory_ ? interval_.every() : 0;
  }
  /// This rank's memory copies that could not be written (the first is said on stderr).
  [[nodiscard]] std::uint64_t memory_failures() const noexcept {
    return memory_ ? memory_->failures() : 0;
  }

  /// Saves now, as step steps(): on every rank, together. Throws
  /// checkpoint_error on every rank when any rank's part could not be written
  /// or the commit failed; the checkpoints already committed stay as they were.
  /// With checkpoint_options::asynchronous, it copies the state and returns:
  /// a thread writes the files beside the next steps, and the checkpoint is
  /// committed at the next save(), restore() or wait(), or when this object
  /// is destroyed (errors of the write are thrown there).
  void save();

  /// Commits the save in flight (checkpoint_options::asynchronous), if any,
  /// on every rank together; throws as save() does.
  void wait();

  /// Where this rank's training thread spent its time in save() and wait().
  [[nodiscard]] const checkpoint_timings& timings() const noexcept { return context_.timings; }
  /// Steps counted by step() (and restored by restore()).
  [[nodiscard]] std::uint64_t steps() const noexcept { return static_cast<std::uint64_t>(steps_); }
  [[nodiscard]] const checkpoint_options& options() const noexcept { return context_.options; }

  ~checkpoint();

 private:
  template <class Context>
  static checkpoint_options with_copy_threads(checkpoint_options options, Context& ctx) {
    return with_copy_threads(std::move(options), ctx.local_size());
  }
  /// copy_threads 0 (automatic): the machine's cores per local rank, 1 to 8.
  static checkpoint_options with_copy_threads(checkpoint_options options, int local_size);

  checkpoint& add_values(std::string name, buffer values, checkpoint_scope scope,
                         std::vector<std::uint64_t> shape) {
    entries_.add_values(std::move(name), values, scope, std::move(shape));
    return *this;
  }
  /// This step's save into tier `t`: the entries' snapshot (their copy
  /// number `slot` when asynchronous), written by the tier. The tier's save
  /// before this one is completed first (`next_save`: the training's wait).
  /// `beside`: the large values are read by the writer, beside the next step,
  /// until before_update() (checkpoint_options::memory_beside_step).
  void save_into(detail::ckpt::tier& t, std::size_t slot, bool beside = false);
  /// save_to_memory(), read `beside` the next step or not.
  void copy_to_memory(bool beside);
  /// Throws config_error, naming `call`, when the memory copy begun at the
  /// last step is read beside the step and had no before_update() (it is
  /// dropped, when it reads the state where it lives).
  void check_released(std::string_view call);
  /// Loads `step` from tier `t` on every rank: each rank checks its files
  /// against what it registered, all agree, and only then memory changes.
  /// False, said, and nothing changed, when a file some rank reads is
  /// damaged (detail::ckpt::damaged_part): the step is to be skipped.
  bool load(detail::ckpt::tier& t, std::uint64_t step);
  /// Every rank together: the options that make the ranks save and copy at
  /// the same steps, compared across the ranks; empty when they are the same
  /// everywhere, else the problem (naming rank 0's and the first that differs).
  std::string differing_options();
  /// This rank's options and environment taken (the memory tier, the
  /// metrics file); throws config_error, or what the metrics file's write throws.
  void take_options();
  /// All ranks learn whether every rank could `what` (the verdict,
  /// control/verdict.hpp); throws checkpoint_error on every rank if not.
  void agree(bool ok, const std::string& problem, const std::string& what);

  // The entries' copies for asynchronous saves: one per tier (registry::snapshot).
  static constexpr std::size_t disk_slot = 0, memory_slot = 1;
  // A memory copy read beside the step still copies its values entries under
  // this size at step() (a counter, an RNG's state): the next step may change them.
  static constexpr std::size_t beside_copy_below = std::size_t{64} << 10;

  detail::ckpt::tier_context context_;  // the plane, the options, the timings
  detail::ckpt::registry entries_;
  std::int64_t steps_ = 0;
  // memory_beside_step: a memory copy began at the last step, and no
  // before_update() (or wait()) came since.
  bool word_due_ = false;
  // When step() copies into memory (memory_every, memory_budget).
  detail::ckpt::memory_interval interval_;
  detail::ckpt::disk_tier disk_;
  std::unique_ptr<detail::ckpt::memory_tier> memory_;  // null: no memory directory
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/checkpoint-inl.hpp>
#endif
