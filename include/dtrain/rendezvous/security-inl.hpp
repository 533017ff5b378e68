#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/security.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/security.hpp, not this file.

#include <dtrain/rendezvous/security.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE bool same_secret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

DTRAIN_DETAIL_INLINE void random_fill(unsigned char* out, std::size_t size, const char* what) {
  std::size_t got = 0;
  while (got < size) {
    ssize_t n = ::getrandom(out + got, size - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw error(std::string("cannot draw ") + what + ": getrandom: " + std::strerror(errno));
    got += static_cast<std::size_t>(n);
  }
}

DTRAIN_DETAIL_INLINE std::string new_store_token() {
  unsigned char bytes[16];
  random_fill(bytes, sizeof bytes, "a store token");
  std::string out;
  for (unsigned char b : bytes) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", b);
    out += hex;
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::uint64_t new_store_instance() {
  unsigned char bytes[8];
  std::uint64_t out = 0;
  while (out == 0) {
    random_fill(bytes, sizeof bytes, "a store instance");
    for (unsigned char b : bytes) out = (out << 8) | b;
  }
  return out;
}

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

}  // namespace detail
}  // namespace dtrain
