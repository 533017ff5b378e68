#pragma once
/// @file
/// Checked OS calls. Every call into the OS goes through DTRAIN_SYSCALL, which
/// captures file:line, the call as written and strerror(errno).

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <ftw.h>
#include <unistd.h>

namespace dtrain::detail {

/// "what: strerror(err) (at file:line)".
DTRAIN_DETAIL_INLINE std::string os_error_text(const std::string& what, int err, const char* file,
                                               int line);

/// An owned file descriptor, closed on destruction.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Gives the descriptor up without closing it.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

/// This machine's host name; nullopt when gethostname fails (each caller
/// decides what that means for it).
DTRAIN_DETAIL_INLINE std::optional<std::string> host_name();

/// Writes `bytes` to `file` through `file`.tmp and a rename, so that a reader
/// finds the whole file or the one before. Throws dtrain::error: "`setting`:
/// rank R cannot create|write|rename FILE.tmp: why" (no .tmp is left).
DTRAIN_DETAIL_INLINE void write_file_whole(const std::string& file, std::string_view bytes,
                                           std::string_view setting, int rank);

/// Removes `path` and everything under it, as `rm -rf` does (symbolic links
/// are removed, not followed); a path that does not exist is no error.
/// Returns 0, or the errno of the first failure. POSIX (nftw), not
/// std::filesystem::remove_all: PyTorch's wheels export a
/// std::filesystem::remove_all(const path&) of their own from libtorch.so,
/// which wins the symbol lookup in any program linked to that LibTorch, and
/// which called a null pointer there (PyTorch 2.11, CUDA 13).
DTRAIN_DETAIL_INLINE int remove_tree(const char* path);

}  // namespace dtrain::detail

/// Evaluates `call` (an OS call returning -1 on failure) and throws
/// dtrain::error with the call, file:line and strerror(errno) when it fails.
#define DTRAIN_SYSCALL(call)                                                          \
  ([&]() {                                                                            \
    auto dtrain_result_ = (call);                                                     \
    if (dtrain_result_ == -1) {                                                       \
      int dtrain_errno_ = errno;                                                      \
      throw ::dtrain::error(                                                          \
          ::dtrain::detail::os_error_text(#call, dtrain_errno_, __FILE__, __LINE__)); \
    }                                                                                 \
    return dtrain_result_;                                                            \
  }())

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/detail/sys-inl.hpp>
#endif
