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

/// The shell's convention: the exit status, or 128 + the signal.
DTRAIN_DETAIL_INLINE int exit_code_of(int status);

/// Finds `program` on PATH the way execvp would, before fork (execvp itself
/// is not async-signal-safe). Returns it unchanged when it has a '/'. Throws
/// program_error (127 missing, 126 not executable) naming the program.
DTRAIN_DETAIL_INLINE std::string find_program(const std::string& program,
                                              std::optional<std::string_view> path_var);

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

/// Makes this process the reaper of its descendants' orphans (Linux 3.4+;
/// elsewhere nothing): what a worker started and left behind stays below the
/// agent, which kills and reaps it, instead of escaping to init.
DTRAIN_DETAIL_INLINE void become_subreaper() noexcept;

/// Kills what is left of each worker's process group (the workers are
/// reaped) and reaps those of them that were orphaned to this subreaper,
/// waiting at most `limit` for SIGKILL to take effect.
DTRAIN_DETAIL_INLINE void kill_leftovers(std::vector<worker_process>& workers,
                                         std::chrono::milliseconds limit);

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

/// Signals a worker's process group (the worker and what it started), or the
/// worker alone if it has left its group.
inline void signal_group(pid_t pid, int sig) {
  if (::killpg(pid, sig) != 0) ::kill(pid, sig);
}

/// Sends `sig` to the live workers, waits up to `grace` for them to exit,
/// then SIGKILLs the rest and reaps everyone. Afterwards no worker is alive.
DTRAIN_DETAIL_INLINE void stop_workers(std::vector<worker_process>& workers, int sig,
                                       std::chrono::milliseconds grace);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/process-inl.hpp>
#endif
