#pragma once
/// @file
/// Who may talk to a job's store, and where it listens: a fresh random token
/// per job, handed to the ranks without a command line or a log, and the one
/// interface that MASTER_ADDR names. See docs/launching.md, "Security".

#include <dtrain/config.hpp>
#include <dtrain/detail/net.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dtrain {

namespace detail {

/// Fills `out` with `size` bytes from the kernel's random source; `what`
/// names the draw in the error thrown when there is none.
DTRAIN_DETAIL_INLINE void random_fill(unsigned char* out, std::size_t size, const char* what);

/// 128 random bits from the kernel, as 32 hex digits.
DTRAIN_DETAIL_INLINE std::string new_store_token();

/// 64 random bits from the kernel, never 0: a store server's instance (its
/// handshake tells a restarted server from the one a client joined).
DTRAIN_DETAIL_INLINE std::uint64_t new_store_instance();

/// Whether two secrets are equal, compared without an early exit, so that
/// the time taken does not reveal how much of a guess was right.
DTRAIN_DETAIL_INLINE bool same_secret(std::string_view a, std::string_view b);

/// Where the store of a job whose ranks meet at `master` listens: DTRAIN_STORE_BIND
/// if set, else the local address that `master` names. Every interface ("0.0.0.0")
/// only when that name is not an address of this host, or when it resolves to
/// loopback here but the job spans nodes (Debian's /etc/hosts maps the host's
/// own name to 127.0.1.1, which other nodes cannot reach).
DTRAIN_DETAIL_INLINE std::string store_bind_address(const environment& env,
                                                    const std::string& master, bool multi_node);

/// The address a client on the store's own host uses to reach it.
inline std::string local_store_address(const std::string& bound) {
  return bound == "0.0.0.0" || bound == "::" ? "127.0.0.1" : bound;
}

/// A token shared through a file only this user can read, for ranks on one
/// host that no dtrain process launched (torchrun, mpirun with Gloo): rank 0
/// writes it, the others read it. The file is named after the store's port,
/// in $XDG_RUNTIME_DIR or /tmp/dtrain-<uid> (mode 0700, checked).
class token_file {
 public:
  token_file(const environment& env, int port);
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// Rank 0: writes `token` (replacing a stale file atomically).
  void publish(const std::string& token);

  /// The token in the file now, or nullopt if there is none yet.
  [[nodiscard]] std::optional<std::string> read() const;

  token_file(const token_file&) = delete;
  token_file& operator=(const token_file&) = delete;
  ~token_file() {
    if (published_) ::unlink(path_.c_str());
  }

 private:
  [[noreturn]] void fail(const char* what, int err) const;
  std::string dir_;
  std::string path_;
  bool published_ = false;
};

/// Connects `client` to the store at host:port with the token in `file`,
/// reading the file again while the store refuses it (token_error: a file
/// left by an earlier job on the same port, which rank 0 has not replaced
/// yet, or no file yet), within `options.timeout`; then `options.token` is
/// the accepted token. Other failures are thrown as they come. Throws
/// timeout_error naming the file when no valid token appears in time.
DTRAIN_DETAIL_INLINE void connect_with_token_file(std::optional<store_client>& client,
                                                  const token_file& file, const std::string& host,
                                                  int port, store_options& options, int rank);

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/security-inl.hpp>
#endif
