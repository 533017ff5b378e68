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

#include <dtrain/backend/types.hpp>
#include <dtrain/checkpoint/format.hpp>
#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/control/verdict.hpp>
#include <dtrain/ddp/loss_scaler.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/sampler.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/env/names.hpp>
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

/// Whose state an entry is: the same on every rank (written once, by rank 0,
/// and loaded by every rank, whatever the world size) or each rank's own.
enum class checkpoint_scope : std::uint8_t { replicated, per_rank };

/// Options of dtrain::checkpoint. Aggregate: `{.dir = "ckpt", .every = 100}`.
struct checkpoint_options {
  /// Where the checkpoints go (created if missing). Every rank must see the
  /// same directory: one machine, or a file system that every node shares.
  std::filesystem::path dir;
  /// step() saves after every `every`-th step; 0: only save() saves.
  std::uint64_t every = 0;
  /// Committed checkpoints kept (at least 1); older ones are removed once a
  /// newer one is committed. With 2 or more, a newest checkpoint damaged on
  /// disk still leaves one to resume from.
  int keep = 2;
  /// No line on rank 0's stderr per save and restore.
  bool quiet = false;
  /// save() copies the state (host memory: the size of the checkpoint) and
  /// returns; a thread writes the files beside the next steps, and the
  /// checkpoint is committed at the next save(), restore() or wait(), or when
  /// the checkpoint object is destroyed. Until then the one before it is the
  /// newest.
  bool asynchronous = false;
  /// Threads that copy the state at an asynchronous save (the training
  /// thread is one of them); a copy under 1 MiB per thread is not split.
  /// 0: automatic, the machine's cores per local rank when built from a
  /// dtrain::context (at most 8), else 1.
  int copy_threads = 0;
  /// The memory tier: step() also saves every `memory_every`-th step into
  /// `memory_dir`, memory that outlives this process but not its node. A
  /// worker restarted on the node resumes from there when that copy is at
  /// least as new as the newest on disk (no read of `dir`); the disk stays
  /// the fallback and the tier for whole-job restarts. Each rank writes and
  /// commits its own copy (no collective), keeping its 2 newest; a node's
  /// first rank adds the replicated entries. With `asynchronous`, the state
  /// is copied on the training thread and written on a thread beside the next
  /// step (cheaper; a rank killed during it loses that step too). restore() takes the newest step
  /// whole on every rank; a copy that is torn, older than the disk's, or missing on some rank is
  /// not used, and the message says which and why. 0: off.
  std::uint64_t memory_every = 0;
  /// The memory tier's directory, one per node. Empty: the environment's
  /// DTRAIN_MEMORY_CHECKPOINT_DIR, which dtrun's node agent sets to a
  /// directory in /dev/shm that it owns (and removes when the job ends).
  std::filesystem::path memory_dir{};
};

/// Where a checkpoint's time on the training thread went, summed over its
/// saves on this rank (dtrain::checkpoint::timings()).
struct checkpoint_timings {
  std::uint64_t saves = 0;  ///< save() calls
  /// In save() (and, for an asynchronous checkpoint, in wait()): what the
  /// training waited for in all.
  double blocked_seconds = 0;
  /// The asynchronous save's copy of the state (its "staging").
  double copy_seconds = 0;
  /// Committing the save before: waiting for its writer, and the
  /// control-plane rounds of its commit.
  double commit_seconds = 0;
  /// Of commit_seconds, the wait for an asynchronous save's writer, which was
  /// still writing when the next save() came: more than a little means saves
  /// come faster than the disk takes them (rank 0 says so once).
  double writer_wait_seconds = 0;
  /// The memory tier's saves (checkpoint_options::memory_every) on the
  /// training thread (asynchronous: the copy of the state, and the wait for
  /// the writer of the copy before when it was still writing).
  double memory_seconds = 0;
};

/// A committed checkpoint found on disk.
struct checkpoint_found {
  std::uint64_t step = 0;
  std::filesystem::path path;  ///< `DIR/step-<N>`
  int world_size = 0;          ///< of the job that wrote it
};

namespace detail::ckpt {
/// The committed step directories of `dir` (`step-<N>`, by name, unchecked),
/// newest first; none when `dir` does not exist. Throws checkpoint_error when
/// it cannot be read.
DTRAIN_DETAIL_INLINE std::vector<std::pair<std::uint64_t, std::filesystem::path>> committed_steps(
    const std::filesystem::path& dir);
}  // namespace detail::ckpt

/// The newest checkpoint in `dir` whose manifest and files check out (sizes
/// and checksums), or nullopt. Each newer one that does not is skipped, with a
/// line naming the file and what is wrong appended to `skipped` when given.
/// Throws checkpoint_error when `dir` exists but cannot be read.
DTRAIN_DETAIL_INLINE std::optional<checkpoint_found> latest_checkpoint(
    const std::filesystem::path& dir, std::vector<std::string>* skipped = nullptr);

/// One step's state of every rank: saved consistently, resumed from. See the
/// file's comment. Every rank constructs it, registers the same entries (per
/// scope) in the same way, and calls restore(), step() and save() together.
class checkpoint {
 public:
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
        throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": parameter '" +
                           p.name +
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
            "checkpoint on rank " + std::to_string(plane_.rank()) + ": add_sharded(\"" + name +
            "\", ddp) takes the pieces of one type, and parameter #" +
            std::to_string(piece.parameter) + "'s is " + std::string(to_string(piece.master.type)) +
            ", not " + std::string(to_string(type)));
      }
    }
    auto& scratch = shard_copies_.emplace_back(ddp.shard_elements() * size_of(type));
    const std::span<std::byte> host(scratch.data(), scratch.size());
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
  /// into memory when `memory_every` does. Returns whether it saved to disk.
  bool step();

  /// Saves now into the memory tier (checkpoint_options::memory_every), on
  /// every rank together (with checkpoint_options::asynchronous: copies the
  /// state and returns, and a thread writes it).
  /// A rank whose copy could not be written keeps its older ones and says so
  /// on stderr; the training goes on (the disk is the fallback). Throws
  /// config_error when the tier has no directory.
  void save_to_memory();

  /// Where the memory tier keeps this node's copies (empty: none).
  [[nodiscard]] const std::filesystem::path& memory_dir() const noexcept { return memory_dir_; }
  /// This rank's memory copies that could not be written (the first is said on stderr).
  [[nodiscard]] std::uint64_t memory_failures() const noexcept { return memory_failures_; }

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
  [[nodiscard]] const checkpoint_timings& timings() const noexcept { return timings_; }
  /// Steps counted by step() (and restored by restore()).
  [[nodiscard]] std::uint64_t steps() const noexcept { return static_cast<std::uint64_t>(steps_); }
  [[nodiscard]] const checkpoint_options& options() const noexcept { return options_; }

  ~checkpoint();

 private:
  template <class Context>
  static checkpoint_options with_copy_threads(checkpoint_options options, Context& ctx) {
    return with_copy_threads(std::move(options), ctx.local_size());
  }
  /// copy_threads 0 (automatic): the machine's cores per local rank, 1 to 8.
  static checkpoint_options with_copy_threads(checkpoint_options options, int local_size);
  void finish_pending() noexcept;
  void wait_pending(bool next_save = false);

  static constexpr std::int64_t no_checkpoint = -1;
  static constexpr std::int64_t failed = -2;

  struct hook {
    std::function<void()> before_save, after_restore;
  };
  std::vector<hook> hooks_;                         // add_hooks()
  std::list<std::vector<std::byte>> shard_copies_;  // add_sharded(name, ddp)'s arrays

  struct entry {
    std::string name;
    checkpoint_scope scope = checkpoint_scope::replicated;
    detail::ckpt::entry_kind kind = detail::ckpt::entry_kind::values;
    buffer values;
    std::vector<std::uint64_t> shape;
    std::function<std::string()> save;
    std::function<void(std::string_view)> load;
    detail::ckpt::staging staged;         // an asynchronous save's copy of `values`
    detail::ckpt::staging memory_staged;  // the memory tier's copy of `values`
    std::vector<shard_range> ranges;      // a sharded entry's: what this rank holds
    std::uint64_t total = 0;              // of the whole sharded array
  };

  checkpoint& add_values(std::string name, buffer values, checkpoint_scope scope,
                         std::vector<std::uint64_t> shape);
  checkpoint& push(entry e);
  [[nodiscard]] bool has_scope(checkpoint_scope scope) const;

  /// One entry's bytes to write: the live memory, or a copy of it.
  struct part_record {
    std::string_view name;
    detail::ckpt::entry_kind kind = detail::ckpt::entry_kind::values;
    dtype type = dtype::uint8;
    std::span<const std::uint64_t> shape;
    const void* data = nullptr;
    std::uint64_t bytes = 0;
  };
  /// What one rank writes for one scope: the records, and what they point into.
  struct part_snapshot {
    std::vector<part_record> records;
    std::vector<std::string> owned;  // bytes entries' save() results
  };
  /// A save from its start to its commit.
  struct pending_save {
    std::uint64_t step = 0;
    std::chrono::steady_clock::time_point start;
    std::filesystem::path partial;
    part_snapshot per_rank, replicated;
    std::optional<detail::ckpt::file_record> per_rank_file, replicated_file;
    std::string problem;  // this rank's, from its snapshot or its write
    std::thread writer;
  };

  /// The records of `scope`'s entries; `copy`: into owned memory (an
  /// asynchronous save, whose training goes on while the files are written),
  /// the entries' memory-tier copies when `memory`.
  part_snapshot snapshot(checkpoint_scope scope, bool copy, bool memory = false);
  /// A sharded entry as it is written: the whole's size, the ranges, their values.
  static std::string sharded_payload(const entry& e);

  static detail::ckpt::file_record write_part(const std::filesystem::path& path,
                                              const part_snapshot& part);
  /// Writes this rank's files of `p` (on the training thread, or the writer's).
  static void write_parts(pending_save& p, int rank, bool replicated);

  /// Phases 2 and 3 of the save in flight: all ranks learn what every rank
  /// wrote; rank 0 commits it (manifest, rename) or removes it; all hear which.
  /// `next_save`: called by save() (the wait for the writer is then the
  /// training's; at wait(), restore() or the end it is expected).
  void commit(bool next_save = false);

  static std::string not_committed(const std::string& what, const std::string& failed_ranks);

  /// Rank 0: the manifest into the partial directory, which is renamed to
  /// step-<N> (the commit), each fsync'd. Returns the checkpoint's bytes.
  std::uint64_t commit_on_disk(const pending_save& p, const std::vector<std::int64_t>& all);

  /// The memory tier: the ranks that share this rank's memory directory
  /// (its node: the same host and directory), found once by every rank together.
  const std::vector<int>& memory_node();
  /// Rank `rank`'s copy of `step` in the memory directory: `step-<N>.rank-<R>`,
  /// its part (and, for the node's first rank, the replicated part) and a
  /// manifest of them. Each rank commits its own (the rename), without the others.
  [[nodiscard]] std::filesystem::path memory_copy_dir(std::uint64_t step, int rank) const;
  /// The steps of `rank`'s copies (`partial`: of its saves that died), newest first.
  [[nodiscard]] std::vector<std::uint64_t> memory_copies(int rank, bool partial = false) const;
  /// This rank's 2 newest copies that check out (its own and its node's
  /// replicated part) and fit this job, newest first, -1 for none; each one
  /// skipped is said on stderr, naming the copy and why.
  std::array<std::int64_t, 2> usable_memory_copies();
  /// restore()'s choice between the memory tier and the disk's newest step
  /// `disk` (-1: none): the newest step whole on every rank, when it is at
  /// least as new as the disk's; else rank 0 says why not.
  std::optional<std::uint64_t> choose_memory_copy(std::int64_t disk);
  /// Waits for the memory writer; what it could not do is said, not thrown.
  void join_memory_writer() noexcept;
  /// Loads on every rank what `check` returns (the files, checked), as
  /// restore() does; `step_dir` names it in errors.
  void load(const std::function<std::vector<std::filesystem::path>()>& check,
            const std::filesystem::path& step_dir);
  void load(const std::filesystem::path& step_dir);

  /// Waits for rank 0's commit of the last asynchronous save; throws what it could not do.
  void join_committer();

  /// Rank 0's value reaches every rank.
  void broadcast_value(std::int64_t& value);

  /// "[64, 16] float32" (or "1024 float32" without a shape).
  static std::string describe(detail::ckpt::entry_kind kind, dtype type,
                              const std::vector<std::uint64_t>& shape, std::uint64_t bytes);

  /// The files this rank loads from `step_dir`, checked: the manifest, each
  /// file's size and checksum, and every entry against the registered ones.
  std::vector<std::filesystem::path> check_for_load(const std::filesystem::path& step_dir);
  /// The same for manifest `m`, whose files are at path_of(name).
  std::vector<std::filesystem::path> check_for_load(
      const detail::ckpt::manifest& m,
      const std::function<std::filesystem::path(const std::string&)>& path_of,
      const std::filesystem::path& step_dir);

  /// Reads a checked file into the registered entries.
  void apply(const std::filesystem::path& path);

  /// The parts of a saved sharded entry (`payload`, from `file`) that fall in
  /// the ranges this rank holds, copied into its values; counted in `recut_`.
  void recut(entry& e, std::string_view payload, const std::filesystem::path& file);
  /// After every part is read: each sharded entry got every element this rank holds.
  void check_recut() const;

  /// All ranks learn whether every rank could `what` (the verdict,
  /// control/verdict.hpp); throws checkpoint_error on every rank if not.
  void agree(std::int64_t ok, const std::string& problem, const std::string& what);

  /// Creates `dir` (and its parents); with `fresh`, `dir` itself must not exist yet.
  static void make_directory(const std::filesystem::path& dir, bool fresh);
  static void remove_tree(const std::filesystem::path& path);

  /// Removes what no resume can use any more: committed steps beyond the
  /// newest `keep` up to `newest`, steps numbered after it (left by a run
  /// that this one resumed before), and directories of saves that died. Each
  /// is renamed to NAME.removing at once (so no resume reads it) and removed
  /// by a thread beside the training (joined at the next prune, or at the
  /// end). A failure here is reported, not thrown: the new checkpoint is committed.
  void prune(std::uint64_t newest);

  void say(const std::string& line) const;

  dtrain::control_plane plane_;
  checkpoint_options options_;
  std::vector<entry> entries_;
  std::int64_t steps_ = 0;
  std::unique_ptr<pending_save> pending_;  // a save not yet committed (asynchronous)
  std::thread cleaner_;                    // removes what prune() renamed
  std::thread committer_;                  // rank 0's commit of an asynchronous save
  checkpoint_timings timings_;
  bool warned_slow_writer_ = false;
  // restore(): the global intervals each sharded entry got, of the elements this rank holds
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> recut_;
  std::string commit_failure_;        // what it could not do
  std::filesystem::path memory_dir_;  // the memory tier's (empty: off)
  std::vector<int> memory_node_;      // the ranks sharing memory_dir_ (found at first use)
  std::unique_ptr<pending_save> memory_pending_;  // the memory copy being written
  std::thread memory_writer_;                     // writes it beside the training
  std::uint64_t memory_failures_ = 0;             // copies not written
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/checkpoint-inl.hpp>
#endif
