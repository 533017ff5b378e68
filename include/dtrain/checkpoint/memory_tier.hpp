#pragma once
/// @file
/// The memory tier (checkpoint_options::memory_every): copies in a directory
/// of the node's memory that outlives the workers (dtrun's node agent owns
/// it, in /dev/shm), in the disk's format. Each rank writes and commits its
/// own copy, `step-<N>.rank-<R>` (its part, its slice of the replicated part
/// (replicated_part()), and a manifest), without the other ranks, and keeps
/// its 2 newest. A restore joins each step's slices on the node's first rank
/// (join_slices()) and takes the newest step that every rank holds whole.
/// The copy older than those is not freed but set aside (`spare.rank-<R>`)
/// and written over by the next save: its pages are mapped already, and
/// a tmpfs file made anew costs more than the copy's bytes (the node holds
/// 3 copies of each rank's state, as it does during a save without this).
///
/// Per-rank state (a ZeRO rank's shard, a program's own) is lost with its
/// node: with a buddy (checkpoint_options::memory_buddy, which dtrun sets to
/// the next node's agent), each rank also sends each copy it commits (where
/// it commits it: on an asynchronous save's writer thread) to that agent's
/// store, which holds the 2 newest whole ones
/// per rank in its memory. A rank that has no copy of the newest step its
/// buddy holds (its node is new: it replaces a lost one) takes it from there
/// at restore(), checked, and commits it as its own.

#include <dtrain/checkpoint/tier.hpp>
#include <dtrain/config.hpp>
#include <dtrain/rendezvous/client.hpp>

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::detail::ckpt {

/// The node-memory tier (the file's comment).
class memory_tier final : public tier {
 public:
  /// Copies in `dir`, one per node; `buddy` (HOST:PORT, or empty) the store
  /// on another node that holds this rank's 2 newest copies; `round` this
  /// worker's (DTRAIN_RESTART_COUNT: the buddy takes no copy from a worker
  /// of a round before the one that wrote there last).
  memory_tier(tier_context& context, std::filesystem::path dir, std::string buddy, std::string held,
              std::int64_t round);
  ~memory_tier() override { complete(); }

  [[nodiscard]] std::filesystem::path staging(std::uint64_t step) const override;
  /// With one rank on the node, all of it (`replicated.dtck`); with L, the
  /// node's k-th rank writes slice k of L (`replicated.<k>-of-<L>.<id>.dtck`,
  /// slice_of: the large values entries cut in L ranges, the others dealt
  /// whole), so that the node's ranks share the copy's work. The node is
  /// found at the first call, every rank together.
  [[nodiscard]] replicated_share replicated_part() override;
  /// The newest step whole on every rank (a rank killed in its save has the
  /// one before, which the others still keep), when it is at least `floor`
  /// (the disk's newest); else rank 0 says why not. Each copy of this rank
  /// skipped (torn, of another job) is said on its stderr, naming it and why.
  /// With per-rank entries a rank needs its own copy, of a job of this size;
  /// without (all of the state replicated, as a DDP's), any copy on its node
  /// with the step's replicated part serves, whatever the size of the job
  /// that wrote it (an elastic job's round after it lost a node).
  [[nodiscard]] std::optional<std::uint64_t> newest(std::int64_t floor,
                                                    const registry& entries) override;
  /// This rank's copy of `step`, with the replicated part from its node's
  /// first rank's; without per-rank entries, the copy newest() found.
  [[nodiscard]] std::vector<std::filesystem::path> files(std::uint64_t step,
                                                         const registry& entries) override;
  [[nodiscard]] std::filesystem::path where(std::uint64_t step) const override;
  [[nodiscard]] std::string resumed(std::uint64_t step) const override;

  [[nodiscard]] const std::filesystem::path& dir() const noexcept { return dir_; }
  /// This rank's copies that could not be written (the first is said on stderr).
  [[nodiscard]] std::uint64_t failures() const noexcept { return failures_; }

 protected:
  /// Writes into the copy seal() set aside, when there is one, in place
  /// (p.partial becomes it).
  bool open_staging(pending_save& p) override;
  /// The copy's manifest, its commit (the rename), and this rank's copies
  /// beyond the 2 newest removed, but one, set aside for the next save to
  /// write over; a copy that fails is removed.
  void seal(pending_save& p) override;
  /// Joins the writer; what it could not do is counted and said once, not thrown.
  void finish(std::unique_ptr<pending_save> p, bool next_save) override;

 private:
  /// The ranks that share this rank's directory (its node: the same host
  /// and directory), found once by every rank together, with the id of
  /// their slices (slice_id_).
  const std::vector<int>& node();
  /// A slice's file name, parsed: "replicated.<k>-of-<L>.<id>.dtck".
  struct slice_name {
    int index = 0, count = 0;
    std::string id;
  };
  [[nodiscard]] static std::optional<slice_name> parse_slice(std::string_view name);
  /// restore(), every rank together: the node's first rank joins the
  /// slices of the replicated part its node's copies hold (of the 2 newest
  /// steps whose every slice is whole: `DIR/step-<N>.node`, a copy of the
  /// replicated part alone, with the world size of the job that wrote it),
  /// saying which slice of which copy is missing or torn; then every rank
  /// reads them (whole_replicated()). Joins of an earlier restore go first.
  void join_slices();
  /// `slices` (of one step, of one save of one job), joined into
  /// `partial/replicated.dtck`; returns its record. Throws checkpoint_error
  /// naming the slice that is missing, torn or does not fit the others.
  static file_record join(
      const std::map<int, std::pair<std::filesystem::path, file_record>>& slices, int count,
      const std::filesystem::path& partial);
  /// `DIR/step-<N>.node`
  [[nodiscard]] std::filesystem::path joined_dir(std::uint64_t step) const;
  /// The copy on this node that holds the replicated part of `step` whole,
  /// of a job of this size: the node's first rank's (one rank on the node),
  /// or the slices' join; checked when `verify`. Else a checkpoint_error that says why.
  [[nodiscard]] std::filesystem::path whole_replicated(std::uint64_t step, bool verify);
  /// Where seal() sets aside a copy for the next save: `DIR/spare.rank-<R>`
  /// (never read as a copy).
  [[nodiscard]] std::filesystem::path spare_dir() const;
  /// Rank `rank`'s copy of `step`: `DIR/step-<N>.rank-<R>`.
  [[nodiscard]] std::filesystem::path copy_dir(std::uint64_t step, int rank) const;
  /// This rank's 2 newest copies that check out (its own and its node's
  /// replicated part) and fit this job, newest first, -1 for none. Copies of
  /// a job of another size are said to be skipped, unless the state `recuts`.
  std::array<std::int64_t, 2> usable(bool recuts);
  /// The 2 newest steps of which a copy on this node holds the replicated
  /// part whole (any rank's, any job size), newest first, -1 for none; each
  /// one's copy in `replicated_copy_`.
  std::array<std::int64_t, 2> usable_replicated();
  /// A line on this rank's stderr, unless quiet.
  void tell(const std::string& line) const;
  /// Every rank together: `root` sends the replicated part of its copy of
  /// `step` (in pieces, over the control plane) to the `lacking` ranks, which
  /// commit it as their own copy. Whether every one of them has it now
  /// (else rank 0 says why, and the disk is the fallback).
  bool share(std::uint64_t step, int root, const std::vector<int>& lacking);
  /// "2, 3"
  static std::string list(const std::vector<int>& ranks);

  /// `client`, connected to `endpoint` (checkpoint_options::`option`) at
  /// first use, within 5 s.
  static store_client& open(std::optional<store_client>& client, const std::string& endpoint,
                            std::string_view option);
  /// A copy an agent holds: its step, and the round of the worker that sent it.
  struct held_copy {
    std::uint64_t step = 0;
    std::int64_t round = 0;
    bool operator==(const held_copy&) const = default;
  };
  /// An agent's keys of rank `rank`'s copy `copy`:
  /// "dtrain/memory/rank-R/round-K/step-N/" (each worker's its own).
  [[nodiscard]] static std::string held_prefix(int rank, const held_copy& copy);
  /// An agent's key that lists the copies it holds of rank `rank`, newest
  /// first, after the round of the worker that wrote it last ("round 3:
  /// 41@3 40@2": its 2 newest whole copies, each step@round).
  [[nodiscard]] static std::string held_list(int rank);
  /// held_list's value, as read (`text` empty: there is none).
  struct held_value {
    std::int64_t round = -1;
    std::vector<held_copy> copies;
    std::string text;
  };
  /// What `store` holds of rank `rank` (held_list's list); a list that does
  /// not parse is a checkpoint_error naming it.
  static held_value held_steps(store_client& store, int rank);
  /// Writes this rank's list at its buddy, under this worker's round:
  /// `step` (sent by this worker) first (nullopt: the copies it names
  /// already), then the newest below it that the list names, unless the list is of a later round
  /// (a newer worker of this rank wrote it: then false, and nothing is
  /// written). A compare-and-set from `seen` (the list as this rank last
  /// read or wrote it, updated), so that a worker of an earlier round that
  /// wakes (its host was frozen, and replaced) cannot write over it.
  /// `dropped`: the copies the list named before and no longer does.
  bool name_held(store_client& store, held_value& seen, std::optional<std::uint64_t> step,
                 std::vector<held_copy>& dropped);
  /// Says once that this worker's copies at its buddy are a later round's
  /// (`later`), and sends no more.
  void superseded(std::int64_t later);
  /// Where `copy` (of `step`) was committed (seal()): sends it to
  /// the buddy (its files in pieces, then its manifest, then the list of
  /// the steps held) and drops the one that leaves the 2 newest. A failure is said once, and no
  /// copy is sent again: this rank's copies are on its node only.
  void send_to_buddy(std::uint64_t step, const std::filesystem::path& copy);
  /// restore(), with per-rank entries: the copies of this rank the buddy
  /// holds that are newer than its node's and not older than `floor` (the
  /// disk's), taken (checked against their manifests) and committed as this
  /// rank's. The newest taken, or -1.
  std::int64_t take_from_buddy(std::int64_t floor);

  /// A part that one rank sends to all (send_part): its record, a number
  /// that goes with it, and its piece `i` (4 MiB each).
  struct part_source {
    std::optional<file_record> record;
    std::int64_t extra = 0;
    std::function<std::string(std::uint64_t)> read;
  };
  /// The part `name` of the copy in `copy`, with its job's size as `extra`.
  static part_source file_source(const std::filesystem::path& copy, const std::string& name);
  /// The part `record` of a copy an agent holds at `prefix` (held_prefix()),
  /// read through `store` (connected at first use).
  static part_source held_source(std::function<store_client&()> store, std::string prefix,
                                 const file_record& record);
  /// `source`, read whole into `file` and checked against its record.
  static void write_part(const part_source& source, const std::filesystem::path& file);
  /// `partial` (its parts written) with `manifest_text` as its manifest,
  /// renamed to `copy` (an older copy there removed first): the one way a
  /// copy is committed.
  static void commit_copy(const std::filesystem::path& partial, std::string_view manifest_text,
                          const std::filesystem::path& copy);
  /// Every rank together: `root` sends `source` over the control plane, in
  /// pieces; each rank writes it into `into` (unless empty) and checks it.
  /// False when the root cannot send it (every rank knows); else `got`
  /// holds its size and checksum and `extra` the root's number, and
  /// `problem` this rank's error, if any. `into` empty: this rank does not
  /// want the bytes, and over the store's channel it reads none of them.
  bool send_part(int root, const part_source& source, const std::filesystem::path& into,
                 file_record& got, std::int64_t& extra, std::string& problem);
  /// Every rank together: whether `mine` holds on every rank.
  bool all_ok(bool mine);

  struct recut_result {
    std::optional<std::uint64_t> step;  // gathered: recut_dir_ holds it
    bool said = false;                  // copies were found, and why not is said
  };
  /// restore(), with sharded per-rank state, when no rank has a copy of this
  /// job's size: the newest step of the job before whose every rank's copy
  /// some rank reaches (on its node, or held by its node's agent for the
  /// node before it) is sent, part by part, to every rank, which keeps the
  /// replicated part and the rank parts its shards fall in (`entries`:
  /// registry::needs()), in recut_dir_ for files() to re-cut. Every rank together.
  recut_result recut(std::int64_t floor, const registry& entries);

  std::filesystem::path dir_;
  std::vector<int> node_;  // the ranks sharing dir_ (found at first use)
  std::string slice_id_;   // the node's first rank's: names this worker set's slices
  std::vector<std::filesystem::path> joined_;  // join_slices()'s, until the next copy
  std::uint64_t failures_ = 0;                 // copies not written
  std::map<std::uint64_t, std::filesystem::path> replicated_copy_;  // usable_replicated()'s
  std::string buddy_endpoint_;                                      // HOST:PORT; empty: none
  std::optional<store_client> buddy_;                               // connected at first use
  bool buddy_lost_ = false;               // a send failed: none is tried again
  std::optional<held_value> buddy_held_;  // what the buddy holds of this rank, as last seen
  std::string held_endpoint_;             // HOST:PORT of this node's agent's store; empty: none
  std::int64_t round_ = 0;                // this worker's (DTRAIN_RESTART_COUNT)
  std::optional<store_client> held_;
  std::filesystem::path recut_dir_;  // recut()'s assembly, until the next copy
  /// This rank's copies on its node, newest first, as this worker's saves
  /// left them (its directory listed at its first save, and after a restore
  /// or a save that failed: nullopt); whether a copy is set aside (spare_dir()).
  std::optional<std::vector<std::uint64_t>> own_;
  bool spare_ = false;
  /// The step of the save that listed the directory last: this worker wrote
  /// the copies from it on. Whether the copy set aside is one of them
  /// (open_staging() then removes none of its files, and lists nothing).
  std::uint64_t listed_at_ = 0;
  bool spare_known_ = false;

  /// seal(), once `step` is committed: this rank's copies beyond the 2
  /// newest go, but one, set aside for the next save to write over.
  void set_aside(std::uint64_t step);
};

}  // namespace dtrain::detail::ckpt

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/memory_tier-inl.hpp>
#endif
