#pragma once
/// @file
/// The error hierarchy. Every failure dtrain reports is a dtrain::error; the
/// children are the cases a caller can act on.

#include <dtrain/config.hpp>

#include <stdexcept>
#include <string>
#include <utility>

namespace dtrain {

/// Root of every exception dtrain throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad environment, argv or options. The message names each variable involved
/// and its value (`RANK=7 is not below WORLD_SIZE=4`). `dtrain_whoami` and
/// `dtrain::run` exit with status 2 on it.
class config_error : public error {
 public:
  using error::error;
};

/// A blocking or awaited operation ran past its timeout; the message says what
/// it waited for and how long.
class timeout_error : public error {
 public:
  using error::error;
};

/// The rendezvous store could not be reached, served or trusted, or the rank
/// that bootstraps a value for every rank (rank 0: the store's address, the
/// store token, the NCCL unique id) failed to provide it.
class rendezvous_error : public error {
 public:
  using error::error;
};

/// The store refused this client's token: the token differs from the one the
/// store was started with (DTRAIN_STORE_TOKEN or store_options::token set
/// differently on some rank, or a token file left by an earlier job). Knocking
/// again with the same token cannot help; reading the token again may.
class token_error : public rendezvous_error {
 public:
  using rendezvous_error::rendezvous_error;
};

/// A collective engine (MPI, Gloo, NCCL, CUDA) reported a failure. Keeps the
/// engine's own code next to the message.
class backend_error : public error {
 public:
  backend_error(const std::string& what, int engine_code)
      : error(what), engine_code_(engine_code) {}

  /// The engine's own status code (MPI error class, ncclResult_t, cudaError_t).
  [[nodiscard]] int engine_code() const noexcept { return engine_code_; }

 private:
  int engine_code_;
};

/// A checkpoint could not be written, found or loaded: the message names the
/// directory or file, the rank and the reason (no space left, a file that is
/// truncated or corrupt, a checkpoint of another model). A failed save leaves
/// the previous checkpoint as it was; a failed load changes nothing.
class checkpoint_error : public error {
 public:
  using error::error;
};

/// A worker's program cannot be started: it is missing (exit_status() 127,
/// as a shell's "command not found") or not executable (126, as a shell's
/// "permission denied"). The agent ends the job with that status.
class program_error : public error {
 public:
  program_error(const std::string& what, int exit_status) : error(what), status_(exit_status) {}
  /// 127 for a missing program, 126 for one that cannot be executed.
  [[nodiscard]] int exit_status() const noexcept { return status_; }

 private:
  int status_;
};

/// Exit status of a process whose input (environment, options) was bad.
inline constexpr int config_error_exit_status = 2;

namespace detail {

/// The exit status and text of the exception in flight (call it in a catch
/// block): a program_error's own status (127 / 126), 2 for a config_error,
/// else 1. The one mapping from failure to exit status: dtrain::run, the
/// node agent and dtrun all end with it.
DTRAIN_DETAIL_INLINE std::pair<int, std::string> current_failure();

}  // namespace detail

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/error-inl.hpp>
#endif
