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

/// What a written file is: its size and checksum, as the manifest lists it.
struct file_record {
  std::string name;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
};

/// Writes one file atomically: to PATH.part, fsync'd, then renamed to PATH by
/// finish(). Everything written goes through the checksum. Destroyed before
/// finish(), it removes PATH.part.
class atomic_file {
 public:
  explicit atomic_file(std::filesystem::path path);
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
  explicit checked_reader(std::filesystem::path path);
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t checksum() const noexcept { return checksum_.value(); }

  /// Reads exactly n bytes into out (nullptr: checksummed and dropped); a
  /// file that ends first is "truncated" (naming what was being read).
  void read(void* out, std::uint64_t n, std::string_view what);
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
DTRAIN_DETAIL_INLINE part_contents read_part(const std::filesystem::path& path, part_sink sink);
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
/// present, of its size and checksum. Returns the manifest; throws
/// checkpoint_error naming the first file that is wrong.
DTRAIN_DETAIL_INLINE manifest verify_step(const std::filesystem::path& step_dir);

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE sharded_payload parse_sharded(std::string_view payload, std::size_t element,
                                                   const std::string& what) {
  auto fail = [&](const std::string& why) -> void {
    throw checkpoint_error("checkpoint: " + what + " is not a sharded entry: " + why);
  };
  auto word = [&](std::size_t at) {
    std::uint64_t v = 0;
    std::memcpy(&v, payload.data() + at, sizeof v);
    return v;
  };
  sharded_payload out;
  if (payload.size() < 16) fail(std::to_string(payload.size()) + " bytes");
  out.total = word(0);
  const std::uint64_t n = word(8);
  if (n > (payload.size() - 16) / 16)
    fail(std::to_string(n) + " ranges in " + std::to_string(payload.size()) + " bytes");
  std::uint64_t elements = 0;
  for (std::uint64_t r = 0; r < n; ++r) {
    const std::uint64_t global = word(16 + 16 * r), count = word(24 + 16 * r);
    if (global > out.total || count > out.total - global)
      fail("range " + std::to_string(global) + "+" + std::to_string(count) + " of " +
           std::to_string(out.total));
    out.ranges.emplace_back(global, count);
    elements += count;
  }
  out.values_at = static_cast<std::size_t>(16 + 16 * n);
  if (elements > (payload.size() - out.values_at) / element ||
      elements * element != payload.size() - out.values_at)
    fail(std::to_string(elements) + " elements in " +
         std::to_string(payload.size() - out.values_at) + " bytes");
  return out;
}

DTRAIN_DETAIL_INLINE double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

DTRAIN_DETAIL_INLINE void* staging::reserve(std::size_t bytes) {
  if (bytes > capacity_) {
    data_.reset();
    data_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
    capacity_ = bytes;
  }
  return data_.get();
}

DTRAIN_DETAIL_INLINE void copy_parallel(std::span<const copy_job> jobs, int threads) {
  std::size_t total = 0;
  for (const copy_job& j : jobs) total += j.bytes;
  constexpr std::size_t min_range = std::size_t{1} << 20;
  const std::size_t ranges =
      std::clamp<std::size_t>(total / min_range, 1, static_cast<std::size_t>(std::max(1, threads)));
  // Copies bytes [begin, end) of the concatenation of `jobs`.
  auto copy_range = [jobs](std::size_t begin, std::size_t end) {
    std::size_t offset = 0;  // of the job below in the concatenation
    for (const copy_job& j : jobs) {
      const std::size_t lo = std::max(begin, offset), hi = std::min(end, offset + j.bytes);
      if (lo < hi) {
        std::memcpy(static_cast<char*>(j.to) + (lo - offset),
                    static_cast<const char*>(j.from) + (lo - offset), hi - lo);
      }
      offset += j.bytes;
      if (offset >= end) break;
    }
  };
  const std::size_t per = (total + ranges - 1) / ranges;
  std::vector<std::jthread> helpers;
  helpers.reserve(ranges - 1);
  for (std::size_t r = 1; r < ranges; ++r) {
    helpers.emplace_back(copy_range, std::min(total, r * per), std::min(total, (r + 1) * per));
  }
  copy_range(0, std::min(total, per));
}

DTRAIN_DETAIL_INLINE std::string rank_part_name(int rank) {
  return "rank-" + std::to_string(rank) + ".dtck";
}

DTRAIN_DETAIL_INLINE std::string step_name(std::uint64_t step) {
  return "step-" + std::to_string(step);
}

DTRAIN_DETAIL_INLINE std::optional<std::uint64_t> step_of(std::string_view name) {
  constexpr std::string_view prefix = "step-";
  if (!name.starts_with(prefix) || name.size() == prefix.size() || name.size() > prefix.size() + 19)
    return std::nullopt;
  name.remove_prefix(prefix.size());
  std::uint64_t step = 0;
  auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), step);
  if (ec != std::errc{} || end != name.data() + name.size()) return std::nullopt;
  return step;
}

DTRAIN_DETAIL_INLINE void checksum64::update(const void* data, std::size_t n) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += n;
  if (pending_ > 0) {
    const std::size_t take = std::min(n, block - pending_);
    std::memcpy(buffer_.data() + pending_, p, take);
    pending_ += take;
    p += take;
    n -= take;
    if (pending_ < block) return;
    consume(buffer_.data());
    pending_ = 0;
  }
  for (; n >= block; p += block, n -= block) consume(p);
  std::memcpy(buffer_.data(), p, n);
  pending_ = n;
}

DTRAIN_DETAIL_INLINE std::uint64_t checksum64::value() const noexcept {
  std::uint64_t h = std::rotl(lanes_[0], 1) + std::rotl(lanes_[1], 7) + std::rotl(lanes_[2], 12) +
                    std::rotl(lanes_[3], 18);
  h ^= total_ * prime_a;
  for (std::size_t i = 0; i < pending_; ++i) h = std::rotl(h ^ buffer_[i], 11) * prime_a;
  h ^= h >> 33;
  h *= prime_b;
  h ^= h >> 29;
  h *= prime_a;
  return h ^ (h >> 32);
}

DTRAIN_DETAIL_INLINE std::uint64_t checksum64::of(const void* data, std::size_t n) noexcept {
  checksum64 c;
  c.update(data, n);
  return c.value();
}

DTRAIN_DETAIL_INLINE void checksum64::consume(const unsigned char* p) noexcept {
  for (std::size_t lane = 0; lane < 4; ++lane) {
    std::uint64_t word = 0;
    std::memcpy(&word, p + 8 * lane, 8);
    lanes_[lane] = std::rotl(lanes_[lane] + word * prime_b, 31) * prime_a;
  }
}

DTRAIN_DETAIL_INLINE std::string hex64(std::uint64_t v) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4)
    out[static_cast<std::size_t>(i)] = "0123456789abcdef"[v & 15];
  return out;
}

DTRAIN_DETAIL_INLINE void fail_os(const std::string& what, const std::filesystem::path& path,
                                  int err) {
  throw checkpoint_error("checkpoint: " + what + " " + path.string() + ": " + std::strerror(err) +
                         " (errno " + std::to_string(err) + ")");
}

DTRAIN_DETAIL_INLINE void sync_directory(const std::filesystem::path& dir) {
  unique_fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) fail_os("cannot open directory", dir, errno);
  if (::fsync(fd.get()) != 0 && errno != EINVAL) fail_os("cannot sync directory", dir, errno);
}

DTRAIN_DETAIL_INLINE void rename_path(const std::filesystem::path& from,
                                      const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    throw checkpoint_error("checkpoint: cannot rename " + from.string() + " to " + to.string() +
                           ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
}

DTRAIN_DETAIL_INLINE atomic_file::atomic_file(std::filesystem::path path)
    : path_(std::move(path)), part_(path_.string() + ".part") {
  fd_.reset(::open(part_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd_) fail_os("cannot create", part_, errno);
}

DTRAIN_DETAIL_INLINE atomic_file::~atomic_file() {
  if (fd_) {
    fd_.reset();
    ::unlink(part_.c_str());
  }
}

DTRAIN_DETAIL_INLINE void atomic_file::write(const void* data, std::size_t n) {
  checksum_.update(data, n);
  bytes_ += n;
  if (pending_.size() + n <= buffer_limit) {
    pending_.append(static_cast<const char*>(data), n);
    return;
  }
  flush();
  write_all(data, n);
}

DTRAIN_DETAIL_INLINE file_record atomic_file::finish() {
  flush();
  if (::fsync(fd_.get()) != 0) fail_os("cannot sync", part_, errno);
  if (::close(fd_.get()) != 0) {
    const int err = errno;
    static_cast<void>(fd_.release());
    fail_os("cannot close", part_, err);
  }
  static_cast<void>(fd_.release());
  rename_path(part_, path_);
  return {path_.filename().string(), bytes_, checksum_.value()};
}

DTRAIN_DETAIL_INLINE void atomic_file::flush() {
  if (pending_.empty()) return;
  write_all(pending_.data(), pending_.size());
  pending_.clear();
}

DTRAIN_DETAIL_INLINE void atomic_file::write_all(const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ::ssize_t w = ::write(fd_.get(), p, std::min<std::size_t>(n, 1u << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_os("cannot write", part_, errno);
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

DTRAIN_DETAIL_INLINE void write_part_header(atomic_file& file, std::uint32_t entries) {
  file.write(magic.data(), magic.size());
  file.write_value(format_version);
  file.write_value(entries);
}

DTRAIN_DETAIL_INLINE void write_entry(atomic_file& file, std::string_view name, entry_kind kind,
                                      dtype type, std::span<const std::uint64_t> shape,
                                      const void* payload, std::uint64_t bytes) {
  file.write_value(static_cast<std::uint32_t>(name.size()));
  file.write(name.data(), name.size());
  file.write_value(static_cast<std::uint8_t>(kind));
  file.write_value(static_cast<std::uint8_t>(type));
  file.write_value(std::uint16_t{0});
  file.write_value(static_cast<std::uint32_t>(shape.size()));
  for (std::uint64_t d : shape) file.write_value(d);
  file.write_value(bytes);
  if (bytes > 0) file.write(payload, static_cast<std::size_t>(bytes));
}

DTRAIN_DETAIL_INLINE checked_reader::checked_reader(std::filesystem::path path)
    : path_(std::move(path)) {
  fd_.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd_) fail_os("cannot open", path_, errno);
  struct ::stat st {};
  if (::fstat(fd_.get(), &st) != 0) fail_os("cannot stat", path_, errno);
  size_ = static_cast<std::uint64_t>(st.st_size);
}

DTRAIN_DETAIL_INLINE void checked_reader::read(void* out, std::uint64_t n, std::string_view what) {
  if (n > size_ - offset_) {
    throw checkpoint_error("checkpoint: " + path_.string() + " is truncated: it ends at byte " +
                           std::to_string(size_) + " inside " + std::string(what) +
                           " (which needs " + std::to_string(n) + " bytes from byte " +
                           std::to_string(offset_) + ")");
  }
  std::array<char, 1 << 16> scratch{};
  auto* dst = static_cast<char*>(out);
  while (n > 0) {
    const std::size_t want = std::min<std::uint64_t>(n, dst ? (1u << 30) : scratch.size());
    char* into = dst ? dst : scratch.data();
    const ::ssize_t r = ::read(fd_.get(), into, want);
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_os("cannot read", path_, errno);
    }
    if (r == 0) {
      throw checkpoint_error("checkpoint: " + path_.string() + " ended early at byte " +
                             std::to_string(offset_) + " (changed while being read?)");
    }
    checksum_.update(into, static_cast<std::size_t>(r));
    offset_ += static_cast<std::uint64_t>(r);
    n -= static_cast<std::uint64_t>(r);
    if (dst) dst += r;
  }
}

DTRAIN_DETAIL_INLINE void checked_reader::malformed(const std::string& why) const {
  throw checkpoint_error("checkpoint: " + path_.string() + " is not a dtrain checkpoint part: " +
                         why + " (at byte " + std::to_string(offset_) + ")");
}

DTRAIN_DETAIL_INLINE part_contents read_part(const std::filesystem::path& path, part_sink sink) {
  checked_reader in(path);
  std::array<char, magic.size()> head{};
  in.read(head.data(), head.size(), "the magic");
  if (std::string_view(head.data(), head.size()) != magic) in.malformed("its magic is wrong");
  const auto version = in.value<std::uint32_t>("the format version");
  if (version != format_version) {
    in.malformed("format version " + std::to_string(version) + ", this dtrain reads " +
                 std::to_string(format_version));
  }
  const auto count = in.value<std::uint32_t>("the entry count");
  if (count > max_entries) in.malformed(std::to_string(count) + " entries");
  part_contents out;
  out.entries.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    entry_header e;
    const auto name_length = in.value<std::uint32_t>("an entry's name length");
    if (name_length > max_name)
      in.malformed("an entry name of " + std::to_string(name_length) + " bytes");
    e.name.resize(name_length);
    in.read(e.name.data(), name_length, "an entry's name");
    const auto kind = in.value<std::uint8_t>("entry '" + e.name + "'");
    const auto type = in.value<std::uint8_t>("entry '" + e.name + "'");
    static_cast<void>(in.value<std::uint16_t>("entry '" + e.name + "'"));
    if (kind > 2 || type > static_cast<std::uint8_t>(dtype::uint8))
      in.malformed("entry '" + e.name + "' has kind " + std::to_string(kind) + ", type " +
                   std::to_string(type));
    e.kind = static_cast<entry_kind>(kind);
    e.type = static_cast<dtype>(type);
    const auto dims = in.value<std::uint32_t>("entry '" + e.name + "'");
    if (dims > max_dims)
      in.malformed("entry '" + e.name + "' has " + std::to_string(dims) + " dimensions");
    for (std::uint32_t d = 0; d < dims; ++d) e.shape.push_back(in.value<std::uint64_t>("a shape"));
    e.bytes = in.value<std::uint64_t>("entry '" + e.name + "'");
    e.offset = in.offset();
    if (e.bytes > in.size() - in.offset()) {
      in.read(nullptr, e.bytes, "the values of entry '" + e.name + "'");  // throws: truncated
    }
    sink(e, in);
    if (in.offset() != e.offset + e.bytes) in.malformed("entry '" + e.name + "' was read short");
    out.entries.push_back(std::move(e));
  }
  if (in.offset() != in.size()) {
    in.malformed(std::to_string(in.size() - in.offset()) + " bytes after the last entry");
  }
  out.bytes = in.size();
  out.checksum = in.checksum();
  return out;
}

DTRAIN_DETAIL_INLINE part_contents read_part(const std::filesystem::path& path) {
  return read_part(path, [](const entry_header& e, checked_reader& in) {
    in.read(nullptr, e.bytes, "the values of entry '" + e.name + "'");
  });
}

DTRAIN_DETAIL_INLINE const file_record* manifest::find(std::string_view name) const {
  for (const file_record& f : files)
    if (f.name == name) return &f;
  return nullptr;
}

DTRAIN_DETAIL_INLINE std::string render(const manifest& m) {
  std::string body = "dtrain checkpoint " + std::to_string(format_version) + "\nstep " +
                     std::to_string(m.step) + "\nworld_size " + std::to_string(m.world_size) + "\n";
  for (const file_record& f : m.files) {
    body += "file " + f.name + " " + std::to_string(f.bytes) + " " + hex64(f.checksum) + "\n";
  }
  return body + "end " + hex64(checksum64::of(body.data(), body.size())) + "\n";
}

DTRAIN_DETAIL_INLINE manifest parse_manifest(std::string_view text,
                                             const std::filesystem::path& path) {
  auto bad = [&](const std::string& why) -> checkpoint_error {
    return checkpoint_error("checkpoint: " + path.string() + " is torn or not a manifest: " + why);
  };
  const std::size_t end_at = text.rfind("end ");
  if (end_at == std::string_view::npos || (end_at > 0 && text[end_at - 1] != '\n'))
    throw bad("it has no end line (a save that stopped while writing it)");
  const std::string_view body = text.substr(0, end_at);
  const std::string_view end_line = text.substr(end_at + 4);
  if (end_line != hex64(checksum64::of(body.data(), body.size())) + "\n")
    throw bad("its end line does not match its checksum");
  manifest m;
  bool have_step = false, have_world = false;
  std::size_t line_number = 0;
  for (std::size_t at = 0; at < body.size();) {
    const std::size_t nl = body.find('\n', at);
    const std::string_view line = body.substr(at, nl - at);
    at = nl + 1;
    ++line_number;
    std::vector<std::string_view> words;
    for (std::size_t w = 0; w < line.size();) {
      const std::size_t sp = std::min(line.find(' ', w), line.size());
      words.push_back(line.substr(w, sp - w));
      w = sp + 1;
    }
    auto number = [&](std::string_view s, int base = 10) {
      std::uint64_t v = 0;
      auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
      if (ec != std::errc{} || p != s.data() + s.size())
        throw bad("line " + std::to_string(line_number) + ": '" + std::string(s) +
                  "' is not a number");
      return v;
    };
    if (line_number == 1) {
      if (line != "dtrain checkpoint " + std::to_string(format_version))
        throw bad("its first line is '" + std::string(line) + "'");
    } else if (words.size() == 2 && words[0] == "step") {
      m.step = number(words[1]);
      have_step = true;
    } else if (words.size() == 2 && words[0] == "world_size") {
      const std::uint64_t w = number(words[1]);
      if (w == 0 || w > 1u << 24) throw bad("world_size " + std::to_string(w));
      m.world_size = static_cast<int>(w);
      have_world = true;
    } else if (words.size() == 4 && words[0] == "file" && words[3].size() == 16) {
      m.files.push_back({std::string(words[1]), number(words[2]), number(words[3], 16)});
    } else {
      throw bad("line " + std::to_string(line_number) + " is '" + std::string(line) + "'");
    }
  }
  if (!have_step || !have_world) throw bad("it lacks its step or world_size line");
  return m;
}

DTRAIN_DETAIL_INLINE std::string read_small_file(const std::filesystem::path& path,
                                                 std::size_t limit) {
  checked_reader in(path);
  if (in.size() > limit) {
    throw checkpoint_error("checkpoint: " + path.string() + " has " + std::to_string(in.size()) +
                           " bytes, more than a manifest can");
  }
  std::string text(static_cast<std::size_t>(in.size()), '\0');
  in.read(text.data(), text.size(), "the file");
  return text;
}

DTRAIN_DETAIL_INLINE manifest read_manifest(const std::filesystem::path& step_dir) {
  const std::filesystem::path manifest_path = step_dir / manifest_name;
  return parse_manifest(read_small_file(manifest_path), manifest_path);
}

DTRAIN_DETAIL_INLINE part_contents read_checked_part(const std::filesystem::path& file,
                                                     const file_record& record) {
  part_contents got = read_part(file);
  if (got.bytes != record.bytes) {
    throw checkpoint_error("checkpoint: " + file.string() + " has " + std::to_string(got.bytes) +
                           " bytes, its manifest says " + std::to_string(record.bytes) +
                           " (truncated or overwritten)");
  }
  if (got.checksum != record.checksum) {
    throw checkpoint_error("checkpoint: " + file.string() + " has checksum " + hex64(got.checksum) +
                           ", its manifest says " + hex64(record.checksum) + " (corrupt)");
  }
  return got;
}

DTRAIN_DETAIL_INLINE manifest verify_step(const std::filesystem::path& step_dir) {
  manifest m = read_manifest(step_dir);
  for (const file_record& f : m.files) static_cast<void>(read_checked_part(step_dir / f.name, f));
  return m;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail::ckpt
