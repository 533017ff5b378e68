#pragma once
/// @file
/// What a checkpoint is on disk, and the file operations that make writing it
/// atomic. dtrain::checkpoint (checkpoint/checkpoint.hpp) uses these; they take
/// no part in the protocol between ranks.
///
/// ```text
///   DIR/step-<N>/MANIFEST          written last: what the step holds (below)
///   DIR/step-<N>/replicated.dtck   the state every rank has alike (rank 0 writes it)
///   DIR/step-<N>/rank-<r>.dtck     rank r's own state (only when there is some)
///   DIR/step-<N>.partial/          a save in progress: never read
/// ```
///
/// A part file (.dtck): the magic "dtrainck", u32 format version, u32 entry
/// count, then per entry: u32 name length, the name, u8 kind (0 values, 1
/// bytes), u8 dtype, u16 zero, u32 dimensions, u64 per dimension, u64
/// payload bytes, the payload. Integers are in the host's byte order (a
/// checkpoint moves between hosts of the same byte order, as the weights'
/// floats must anyway).
///
/// The MANIFEST is text: "dtrain checkpoint 1", "step N", "world_size W",
/// one "file NAME BYTES CHECKSUM" per part, and "end CHECKSUM" over the lines
/// before it, so that a torn manifest is seen as one. Checksums are
/// detail::ckpt::checksum64 in 16 hex digits.
///
/// Every file is written as NAME.part, fsync'd and renamed; the step's
/// directory is written as `step-<N>.partial` and renamed to `step-<N>` once
/// every rank's part and the manifest are in it (the commit), and the parent
/// directory is fsync'd after each rename.

#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dtrain::detail::ckpt {

inline constexpr std::string_view manifest_name = "MANIFEST";
inline constexpr std::string_view replicated_name = "replicated.dtck";
inline constexpr std::string_view partial_suffix = ".partial";
inline constexpr std::string_view magic = "dtrainck";
inline constexpr std::uint32_t format_version = 1;
/// Bounds a reader trusts before it allocates: a name, dimensions, entries.
inline constexpr std::uint32_t max_name = 4096;
inline constexpr std::uint32_t max_dims = 32;
inline constexpr std::uint32_t max_entries = 1u << 20;

/// A sharded entry's payload: the whole array's element count, the ranges
/// this rank held (global first element, count), then their values packed in
/// range order. `values_at`: where the values start in the payload.
struct sharded_payload {
  std::uint64_t total = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;  // (global, count)
  std::size_t values_at = 0;
};

/// Reads a sharded entry's payload of elements of `element` bytes; throws
/// checkpoint_error naming `what` (the file and the entry) when it is not one.
DTRAIN_DETAIL_INLINE sharded_payload parse_sharded(std::string_view payload, std::size_t element,
                                                   const std::string& what);

/// Seconds from `start` to now.
[[nodiscard]] DTRAIN_DETAIL_INLINE double seconds_since(
    std::chrono::steady_clock::time_point start);

/// Memory for an asynchronous save's copy of one entry, kept for the next
/// save: allocated (not filled) when it grows.
class staging {
 public:
  void* reserve(std::size_t bytes);

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t capacity_ = 0;
};

/// One memcpy of an asynchronous save's copy.
struct copy_job {
  void* to = nullptr;
  const void* from = nullptr;
  std::size_t bytes = 0;
};

/// Runs `jobs` as one copy of their total bytes cut into `threads` equal
/// ranges (a range may span jobs): the calling thread copies the first, a
/// thread each of the others. Fewer threads when a range would be under 1 MiB.
DTRAIN_DETAIL_INLINE void copy_parallel(std::span<const copy_job> jobs, int threads);

/// "rank-<r>.dtck"
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string rank_part_name(int rank);
/// "step-<N>"
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string step_name(std::uint64_t step);
/// The step of a directory named "step-<N>" (digits only), else nullopt.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> step_of(std::string_view name);

/// A fast 64-bit checksum of a byte stream, fed in pieces of any size (the
/// same value however the stream is cut). Four lanes of 8-byte words, each
/// multiplied and rotated, folded and mixed at the end with the length: it
/// finds truncation, torn writes and flipped bits, not an attacker.
class checksum64 {
 public:
  void update(const void* data, std::size_t n) noexcept;
  [[nodiscard]] std::uint64_t value() const noexcept;
  [[nodiscard]] static std::uint64_t of(const void* data, std::size_t n) noexcept;

 private:
  static constexpr std::size_t block = 32;
  static constexpr std::uint64_t prime_a = 0x9e3779b185ebca87ull;
  static constexpr std::uint64_t prime_b = 0xc2b2ae3d27d4eb4full;
  void consume(const unsigned char* p) noexcept;
  std::array<std::uint64_t, 4> lanes_{0x60ea27eeadc0b5d6ull, 0xc2b2ae3d27d4eb4full, 0x1ull,
                                      0x61c8864e7a143579ull};
  std::array<unsigned char, block> buffer_{};
  std::size_t pending_ = 0;
  std::uint64_t total_ = 0;
};

/// 16 lowercase hex digits.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string hex64(std::uint64_t v);

/// "what PATH: strerror (errno N)" as a checkpoint_error.
[[noreturn]] DTRAIN_DETAIL_INLINE void fail_os(const std::string& what,
                                               const std::filesystem::path& path, int err);

/// fsync of a directory, so that the renames in it are on disk.
DTRAIN_DETAIL_INLINE void sync_directory(const std::filesystem::path& dir);

/// rename(2), with the error naming both paths.
DTRAIN_DETAIL_INLINE void rename_path(const std::filesystem::path& from,
                                      const std::filesystem::path& to);

/// A file of a checkpoint that cannot be read, or does not hold what its
/// manifest says (missing, truncated, corrupt): the step is skipped for the
/// one before, where a program's own state that does not fit ends the restore.
class damaged_part : public checkpoint_error {
 public:
  using checkpoint_error::checkpoint_error;
};

/// What a written file is: its size and checksum, as the manifest lists it.
struct file_record {
  std::string name;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
};

/// Writes one file atomically: to PATH.part, fsync'd, then renamed to PATH by
/// finish(). Everything written goes through the checksum. Destroyed before
/// finish(), it removes PATH.part.
///
/// `in_place` (the memory tier's): PATH itself is written, over the file
/// there if any (of a copy set aside to be written again), not truncated
/// first, and cut to its new length at finish(); not fsync'd, and not
/// renamed. In a tmpfs a file's pages are used again, where a new file's are
/// allocated and zeroed (and the old one's freed), which costs more than the
/// write itself. The file's directory is what commits it (a memory copy's
/// directory is renamed whole once its manifest is written), so a writer
/// killed half way leaves a file no copy names; and a memory copy is to
/// outlive its worker's process, not the machine, so the page cache holds it
/// once write() returns: an fsync and two renames per file were most of what a
/// small copy cost.
class atomic_file {
 public:
  explicit atomic_file(std::filesystem::path path, bool in_place = false);
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file();

  /// Small pieces (headers) gather in a buffer; large ones go straight out.
  void write(const void* data, std::size_t n);
  template <class T>
  void write_value(const T& v) {
    write(&v, sizeof v);
  }

  /// Flushes, fsyncs, closes and renames to the final name.
  file_record finish();

 private:
  static constexpr std::size_t buffer_limit = 1u << 16;
  void flush();
  void write_all(const void* data, std::size_t n);

  std::filesystem::path path_, part_;
  unique_fd fd_;
  std::string pending_;
  checksum64 checksum_;
  std::uint64_t bytes_ = 0;
  bool in_place_ = false;
};

/// What a part file says about one entry.
enum class entry_kind : std::uint8_t { values = 0, bytes = 1, sharded = 2 };
struct entry_header {
  std::string name;
  entry_kind kind = entry_kind::values;
  dtype type = dtype::uint8;
  std::vector<std::uint64_t> shape;
  std::uint64_t bytes = 0;   ///< of the payload
  std::uint64_t offset = 0;  ///< of the payload in the file
};

/// Writes a part file's header; then entry() once per entry, in order.
DTRAIN_DETAIL_INLINE void write_part_header(atomic_file& file, std::uint32_t entries);
DTRAIN_DETAIL_INLINE void write_entry(atomic_file& file, std::string_view name, entry_kind kind,
                                      dtype type, std::span<const std::uint64_t> shape,
                                      const void* payload, std::uint64_t bytes);
/// An entry's header alone, of a payload of `bytes` that the caller writes next.
DTRAIN_DETAIL_INLINE void write_entry_head(atomic_file& file, std::string_view name,
                                           entry_kind kind, dtype type,
                                           std::span<const std::uint64_t> shape,
                                           std::uint64_t bytes);

/// A part file read through once: its entries (payloads not kept), size and
/// checksum. Throws checkpoint_error naming the file and what is wrong with it.
struct part_contents {
  std::vector<entry_header> entries;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
};

/// Sequential reads that checksum what they read and know where they are.
class checked_reader {
 public:
  /// `checksummed` false: reads without the checksum (of a file checked before).
  explicit checked_reader(std::filesystem::path path, bool checksummed = true);
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t checksum() const noexcept { return checksum_.value(); }

  /// Reads exactly n bytes into out (nullptr: checksummed and dropped); a
  /// file that ends first is "truncated" (naming what was being read).
  void read(void* out, std::uint64_t n, std::string_view what);
  /// Moves n bytes on without reading them (a seek): the checksum no longer
  /// covers the file, and checksum() is not to be used after it. For a look at
  /// a file's structure (registry::needs()), not for a check.
  void skip(std::uint64_t n, std::string_view what);
  template <class T>
  T value(std::string_view what) {
    T v{};
    read(&v, sizeof v, what);
    return v;
  }
  [[noreturn]] void malformed(const std::string& why) const;

 private:
  std::filesystem::path path_;
  unique_fd fd_;
  std::uint64_t size_ = 0, offset_ = 0;
  checksum64 checksum_;
  bool checksummed_ = true;
};

/// What read_part hands each entry's payload to: any callable
/// `(const entry_header&, checked_reader&)`, referred to, not copied (it must
/// outlive the call, as a lambda argument does), so that read_part is compiled once.
class part_sink {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, part_sink> &&
           std::is_invocable_v<F&, const entry_header&, checked_reader&>) part_sink(F&& f)
  noexcept  // NOLINT(google-explicit-constructor): a lambda is the argument
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, const entry_header& e, checked_reader& in) {
          (*static_cast<std::remove_reference_t<F>*>(object))(e, in);
        }) {}
  void operator()(const entry_header& e, checked_reader& in) const { call_(object_, e, in); }

 private:
  void* object_;
  void (*call_)(void*, const entry_header&, checked_reader&);
};

/// Reads the whole part file: its structure and its checksum. Each entry's
/// payload is handed to sink(header, reader) to read (exactly header.bytes).
/// `checksummed` false: without the checksum (0), for a file whose checksum
/// was checked already (registry::load() after registry::check()).
DTRAIN_DETAIL_INLINE part_contents read_part(const std::filesystem::path& path, part_sink sink,
                                             bool checksummed = true);
/// The same with every payload read and dropped.
DTRAIN_DETAIL_INLINE part_contents read_part(const std::filesystem::path& path);

/// The manifest: what one committed step holds.
struct manifest {
  std::uint64_t step = 0;
  int world_size = 0;
  std::vector<file_record> files;

  [[nodiscard]] const file_record* find(std::string_view name) const;
};

[[nodiscard]] DTRAIN_DETAIL_INLINE std::string render(const manifest& m);

/// Parses a manifest's text; throws checkpoint_error naming `path` and the line.
[[nodiscard]] DTRAIN_DETAIL_INLINE manifest parse_manifest(std::string_view text,
                                                           const std::filesystem::path& path);

/// Reads a small file whole (a manifest).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string read_small_file(const std::filesystem::path& path,
                                                               std::size_t limit = 1u << 24);

/// A step directory's manifest, read and parsed.
[[nodiscard]] DTRAIN_DETAIL_INLINE manifest read_manifest(const std::filesystem::path& step_dir);

/// Reads `file` whole and checks it against the manifest's `record`: its size
/// and checksum. Returns what it holds; throws checkpoint_error naming the file.
DTRAIN_DETAIL_INLINE part_contents read_checked_part(const std::filesystem::path& file,
                                                     const file_record& record);

/// Checks a committed step directory against its manifest: every listed file
/// present, of its size, and (`contents`) of its checksum, which reads it
/// whole. Returns the manifest; throws checkpoint_error naming the first file
/// that is wrong.
DTRAIN_DETAIL_INLINE manifest verify_step(const std::filesystem::path& step_dir,
                                          bool contents = true);

}  // namespace dtrain::detail::ckpt

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/checkpoint/format-inl.hpp>
#endif
