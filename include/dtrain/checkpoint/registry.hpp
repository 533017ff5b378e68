#pragma once
/// @file
/// What a checkpoint holds, apart from where it goes: the registry of its
/// entries (values in host memory, a program's own bytes, sharded arrays) and
/// the hooks around them; what a save writes of them (a snapshot), and how a
/// checked part is read back into them, a sharded entry re-cut for this
/// rank. Where the parts go is a storage tier's (checkpoint/tier.hpp).

#include <dtrain/backend/types.hpp>
#include <dtrain/checkpoint/format.hpp>
#include <dtrain/checkpoint/options.hpp>
#include <dtrain/config.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail::ckpt {

/// One entry's bytes to write: the live memory, or a copy of it.
struct part_record {
  std::string_view name;
  entry_kind kind = entry_kind::values;
  dtype type = dtype::uint8;
  std::span<const std::uint64_t> shape;
  const void* data = nullptr;
  std::uint64_t bytes = 0;
  /// A range of a values entry (a slice's: slice_of), written as a sharded
  /// entry of one range: the whole's element count, 1, the range's first
  /// element and its count, then `bytes` at `data` (its values).
  bool ranged = false;
  std::array<std::uint64_t, 4> range{};
};

/// Which of the entries of a scope one rank writes, when `count` ranks share
/// the writing (the memory tier cuts a node's replicated part among the
/// node's ranks): a values entry of `split_from` bytes or more is cut into
/// `count` ranges of elements, the `index`-th written here; the other entries
/// are dealt whole, in the order added, the j-th to the rank of index j %
/// count. `count` 1: all of them, whole.
struct slice_of {
  int index = 0;
  int count = 1;
  static constexpr std::size_t split_from = std::size_t{64} << 10;
};

/// What one rank writes for one scope: the records, and what they point into.
struct part_snapshot {
  std::vector<part_record> records;
  std::vector<std::string> owned;  // bytes entries' save() results
  bool reads_live = false;         // a record points at an entry's live memory
};

/// The ranges a saved rank part holds of each sharded entry, by name:
/// (global first element, count). nullopt when the part cannot be read.
using saved_ranges =
    std::optional<std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>>>;

/// Reads the ranges of the sharded payloads of the part at `path` (those of
/// entries `sharded(name)` says are sharded): their headers only, seeking over
/// the values, so that it costs a few small reads per entry and not the
/// part's size. Nothing is checked against the checksum: a part then read is.
DTRAIN_DETAIL_INLINE saved_ranges part_ranges(
    const std::filesystem::path& path, const std::function<bool(const std::string&)>& sharded);

/// The entries one rank registered with its checkpoint, in the order added.
class registry {
 public:
  /// `rank` names this rank in errors; `copy_threads` copy an asynchronous save's state.
  registry(int rank, int copy_threads) : rank_(rank), copy_threads_(copy_threads) {}

  /// Values in host memory, restored in place.
  void add_values(std::string name, buffer values, checkpoint_scope scope,
                  std::vector<std::uint64_t> shape);
  /// This rank's `ranges` of a whole array of `total` elements, in `values`.
  void add_sharded(std::string name, buffer values, std::vector<shard_range> ranges,
                   std::uint64_t total);
  /// Bytes the program makes (`save`) and takes back (`load`).
  void add_bytes(std::string name, std::function<std::string()> save,
                 std::function<void(std::string_view)> load, checkpoint_scope scope);
  /// Functions run before each save reads the entries, and after a restore wrote them.
  void add_hooks(std::function<void()> before_save, std::function<void()> after_restore);
  /// Host memory of `bytes` that lives as long as the registry (add_sharded(name, ddp)'s array).
  std::span<std::byte> scratch(std::size_t bytes);

  [[nodiscard]] bool has_scope(checkpoint_scope scope) const;
  /// Whether every per-rank entry is sharded (re-cut for another world size).
  [[nodiscard]] bool per_rank_recuts() const;

  /// Runs the before_save hooks.
  void before_save() const;
  /// The records of `scope`'s entries. A values entry of `live_from` bytes
  /// or more is recorded where it lives (read by the writer: a synchronous
  /// save, 0; or a memory copy read beside the step, whose training changes
  /// nothing until it is released); a smaller one is copied into owned memory
  /// (an asynchronous save's, whose training goes on while the files are
  /// written: never_live), each entry's copy number `slot` (one per storage
  /// tier: each tier has one save in flight at a time). Adds the copy's time
  /// to `copy_seconds`. `slice`: the entries, and ranges, this rank writes.
  part_snapshot snapshot(checkpoint_scope scope, std::size_t live_from, std::size_t slot,
                         double& copy_seconds, slice_of slice = {});
  static constexpr std::size_t never_live = static_cast<std::size_t>(-1);

  /// The files this rank loads of manifest `m`, whose files are at
  /// path_of(name), checked: each file's size and checksum (a file that does
  /// not match throws damaged_part), and every entry against the registered
  /// ones (checkpoint_error); `where` names the copy in errors.
  /// `world_size`: this job's (sharded entries are re-cut from the old ranks'
  /// parts that hold some of this rank's elements, needs(), when the
  /// checkpoint's differs: the others are not read; other per-rank state
  /// cannot be re-cut; `listed_parts`: from the rank parts `m` lists, which
  /// may be fewer, as the memory tier chose them).
  [[nodiscard]] std::vector<std::filesystem::path> check(
      const manifest& m, const std::function<std::filesystem::path(const std::string&)>& path_of,
      const std::filesystem::path& where, int world_size, bool listed_parts = false) const;
  /// Whether the saved rank part at `part` (of a job of another size) holds
  /// any element of a sharded entry that this rank holds: a re-cut reads
  /// none of a part that holds none. True when it cannot tell (load() then
  /// says what is wrong with it).
  [[nodiscard]] bool needs(const std::filesystem::path& part) const;
  /// The same from the ranges a part holds (part_ranges()).
  [[nodiscard]] bool needs(const saved_ranges& ranges) const;
  /// Reads checked `files` into the entries (each sharded entry must get
  /// every element this rank holds), then runs the after_restore hooks.
  void load(const std::vector<std::filesystem::path>& files);

 private:
  struct entry {
    std::string name;
    checkpoint_scope scope = checkpoint_scope::replicated;
    entry_kind kind = entry_kind::values;
    buffer values;
    std::vector<std::uint64_t> shape;
    std::function<std::string()> save;
    std::function<void(std::string_view)> load;
    std::vector<staging> staged;      // a copy of `values` per storage tier (snapshot's slot)
    std::vector<shard_range> ranges;  // a sharded entry's: what this rank holds
    std::uint64_t total = 0;          // of the whole sharded array
  };
  struct hook {
    std::function<void()> before_save, after_restore;
  };

  entry& push(entry e);
  /// A sharded entry as it is written: the whole's size, the ranges, their values.
  static std::string sharded_payload(const entry& e);
  /// "[64, 16] float32" (or "1024 float32" without a shape).
  static std::string describe(entry_kind kind, dtype type, const std::vector<std::uint64_t>& shape,
                              std::uint64_t bytes);
  /// Reads a checked file into the registered entries.
  void apply(const std::filesystem::path& path);
  /// The parts of a saved sharded entry (`payload`, from `file`) that fall in
  /// the ranges this rank holds, copied into its values; counted in `recut_`.
  void recut(entry& e, std::string_view payload, const std::filesystem::path& file);
  /// After every part is read: each sharded entry got every element this rank holds.
  void check_recut() const;
  /// Throws, as check_recut(), unless `saved` (the ranges of the parts this
  /// rank will read, by entry) hold every element of its sharded entries.
  void check_cover(
      const std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>>& saved)
      const;
  /// Of the global intervals `got` (the parts of this rank's elements it got,
  /// overlapping or not), how many elements, each counted once.
  static std::uint64_t union_size(std::vector<std::pair<std::uint64_t, std::uint64_t>> got);
  /// check_cover()'s and check_recut()'s: throws unless the checkpoint's
  /// ranks held all `needed` elements of `e` that this rank holds (`had`).
  void expect_cover(const entry& e, std::uint64_t had, std::uint64_t needed) const;
  /// Whether `name` is a sharded entry registered here.
  [[nodiscard]] bool is_sharded(const std::string& name) const;

  int rank_ = 0;
  int copy_threads_ = 1;
  std::vector<entry> entries_;
  std::vector<hook> hooks_;
  std::list<std::vector<std::byte>> scratch_;  // scratch()'s arrays (a list: they never move)
  // load(): the global intervals each sharded entry got, of the elements this rank holds
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> recut_;
};

}  // namespace dtrain::detail::ckpt

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/registry-inl.hpp>
#endif
