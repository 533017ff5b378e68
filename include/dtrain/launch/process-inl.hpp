#pragma once
/// @file
/// The non-template bodies of dtrain/launch/process.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/process.hpp, not this file.

#include <dtrain/launch/process.hpp>

namespace dtrain::detail {

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

DTRAIN_DETAIL_INLINE int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

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

DTRAIN_DETAIL_INLINE void become_subreaper() noexcept {
#ifdef PR_SET_CHILD_SUBREAPER
  (void)::prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
}

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

}  // namespace dtrain::detail
