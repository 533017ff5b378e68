#pragma once
// Helpers for the rendezvous store tests: captured server logs, raw sockets
// that speak (or break) the wire protocol, and child processes.

#include "support.hpp"

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace dtrain_test {

using namespace std::chrono_literals;

/// Polls `condition` until it holds or `limit` passes: a guard against hangs,
/// not a performance threshold.
inline bool eventually(const std::function<bool()>& condition,
                       std::chrono::milliseconds limit = 10s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

/// Collects what a server logs.
class log_capture {
 public:
  std::function<void(std::string_view)> sink() {
    return [this](std::string_view line) {
      std::lock_guard lock(mutex_);
      lines_.emplace_back(line);
    };
  }
  /// Waits until a logged line contains `part`; returns that line ("" if none came).
  std::string wait_for(std::string_view part, std::chrono::milliseconds limit = 10s) {
    std::string found;
    eventually(
        [&] {
          std::lock_guard lock(mutex_);
          for (const auto& l : lines_) {
            if (l.find(part) != std::string::npos) {
              found = l;
              return true;
            }
          }
          return false;
        },
        limit);
    return found;
  }
  std::string all() {
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& l : lines_) out += l + "\n";
    return out;
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> lines_;
};

/// A plain blocking TCP connection to 127.0.0.1:port.
class raw_socket {
 public:
  explicit raw_socket(int port) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    REQUIRE(fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    timeval tv{10, 0};  // no read in these tests may hang
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  raw_socket(const raw_socket&) = delete;
  raw_socket& operator=(const raw_socket&) = delete;
  ~raw_socket() { close(); }

  void send(std::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return;  // the server may already have hung up; that is what some tests expect
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
  }
  /// Completes the handshake with `token` and checks that the server accepted it.
  void handshake(std::string_view token = "");
  /// Reads until `n` bytes or the end of the stream.
  std::string receive(std::size_t n) {
    std::string out;
    char buf[4096];
    while (out.size() < n) {
      ssize_t got = ::recv(fd_, buf, std::min(sizeof buf, n - out.size()), 0);
      if (got <= 0) break;
      out.append(buf, static_cast<std::size_t>(got));
    }
    return out;
  }
  /// True when the server closed the connection (end of stream or reset) before the read timeout.
  bool closed_by_server() {
    char buf[4096];
    for (;;) {
      ssize_t got = ::recv(fd_, buf, sizeof buf, 0);
      if (got == 0) return true;
      if (got < 0) return errno == ECONNRESET;
    }
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Closes with a reset (RST) instead of an orderly end of stream: a broken connection.
  void reset() {
    linger abort{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
    close();
  }

 private:
  int fd_;
};

/// The handshake a client sends.
inline std::string hello(std::string_view token = "",
                         std::uint16_t version = dtrain::detail::wire::version,
                         std::uint32_t magic = dtrain::detail::wire::magic) {
  std::string out;
  dtrain::detail::wire::writer(out).u32(magic).u16(version).bytes16(token);
  return out;
}

inline void raw_socket::handshake(std::string_view token) {
  send(hello(token));
  auto reply = receive(3 + 8);  // status, version, the server's instance
  REQUIRE(reply.size() == 3 + 8);
  REQUIRE(reply[0] == static_cast<char>(dtrain::detail::wire::status::ok));
}

/// A child process running `args` (args[0] is the program path).
struct child {
  pid_t pid = -1;
  int stdout_fd = -1;  // when captured

  /// Waits for it; returns its exit status, or 128 + signal.
  int wait() {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (stdout_fd >= 0) ::close(stdout_fd);
    stdout_fd = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  /// One line from its stdout.
  std::string read_line() {
    std::string line;
    char c;
    while (::read(stdout_fd, &c, 1) == 1 && c != '\n') line += c;
    return line;
  }
};

inline child spawn(const std::vector<std::string>& args, bool capture_stdout = false) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  int pipe_fds[2] = {-1, -1};
  if (capture_stdout) {
    REQUIRE(::pipe(pipe_fds) == 0);
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  }
  child c;
  int rc = ::posix_spawn(&c.pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE_MESSAGE(rc == 0, "cannot start " << args[0]);
  if (capture_stdout) {
    ::close(pipe_fds[1]);
    c.stdout_fd = pipe_fds[0];
  }
  return c;
}

/// The peer program built for these tests.
inline std::string store_peer() {
#ifdef DTRAIN_TEST_STORE_PEER
  return DTRAIN_TEST_STORE_PEER;
#else
  FAIL("this test needs DTRAIN_TEST_STORE_PEER, the path of dtrain_store_peer (CMake defines it)");
  return {};
#endif
}

}  // namespace dtrain_test
