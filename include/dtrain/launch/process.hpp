#pragma once
/// @file
/// The node agent's processes: starting a worker (fork + exec, dying with the
/// agent), stopping a group (SIGTERM, grace period, SIGKILL), the warden and
/// subreaper that take what the workers started with them, and carrying
/// the workers' output with a `[rank N] ` prefix and into per-rank log files.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <pthread.h>
#include <unistd.h>

namespace dtrain::detail {

/// Exit status of a job whose program is missing, or is not executable (the shell's).
inline constexpr int program_missing_status = 127;
inline constexpr int program_not_executable_status = 126;

/// "exited with status 3", "was killed by SIGKILL (signal 9)".
DTRAIN_DETAIL_INLINE std::string describe_wait_status(int status);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by " + (name ? "SIG" + std::string(name) : std::string("a signal")) +
           " (signal " + std::to_string(sig) + ")";
  }
  return "stopped with wait status " + std::to_string(status);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The shell's convention: the exit status, or 128 + the signal.
DTRAIN_DETAIL_INLINE int exit_code_of(int status);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Finds `program` on PATH the way execvp would, before fork (execvp itself
/// is not async-signal-safe). Returns it unchanged when it has a '/'. Throws
/// program_error (127 missing, 126 not executable) naming the program.
DTRAIN_DETAIL_INLINE std::string find_program(const std::string& program,
                                              std::optional<std::string_view> path_var);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string find_program(const std::string& program,
                                              std::optional<std::string_view> path_var) {
  if (program.find('/') != std::string::npos) {
    std::error_code ec;
    if (!std::filesystem::exists(program, ec)) {
      throw program_error("cannot run \"" + program + "\": no such file", program_missing_status);
    }
    if (std::filesystem::is_directory(program, ec) || ::access(program.c_str(), X_OK) != 0) {
      throw program_error("cannot run \"" + program + "\": it is not an executable file",
                          program_not_executable_status);
    }
    return program;
  }
  std::string path(path_var.value_or("/usr/local/bin:/usr/bin:/bin"));
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  throw program_error("cannot run \"" + program + "\": not found on PATH=" + path,
                      program_missing_status);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Carries the workers' output to the agent's stdout/stderr, each line
/// prefixed with `[rank N] ` when `tee` is on, and to per-rank log files.
/// One thread polls every pipe; lines are written whole, so ranks never
/// interleave within a line.
class output_relay {
 public:
  struct stream {
    unique_fd pipe;  // read end
    int rank = 0;
    bool is_stderr = false;
    std::string partial;
    std::shared_ptr<std::FILE> log;  ///< this round's rank_<N>.log, or null
  };

  output_relay(bool tee, std::string log_dir) : tee_(tee), log_dir_(std::move(log_dir)) {}
  output_relay(const output_relay&) = delete;
  output_relay& operator=(const output_relay&) = delete;
  ~output_relay() { finish(std::chrono::milliseconds(0)); }

  /// Whether output passes through the relay at all (else workers inherit the agent's).
  [[nodiscard]] bool active() const noexcept { return tee_ || !log_dir_.empty(); }

  /// Opens the log files of one restart round: `<log_dir>/restart_<k>/rank_<N>.log`.
  void open_logs(int restart, const std::vector<int>& ranks);

  /// Hands the read ends of one worker's pipes to the relay thread.
  void add(int rank, unique_fd out, unique_fd err);

  /// Waits up to `drain` for the pipes to reach end-of-file (the workers are
  /// gone, but their children may hold the pipes), then stops the thread.
  void finish(std::chrono::milliseconds drain);

 private:
  void pump();

  void emit_lines(stream& s, bool at_end);

  void write_line(const stream& s, std::string_view line);

  bool tee_;
  std::string log_dir_;
  std::mutex mutex_;
  std::vector<stream> pending_;
  std::map<int, std::shared_ptr<std::FILE>> logs_;  // the current round's, by rank
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> open_streams_{0};
  std::thread thread_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void output_relay::open_logs(int restart, const std::vector<int>& ranks) {
  if (log_dir_.empty()) return;
  std::filesystem::path dir =
      std::filesystem::path(log_dir_) / ("restart_" + std::to_string(restart));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw config_error("cannot create the log directory " + dir.string() + ": " + ec.message());
  std::lock_guard lock(mutex_);
  logs_.clear();
  for (int rank : ranks) {
    auto path = dir / ("rank_" + std::to_string(rank) + ".log");
    // "e": O_CLOEXEC, so the workers started later do not inherit the file.
    std::shared_ptr<std::FILE> file(std::fopen(path.c_str(), "we"), [](std::FILE* f) {
      if (f) std::fclose(f);
    });
    if (!file) throw config_error("cannot write the log file " + path.string());
    logs_[rank] = std::move(file);
  }
}

DTRAIN_DETAIL_INLINE void output_relay::add(int rank, unique_fd out, unique_fd err) {
  std::lock_guard lock(mutex_);
  // Each stream keeps the log file of its own round: output of a round that
  // is still being drained never lands in the next round's files.
  auto it = logs_.find(rank);
  std::shared_ptr<std::FILE> log = it == logs_.end() ? nullptr : it->second;
  pending_.push_back(stream{std::move(out), rank, false, {}, log});
  pending_.push_back(stream{std::move(err), rank, true, {}, log});
  if (!thread_.joinable()) {
    stop_ = false;
    thread_ = std::thread([this] { pump(); });
  }
}

DTRAIN_DETAIL_INLINE void output_relay::finish(std::chrono::milliseconds drain) {
  if (!thread_.joinable()) return;
  auto deadline = std::chrono::steady_clock::now() + drain;
  while (std::chrono::steady_clock::now() < deadline && open_streams_.load() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop_ = true;
  thread_.join();
}

DTRAIN_DETAIL_INLINE void output_relay::pump() {
  std::vector<stream> streams;
  std::vector<char> buffer(1 << 16);
  while (true) {
    {
      std::lock_guard lock(mutex_);
      for (auto& s : pending_) streams.push_back(std::move(s));
      pending_.clear();
      open_streams_ = streams.size();
    }
    if (stop_ && streams.empty()) break;
    std::vector<pollfd> fds;
    for (auto& s : streams) fds.push_back(pollfd{s.pipe.get(), POLLIN, 0});
    int ready = ::poll(fds.data(), fds.size(), 20);
    if (ready < 0 && errno != EINTR) break;
    for (std::size_t i = 0; i < streams.size(); ++i) {
      if (fds[i].revents == 0) continue;
      ssize_t n = ::read(streams[i].pipe.get(), buffer.data(), buffer.size());
      if (n > 0) {
        streams[i].partial.append(buffer.data(), static_cast<std::size_t>(n));
        emit_lines(streams[i], false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit_lines(streams[i], true);
        streams[i].pipe.reset();
      }
    }
    if (stop_) {
      for (auto& s : streams) emit_lines(s, true);
      streams.clear();
    }
    std::erase_if(streams, [](const stream& s) { return !s.pipe && s.partial.empty(); });
  }
  open_streams_ = 0;
}

DTRAIN_DETAIL_INLINE void output_relay::emit_lines(stream& s, bool at_end) {
  std::size_t start = 0;
  std::lock_guard lock(mutex_);
  for (std::size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    write_line(s, std::string_view(s.partial).substr(start, nl + 1 - start));
  }
  s.partial.erase(0, start);
  if (at_end && !s.partial.empty()) {
    write_line(s, s.partial + "\n");
    s.partial.clear();
  }
}

DTRAIN_DETAIL_INLINE void output_relay::write_line(const stream& s, std::string_view line) {
  std::FILE* to = s.is_stderr ? stderr : stdout;
  if (tee_) {
    std::fprintf(to, "[rank %d] %.*s", s.rank, static_cast<int>(line.size()), line.data());
    std::fflush(to);
  }
  if (s.log) {
    std::fwrite(line.data(), 1, line.size(), s.log.get());
    std::fflush(s.log.get());
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One started worker.
struct worker_process {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  unique_fd exit_fd;          ///< a pidfd: readable once the worker exits (Linux 5.3+)
  std::optional<int> status;  ///< wait status, once reaped
};

/// What a worker is started with: argv[0] is the program (found on PATH).
struct worker_command {
  std::vector<std::string> argv;
  std::vector<std::string> env;  ///< NAME=value entries, the whole environment
};

/// Starts a worker. The child asks for SIGKILL when the agent's thread that
/// forked it dies (PR_SET_PDEATHSIG), so no worker outlives its agent, and
/// starts with every signal unblocked and default. Only async-signal-safe
/// calls happen between fork and exec; everything is prepared before.
DTRAIN_DETAIL_INLINE pid_t spawn_worker(const worker_command& cmd, output_relay* relay, int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE pid_t spawn_worker(const worker_command& cmd, output_relay* relay, int rank) {
  std::vector<char*> argv;
  for (const auto& a : cmd.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : cmd.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  if (relay != nullptr) {
    DTRAIN_SYSCALL(::pipe2(out, O_CLOEXEC));
    DTRAIN_SYSCALL(::pipe2(err, O_CLOEXEC));
  }
  unique_fd out_read(out[0]), out_write(out[1]), err_read(err[0]), err_write(err[1]);
  // A failed exec reports its errno through this pipe; it closes on a successful exec.
  int report[2];
  DTRAIN_SYSCALL(::pipe2(report, O_CLOEXEC));
  unique_fd report_read(report[0]), report_write(report[1]);
  const pid_t parent = ::getpid();
  // Signals stay blocked until the child has its default handlers back: a
  // SIGTERM forwarded right after fork must not run the agent's handler in it.
  sigset_t forwarded, previous;
  sigemptyset(&forwarded);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&forwarded, sig);
  ::pthread_sigmask(SIG_BLOCK, &forwarded, &previous);

  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the agent died before prctl took effect
    // Its own process group, so that stopping the worker stops what it started too.
    ::setpgid(0, 0);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
    // A SIGUSR1 the agent forwards (desync diagnostics) must not end a worker
    // that has not installed dtrain's handler yet: ignored until it does (exec keeps SIG_IGN).
    ::signal(SIGUSR1, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (relay != nullptr &&
        (::dup2(out[1], STDOUT_FILENO) < 0 || ::dup2(err[1], STDERR_FILENO) < 0)) {
      int e = errno;
      (void)!::write(report[1], &e, sizeof e);
      ::_exit(127);
    }
    ::execve(argv[0], argv.data(), envp.data());
    int e = errno;
    (void)!::write(report[1], &e, sizeof e);
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  if (pid < 0) {
    throw error("cannot start rank " + std::to_string(rank) +
                ": fork: " + std::strerror(fork_errno));
  }
  ::setpgid(pid, pid);  // also here: whichever runs first, the group exists before any kill
  report_write.reset();
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(report_read.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof child_errno)) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    const std::string what = "cannot start rank " + std::to_string(rank) + " (" + cmd.argv[0] +
                             "): " + std::strerror(child_errno);
    if (child_errno == ENOENT || child_errno == ENOTDIR) {
      throw program_error(what, program_missing_status);
    }
    if (child_errno == EACCES || child_errno == EPERM || child_errno == ENOEXEC ||
        child_errno == EISDIR) {
      throw program_error(what, program_not_executable_status);
    }
    throw error(what);
  }
  if (relay != nullptr) relay->add(rank, std::move(out_read), std::move(err_read));
  return pid;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Makes this process the reaper of its descendants' orphans (Linux 3.4+;
/// elsewhere nothing): what a worker started and left behind stays below the
/// agent, which kills and reaps it, instead of escaping to init.
DTRAIN_DETAIL_INLINE void become_subreaper() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void become_subreaper() noexcept {
#ifdef PR_SET_CHILD_SUBREAPER
  (void)::prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Kills what is left of each worker's process group (the workers are
/// reaped) and reaps those of them that were orphaned to this subreaper,
/// waiting at most `limit` for SIGKILL to take effect.
DTRAIN_DETAIL_INLINE void kill_leftovers(std::vector<worker_process>& workers,
                                         std::chrono::milliseconds limit);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void kill_leftovers(std::vector<worker_process>& workers,
                                         std::chrono::milliseconds limit) {
  for (auto& w : workers) {
    if (w.pid > 0) ::killpg(w.pid, SIGKILL);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (auto& w : workers) {
    if (w.pid <= 0) continue;
    int status = 0;
    while (true) {
      pid_t r = ::waitpid(-w.pid, &status, WNOHANG);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 || std::chrono::steady_clock::now() > deadline) break;  // ECHILD: all reaped
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A small child of the agent that outlives it by a moment: when the agent
/// dies, even by SIGKILL, the pipe to it reaches end-of-file and it SIGKILLs
/// every worker's process group. PR_SET_PDEATHSIG reaches only the workers
/// themselves; this reaches what they started. One per restart round
/// (agent_round), forked before the round's relay starts its thread; the
/// child only ever makes async-signal-safe calls, so the store's thread may
/// run in the agent meanwhile.
class worker_warden {
 public:
  /// Starts the warden for up to `slots` workers at a time (one per local rank).
  explicit worker_warden(int slots);
  worker_warden(const worker_warden&) = delete;
  worker_warden& operator=(const worker_warden&) = delete;
  /// The agent ends normally: it stopped its workers itself, so the warden
  /// goes without killing anything (a group id may be reused by now).
  ~worker_warden();

  /// Tells the warden that local rank `slot` now runs in process group `pgid`.
  void guard(int slot, pid_t pgid) noexcept;

 private:
  // The agent's other descriptors, the store's sockets among them (the warden
  // is forked while the store runs): held here, a connection the store closes
  // would stay open for its peer until the round ends. Kernels before 5.9 keep them.
  static void close_inherited(int keep) noexcept;

  [[noreturn]] void watch(int fd) noexcept;

  std::vector<pid_t> groups_;  // allocated before fork: the child only writes into it
  pid_t pid_ = -1;
  unique_fd pipe_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE worker_warden::worker_warden(int slots)
    : groups_(static_cast<std::size_t>(slots), 0) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;  // no warden: PDEATHSIG still ends the workers
  unique_fd read_end(fds[0]), write_end(fds[1]);
  pid_t pid = ::fork();
  if (pid == 0) {
    write_end.reset();
    close_inherited(read_end.get());
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_IGN);
    watch(read_end.get());
  }
  if (pid > 0) {
    pid_ = pid;
    pipe_ = std::move(write_end);
  }
}

DTRAIN_DETAIL_INLINE worker_warden::~worker_warden() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

DTRAIN_DETAIL_INLINE void worker_warden::guard(int slot, pid_t pgid) noexcept {
  if (!pipe_ || slot < 0 || static_cast<std::size_t>(slot) >= groups_.size()) return;
  const std::int32_t message[2] = {slot, static_cast<std::int32_t>(pgid)};
  (void)!::write(pipe_.get(), message, sizeof message);  // 8 bytes: atomic on a pipe
}

DTRAIN_DETAIL_INLINE void worker_warden::close_inherited(int keep) noexcept {
#ifdef SYS_close_range
  const auto fd = static_cast<unsigned>(keep);
  if (fd > 3) (void)::syscall(SYS_close_range, 3U, fd - 1, 0U);
  (void)::syscall(SYS_close_range, fd + 1, ~0U, 0U);
#else
  (void)keep;
#endif
}

DTRAIN_DETAIL_INLINE void worker_warden::watch(int fd) noexcept {
  std::int32_t message[2];
  while (true) {
    ssize_t n = ::read(fd, message, sizeof message);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof message)) break;  // end-of-file: the agent is gone
    if (message[0] >= 0 && static_cast<std::size_t>(message[0]) < groups_.size())
      groups_[static_cast<std::size_t>(message[0])] = message[1];
  }
  for (pid_t pgid : groups_) {
    if (pgid > 0) ::killpg(pgid, SIGKILL);
  }
  ::_exit(0);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A pidfd for `pid`, or an empty one where the kernel has none.
inline unique_fd open_exit_fd(pid_t pid) {
  return unique_fd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
}

/// Waits up to `timeout` for a worker to exit and reaps whichever have.
/// Returns the workers reaped in this call, in the order their exits were
/// seen: the agent wakes the moment the first one exits, so the first
/// failure reported is the root cause, not a peer that failed because of it.
DTRAIN_DETAIL_INLINE std::vector<worker_process*> reap_exited(std::vector<worker_process>& workers,
                                                              std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<worker_process*> reap_exited(std::vector<worker_process>& workers,
                                                              std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds;
  bool polled = true;
  for (auto& w : workers) {
    if (w.status || w.pid <= 0) continue;
    if (!w.exit_fd) polled = false;
    fds.push_back(pollfd{w.exit_fd.get(), POLLIN, 0});
  }
  if (fds.empty()) return {};
  if (polled) {
    if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) <= 0) return {};
  } else {
    std::this_thread::sleep_for(timeout);
  }
  std::vector<worker_process*> reaped;
  for (auto& w : workers) {
    if (w.status || w.pid <= 0) continue;
    int status = 0;
    if (::waitpid(w.pid, &status, WNOHANG) == w.pid) {
      w.status = status;
      w.exit_fd.reset();
      reaped.push_back(&w);
    }
  }
  return reaped;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Signals a worker's process group (the worker and what it started), or the
/// worker alone if it has left its group.
inline void signal_group(pid_t pid, int sig) {
  if (::killpg(pid, sig) != 0) ::kill(pid, sig);
}

/// Sends `sig` to the live workers, waits up to `grace` for them to exit,
/// then SIGKILLs the rest and reaps everyone. Afterwards no worker is alive.
DTRAIN_DETAIL_INLINE void stop_workers(std::vector<worker_process>& workers, int sig,
                                       std::chrono::milliseconds grace);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void stop_workers(std::vector<worker_process>& workers, int sig,
                                       std::chrono::milliseconds grace) {
  // Exited workers too: what they started may still run in their group.
  for (auto& w : workers) {
    if (w.pid > 0) signal_group(w.pid, sig);
  }
  auto deadline = std::chrono::steady_clock::now() + grace;
  auto alive = [&] {
    return std::any_of(workers.begin(), workers.end(),
                       [](const worker_process& w) { return !w.status && w.pid > 0; });
  };
  while (alive() && std::chrono::steady_clock::now() < deadline)
    reap_exited(workers, std::chrono::milliseconds(10));
  for (auto& w : workers) {
    if (w.status || w.pid <= 0) continue;
    signal_group(w.pid, SIGKILL);
    int status = 0;
    while (::waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
    }
    w.status = status;
  }
  for (auto& w : workers) {
    if (w.pid > 0) ::killpg(w.pid, SIGKILL);  // stragglers of the groups
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
