#pragma once
/// @file
/// The options of dtrain::checkpoint and what it reports: which state an entry
/// is (its scope), where and how often it saves, where its time went, and a
/// checkpoint found on disk.

#include <cstdint>
#include <filesystem>

namespace dtrain {

/// Whose state an entry is: the same on every rank (written once, by rank 0,
/// and loaded by every rank, whatever the world size) or each rank's own.
enum class checkpoint_scope : std::uint8_t { replicated, per_rank };

/// Options of dtrain::checkpoint. Aggregate: `{.dir = "ckpt", .every = 100}`.
/// `every`, `asynchronous`, `memory_every` and `memory_budget` must be the
/// same on every rank: the checkpoint's constructor refuses them otherwise,
/// on every rank (config_error).
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
  /// A directory where each rank writes dtrain_checkpoint_rank<R>.prom, in
  /// the Prometheus text format (as DDP's metrics, ddp_options::metrics_dir):
  /// the newest step committed to disk (rank 0's file) and to this rank's
  /// memory copy, and when: alert on their age. Empty: DTRAIN_METRICS_DIR's,
  /// which wins when set; neither: none.
  std::string metrics_dir{};
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
  /// The memory tier: step() also saves every `memory_every`-th step (with
  /// `memory_budget`, as often as that allows) into `memory_dir`, memory
  /// that outlives this process but not its node. A
  /// worker restarted on the node resumes from there when that copy is at
  /// least as new as the newest on disk (no read of `dir`); the disk stays
  /// the fallback and the tier for whole-job restarts. Each rank writes and
  /// commits its own copy (no collective), keeping its 2 newest; the
  /// replicated entries are cut among a node's ranks, each writing a slice
  /// (a restore joins them). With `asynchronous`, the state
  /// is copied on the training thread and written on a thread beside the next
  /// step (cheaper; a rank killed during it loses that step too). restore() takes the newest step
  /// whole on every rank; a copy that is torn, older than the disk's, or missing on some rank is
  /// not used, and the message says which and why. When all the state is replicated, a rank
  /// needs only its node's replicated part, whatever the size of the job that wrote it (an
  /// elastic job's smaller round after a lost node resumes from memory), and ranks with no
  /// copy (a new or replacement node) get it from a rank with one. 0: off.
  std::uint64_t memory_every = 0;
  /// The memory tier's share of the step time, e.g. 0.03 (0: none). With a
  /// budget, `memory_every` is the most steps between copies (what a failure
  /// may cost), and the copies come as often as keeps their cost within it:
  /// 50 steps after the start, and then as far apart as keeps this agreement
  /// within a tenth of the budget (at most 10000 steps), the ranks agree on
  /// the fewest steps between copies whose cost, measured on the costliest
  /// rank (each step's time, between two step() calls, with a copy and
  /// without), is at most this share of a step's. Rank 0 says what it chose,
  /// and again when it moves more than 2x (checkpoint::memory_interval()
  /// tells it too). A small state on short steps is copied every few dozen
  /// steps instead of every step; a large one on long steps (a GPU's) every
  /// step. It starts at 10 steps (`memory_every` when smaller), again after
  /// each restore(). Needs memory_every of at least 3 (a step between copies
  /// and one after it, to measure a step without a copy). The steps saved to
  /// disk, and those after them, are not measured.
  double memory_budget = 0;
  /// The memory tier's copy costs the training thread next to nothing:
  /// step() copies only the values under 64 KiB (a counter, an RNG's state),
  /// the sampler, byte entries and shards, and a thread reads the larger
  /// values where they are, beside the next step's forward and backward,
  /// which only read them. The program calls before_update() before it
  /// changes any registered value (the optimizer's step), every step: it
  /// waits until the thread has read them. A step() (or save_to_memory())
  /// with no before_update() since the step that began a copy throws
  /// config_error, and that copy is not used. State that the forward or
  /// backward changes (a batch norm's running statistics, an EMA updated in
  /// the forward) must not be a registered value of 64 KiB or more: save it
  /// through add(name, save, load), which step() calls. A rank killed in
  /// the next step before its copy is committed loses that copy, as with
  /// `asynchronous`: the job resumes from the one before, and when the
  /// killed rank was waiting in before_update() (its reads of its slice
  /// outlast the forward and backward) while the others finished the step,
  /// two steps are trained again. At a step that also saves to disk
  /// synchronously, step() writes the copy itself, before the disk's
  /// (before_update() is due all the same): a rank killed during the disk's
  /// save, or in the next step, resumes from memory, not from disk. Needs
  /// memory_every; independent of `asynchronous` (which is the disk's saves'
  /// then).
  bool memory_beside_step = false;
  /// The memory tier's directory, one per node. Empty: the environment's
  /// DTRAIN_MEMORY_CHECKPOINT_DIR, which dtrun's node agent sets to a
  /// directory in /dev/shm that it owns (and removes when the job ends).
  std::filesystem::path memory_dir{};
  /// The memory tier's buddy (HOST:PORT): a store on another node that holds
  /// each rank's 2 newest memory copies when the job has per-rank state (a ZeRO
  /// shard, add(..., per_rank)), so that the ranks of a node that replaces a
  /// lost one resume from memory too. Each rank sends each copy it commits
  /// there (beside the training with `asynchronous`, else within the save);
  /// the store's token is DTRAIN_STORE_TOKEN's.
  /// Empty: the environment's DTRAIN_MEMORY_BUDDY, which dtrun's node agent
  /// sets to the next node's agent (none on one node: no buddy).
  std::string memory_buddy{};
  /// The store (HOST:PORT) where this node's agent holds the copies that the
  /// node before it sends (its buddy): when the job's size changes (an
  /// elastic round without that node), the sharded state is re-cut from
  /// every old rank's copy, on the nodes and there. Empty: the environment's
  /// DTRAIN_MEMORY_HELD, which dtrun's node agent sets.
  std::string memory_held{};
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

}  // namespace dtrain
