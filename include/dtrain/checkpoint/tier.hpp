#pragma once
/// @file
/// The storage seam of dtrain::checkpoint. A tier is where a save's parts go
/// and where a restore finds them: the shared directory (disk_tier.hpp), the
/// node's memory (memory_tier.hpp), and, one day, an object store. The
/// checkpoint takes each save's snapshot from its registry and hands it to a
/// tier, which writes it (now, or on a thread), commits it its own way
/// (all ranks together, or each rank alone), keeps what its retention says,
/// and at a restore names the newest step every rank can load from it and
/// this rank's files of that step.

#include <dtrain/checkpoint/format.hpp>
#include <dtrain/checkpoint/options.hpp>
#include <dtrain/checkpoint/registry.hpp>
#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace dtrain::detail::ckpt {

/// A save whose writer reads the state itself beside the training
/// (checkpoint_options::memory_beside_step): once the writer has read all of
/// it, it waits here for the training's word on whether the state stayed
/// unchanged meanwhile (released: the copy is sealed) or may not have
/// (revoked: it is dropped). Thread-safe.
class read_gate {
 public:
  /// The writer: every byte of the state is read (or the write failed).
  void read_done();
  /// The writer: waits for the training's word; true: released.
  [[nodiscard]] bool wait_word();
  /// The training: waits until the writer has read the state; returns the seconds waited.
  double await_read();
  /// The training: its word, once (later words are ignored).
  void decide(bool released);
  /// Whether the training has given its word.
  [[nodiscard]] bool decided() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool read_ = false;
  std::optional<bool> word_;
};

/// The thread that writes a tier's asynchronous saves, one at a time:
/// started at the first, and kept for the tier's life (a thread started for
/// each save cost more than writing a small state; a memory copy may be
/// taken at every step). Thread-safe.
class save_writer {
 public:
  save_writer() = default;
  save_writer(const save_writer&) = delete;
  save_writer& operator=(const save_writer&) = delete;
  /// Lets the job in hand, if any, end, and ends the thread.
  ~save_writer();
  /// Runs `job` on the thread; the job before has been waited for.
  void start(std::function<void()> job);
  /// Waits until the job started last has run; returns the seconds waited.
  double wait();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void()> job_;  // to run; empty: none
  bool running_ = false;       // job_ taken, not done
  bool stop_ = false;
  std::thread thread_;
};

/// What of the replicated part one rank writes in a save (tier::replicated_part()).
struct replicated_share {
  bool writes = false;
  slice_of slice;    // of the replicated entries
  std::string file;  // the part file's name
};

/// One rank's save of one step into one tier, from its snapshot to its commit.
struct pending_save {
  std::uint64_t step = 0;
  std::chrono::steady_clock::time_point start;
  std::filesystem::path partial;     // where this rank writes its parts (tier::staging)
  replicated_share replicated_part;  // what of the replicated part this rank writes
  part_snapshot per_rank, replicated;
  std::optional<file_record> per_rank_file, replicated_file;
  std::string problem;     // this rank's, from its snapshot or its write
  bool on_writer = false;  // an asynchronous save's: written on the tier's save_writer
  /// Set when the writer reads the state itself (read_gate): sealed once released.
  std::unique_ptr<read_gate> gate;
};

/// Where the checkpoint's metrics file goes, as its errors name it.
inline constexpr std::string_view metrics_setting_name =
    "DTRAIN_METRICS_DIR (or checkpoint_options::metrics_dir)";

/// What a checkpoint's tiers share with it.
struct tier_context {
  dtrain::control_plane plane;
  checkpoint_options options;
  checkpoint_timings timings;

  /// A line on rank 0's stderr ("dtrain checkpoint: ..."), unless quiet.
  void say(const std::string& line) const;
  /// Rank 0's value reaches every rank.
  void broadcast_value(std::int64_t& value);

  /// This rank's checkpoint metrics file (dtrain_checkpoint_rank<R>.prom in
  /// DTRAIN_METRICS_DIR, else checkpoint_options::metrics_dir;
  /// diagnostics/metrics.hpp) and its labels; empty: none.
  std::string metrics_file{};
  std::string metrics_labels{};
  /// A tier committed `step` on this rank (`memory`: this rank's memory
  /// copy; else the job's checkpoint on disk, which rank 0 commits): the
  /// metrics file is written again. Called on the writer and committer
  /// threads too; never throws: a failed write is said once, and the metrics stop.
  void committed(bool memory, std::uint64_t step) noexcept;

  // committed()'s (an aggregate still: the checkpoint makes it so).
  struct commit_mark {
    std::uint64_t step = 0;
    double unix_time = 0;  // 0: none yet
  };
  std::mutex metrics_mutex_{};
  commit_mark disk_commit_{}, memory_commit_{};
  bool metrics_failed_ = false;
};

/// A storage tier (the file's comment). Each has at most one save in flight.
class tier {
 public:
  explicit tier(tier_context& context) : context_(context) {}
  tier(const tier&) = delete;
  tier& operator=(const tier&) = delete;
  virtual ~tier() = default;

  /// Where this rank writes its parts of `step` (the tier commits or drops them).
  [[nodiscard]] virtual std::filesystem::path staging(std::uint64_t step) const = 0;
  /// What of the replicated part this rank writes (every rank calls it, together).
  [[nodiscard]] virtual replicated_share replicated_part() = 0;

  /// Takes this rank's save `p` (its snapshot taken, or p.problem): writes
  /// its parts into staging and seals them, now or, `asynchronous`, on a
  /// thread beside the training. The save before must be complete()d.
  void write(std::unique_ptr<pending_save> p, bool asynchronous);
  /// Ends the save in flight, if any: its writer joined and its commit
  /// (finish()). `next_save`: called by the next save, the wait is the training's.
  /// A writer that reads the state itself is released first: the training
  /// waits here, so the state does not change until it has read it.
  void complete(bool next_save = false) {
    if (!pending_) return;
    if (pending_->gate) pending_->gate->decide(true);
    finish(std::move(pending_), next_save);
  }
  /// Whether the save in flight has a writer that reads the state itself
  /// and has not had the training's word yet.
  [[nodiscard]] bool awaits_word() const {
    return pending_ && pending_->gate && !pending_->gate->decided();
  }
  /// Waits until the writer of the save in flight (if it reads the state
  /// itself) has read it, and releases it; returns the seconds waited.
  double release_reads() {
    if (!awaits_word()) return 0;
    const double waited = pending_->gate->await_read();
    pending_->gate->decide(true);
    return waited;
  }
  /// Drops the save in flight whose writer reads the state itself: the state
  /// may have changed under it. complete() then ends it.
  void revoke_reads() {
    if (awaits_word()) pending_->gate->decide(false);
  }

  /// restore(): the newest step whose copy every rank can load into
  /// `entries` from this tier, not older than `floor` (-1: any), agreed by
  /// every rank together; nullopt when there is none (what was skipped, and
  /// why, is said).
  [[nodiscard]] virtual std::optional<std::uint64_t> newest(std::int64_t floor,
                                                            const registry& entries) = 0;
  /// This rank's files of `step`, checked against `entries` (registry::check).
  [[nodiscard]] virtual std::vector<std::filesystem::path> files(std::uint64_t step,
                                                                 const registry& entries) = 0;
  /// Where `step` is, for messages.
  [[nodiscard]] virtual std::filesystem::path where(std::uint64_t step) const = 0;
  /// restore()'s line once `step` is loaded from here.
  [[nodiscard]] virtual std::string resumed(std::uint64_t step) const = 0;

 protected:
  /// On the writer's thread, before this rank's parts of `p` are written:
  /// makes p.partial (or points it at a directory to write over: the
  /// memory tier's copy set aside), and says whether files there are
  /// written in place (atomic_file's `in_place`: the directory's rename
  /// commits them) rather than each made anew and renamed.
  virtual bool open_staging(pending_save& p);
  /// After this rank's parts of `p` are written, or failed (p.problem), on
  /// the writer's thread: what the tier does alone (a memory copy commits here).
  virtual void seal(pending_save& p) { static_cast<void>(p); }
  /// On the training thread: the commit of `p` (the writer may still run).
  virtual void finish(std::unique_ptr<pending_save> p, bool next_save) = 0;
  /// Waits for `p`'s writer; returns the seconds waited.
  double join_writer(pending_save& p);

  tier_context& context_;
  std::unique_ptr<pending_save> pending_;  // the save in flight
  save_writer writer_;  // (destroyed after the derived tier: its saves are ended)
};

}  // namespace dtrain::detail::ckpt

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/tier-inl.hpp>
#endif
