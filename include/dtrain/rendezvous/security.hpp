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

/// 128 random bits from the kernel, as 32 hex digits.
DTRAIN_DETAIL_INLINE std::string new_store_token();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string new_store_token() {
  unsigned char bytes[16];
  std::size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw error(std::string("cannot draw a store token: getrandom: ") + std::strerror(errno));
    got += static_cast<std::size_t>(n);
  }
  std::string out;
  for (unsigned char b : bytes) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", b);
    out += hex;
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where the store of a job whose ranks meet at `master` listens: DTRAIN_STORE_BIND
/// if set, else the local address that `master` names. Every interface ("0.0.0.0")
/// only when that name is not an address of this host, or when it resolves to
/// loopback here but the job spans nodes (Debian's /etc/hosts maps the host's
/// own name to 127.0.1.1, which other nodes cannot reach).
DTRAIN_DETAIL_INLINE std::string store_bind_address(const environment& env,
                                                    const std::string& master, bool multi_node);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string store_bind_address(const environment& env,
                                                    const std::string& master, bool multi_node) {
  if (auto bind = env.get(store_bind_variable); bind && !bind->empty()) return std::string(*bind);
  const resolved names = resolve(master);
  if (!names.error.empty() || names.addresses.empty()) return master;  // listen_on reports it
  bool all_loopback = true;
  for (const auto& a : names.addresses) all_loopback = all_loopback && is_loopback_address(a);
  if (all_loopback) return multi_node ? "0.0.0.0" : names.addresses.front();
  const auto locals = interface_addresses();
  for (const auto& a : names.addresses) {
    for (const auto& local : locals) {
      if (local.address == a) return a;
    }
  }
  return "0.0.0.0";
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE token_file::token_file(const environment& env, int port) {
  std::string dir;
  if (auto runtime = env.get("XDG_RUNTIME_DIR"); runtime && !runtime->empty()) {
    dir = std::string(*runtime) + "/dtrain";
  } else {
    dir = "/tmp/dtrain-" + std::to_string(::getuid());
  }
  dir_ = dir;
  path_ = dir + "/store-" + std::to_string(port) + ".token";
}

DTRAIN_DETAIL_INLINE void token_file::publish(const std::string& token) {
  if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) fail("cannot create", errno);
  struct stat st {};
  if (::lstat(dir_.c_str(), &st) != 0) fail("cannot inspect", errno);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077) != 0) {
    throw config_error(dir_ +
                       " must be a directory that only this user can open (mode 0700) "
                       "to hold the store token; remove it, or set DTRAIN_STORE_TOKEN");
  }
  const std::string temp = path_ + "." + std::to_string(::getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) fail("cannot write", errno);
  bool ok = ::write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok || ::rename(temp.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(temp.c_str());
    fail("cannot write", err);
  }
  published_ = true;
}

DTRAIN_DETAIL_INLINE std::optional<std::string> token_file::read() const {
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return std::nullopt;
  char text[128];
  ssize_t n = ::read(fd, text, sizeof text);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  return std::string(text, static_cast<std::size_t>(n));
}

DTRAIN_DETAIL_INLINE void token_file::fail(const char* what, int err) const {
  throw config_error(std::string(what) + " " + path_ + " for the store token: " +
                     std::strerror(err) + "; set DTRAIN_STORE_TOKEN instead");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Connects `client` to the store at host:port with the token in `file`,
/// reading the file again while the store refuses it (token_error: a file
/// left by an earlier job on the same port, which rank 0 has not replaced
/// yet, or no file yet), within `options.timeout`; then `options.token` is
/// the accepted token. Other failures are thrown as they come. Throws
/// timeout_error naming the file when no valid token appears in time.
DTRAIN_DETAIL_INLINE void connect_with_token_file(std::optional<store_client>& client,
                                                  const token_file& file, const std::string& host,
                                                  int port, store_options& options, int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void connect_with_token_file(std::optional<store_client>& client,
                                                  const token_file& file, const std::string& host,
                                                  int port, store_options& options, int rank) {
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  for (;;) {
    if (auto token = file.read()) {
      options.token = *token;
      try {
        client.emplace(host, port, options);
        return;
      } catch (const token_error&) {
        // A stale file: read it again.
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw timeout_error("rank " + std::to_string(rank) + " found no valid store token in " +
                          file.path() +
                          " within the store timeout; is rank 0 running on this host? "
                          "(set DTRAIN_STORE_TOKEN on every rank to skip the file)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
