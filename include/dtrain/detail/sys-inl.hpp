#pragma once
/// @file
/// The non-template bodies of dtrain/detail/sys.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/detail/sys.hpp, not this file.

#include <cstdio>
#include <dtrain/detail/sys.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string os_error_text(const std::string& what, int err, const char* file,
                                               int line) {
  return what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ", at " + file +
         ":" + std::to_string(line) + ")";
}

DTRAIN_DETAIL_INLINE void unique_fd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

DTRAIN_DETAIL_INLINE std::optional<std::string> host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return std::nullopt;
  return std::string(name);
}

DTRAIN_DETAIL_INLINE int remove_tree(const char* path) {
  // nftw's callback takes no state: the first failure is this thread's.
  static thread_local int first_error = 0;
  first_error = 0;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) {
    if (::remove(p) != 0 && errno != ENOENT && first_error == 0) first_error = errno;
    return 0;  // go on: remove what can be removed
  };
  if (::nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return errno == ENOENT ? 0 : errno;
  }
  return first_error;
}

DTRAIN_DETAIL_INLINE void write_file_whole(const std::string& file, std::string_view bytes,
                                           std::string_view setting, int rank) {
  const std::string temporary = file + ".tmp";
  auto fail = [&](const char* what) {
    const int saved = errno;
    static_cast<void>(std::remove(temporary.c_str()));  // no half file left beside the whole ones
    throw error(std::string(setting) + ": rank " + std::to_string(rank) + " cannot " + what + " " +
                temporary + ": " + std::strerror(saved));
  };
  std::FILE* f = std::fopen(temporary.c_str(), "wb");
  if (!f) fail("create");
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  if (std::fclose(f) != 0 || !written) fail("write");
  if (std::rename(temporary.c_str(), file.c_str()) != 0) fail("rename");
}

}  // namespace dtrain::detail
