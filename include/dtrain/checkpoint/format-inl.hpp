#pragma once
/// @file
/// The non-template bodies of dtrain/checkpoint/format.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/checkpoint/format.hpp, not this file.

#include <dtrain/checkpoint/format.hpp>

namespace dtrain::detail::ckpt {

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

DTRAIN_DETAIL_INLINE atomic_file::atomic_file(std::filesystem::path path, bool in_place)
    : path_(std::move(path)),
      part_(in_place ? path_ : std::filesystem::path(path_.string() + ".part")),
      in_place_(in_place) {
  fd_.reset(
      ::open(part_.c_str(), O_WRONLY | O_CREAT | (in_place_ ? 0 : O_TRUNC) | O_CLOEXEC, 0644));
  if (!fd_) fail_os("cannot create", part_, errno);
}

DTRAIN_DETAIL_INLINE atomic_file::~atomic_file() {
  if (fd_) {
    fd_.reset();
    ::unlink(part_.c_str());  // (in place: a file half written, of a copy not committed)
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
  if (in_place_) {  // cut to its length (a file written over may be longer)
    struct ::stat st {};
    if (::fstat(fd_.get(), &st) != 0) fail_os("cannot look at", part_, errno);
    if (static_cast<std::uint64_t>(st.st_size) != bytes_ &&
        ::ftruncate(fd_.get(), static_cast<::off_t>(bytes_)) != 0) {
      fail_os("cannot cut to its length", part_, errno);
    }
  }
  if (!in_place_ && ::fsync(fd_.get()) != 0) fail_os("cannot sync", part_, errno);
  if (::close(fd_.get()) != 0) {
    const int err = errno;
    static_cast<void>(fd_.release());
    fail_os("cannot close", part_, err);
  }
  static_cast<void>(fd_.release());
  if (!in_place_) rename_path(part_, path_);
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
  write_entry_head(file, name, kind, type, shape, bytes);
  if (bytes > 0) file.write(payload, static_cast<std::size_t>(bytes));
}

DTRAIN_DETAIL_INLINE void write_entry_head(atomic_file& file, std::string_view name,
                                           entry_kind kind, dtype type,
                                           std::span<const std::uint64_t> shape,
                                           std::uint64_t bytes) {
  file.write_value(static_cast<std::uint32_t>(name.size()));
  file.write(name.data(), name.size());
  file.write_value(static_cast<std::uint8_t>(kind));
  file.write_value(static_cast<std::uint8_t>(type));
  file.write_value(std::uint16_t{0});
  file.write_value(static_cast<std::uint32_t>(shape.size()));
  for (std::uint64_t d : shape) file.write_value(d);
  file.write_value(bytes);
}

DTRAIN_DETAIL_INLINE checked_reader::checked_reader(std::filesystem::path path, bool checksummed)
    : path_(std::move(path)), checksummed_(checksummed) {
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
    if (checksummed_) checksum_.update(into, static_cast<std::size_t>(r));
    offset_ += static_cast<std::uint64_t>(r);
    n -= static_cast<std::uint64_t>(r);
    if (dst) dst += r;
  }
}

DTRAIN_DETAIL_INLINE void checked_reader::skip(std::uint64_t n, std::string_view what) {
  if (n > size_ - offset_) read(nullptr, n, what);  // throws: truncated
  if (n == 0) return;
  const auto to = static_cast<::off_t>(offset_ + n);
  if (::lseek(fd_.get(), to, SEEK_SET) != to) fail_os("cannot seek in", path_, errno);
  offset_ += n;
}

DTRAIN_DETAIL_INLINE void checked_reader::malformed(const std::string& why) const {
  throw checkpoint_error("checkpoint: " + path_.string() + " is not a dtrain checkpoint part: " +
                         why + " (at byte " + std::to_string(offset_) + ")");
}

DTRAIN_DETAIL_INLINE part_contents read_part(const std::filesystem::path& path, part_sink sink,
                                             bool checksummed) {
  checked_reader in(path, checksummed);
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
  out.checksum = checksummed ? in.checksum() : 0;
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

DTRAIN_DETAIL_INLINE manifest verify_step(const std::filesystem::path& step_dir, bool contents) {
  manifest m = read_manifest(step_dir);
  for (const file_record& f : m.files) {
    const std::filesystem::path file = step_dir / f.name;
    if (contents) {
      static_cast<void>(read_checked_part(file, f));
      continue;
    }
    struct ::stat st {};
    if (::stat(file.c_str(), &st) != 0) fail_os("cannot open", file, errno);
    if (const auto bytes = static_cast<std::uint64_t>(st.st_size); bytes != f.bytes) {
      throw checkpoint_error(
          "checkpoint: " + file.string() +
          (bytes < f.bytes ? " is truncated: it has " : " is overwritten: it has ") +
          std::to_string(bytes) + " bytes, its manifest says " + std::to_string(f.bytes));
    }
  }
  return m;
}

}  // namespace dtrain::detail::ckpt
