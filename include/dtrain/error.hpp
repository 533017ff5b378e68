#pragma once
/// @file
/// The error hierarchy. Every failure dtrain reports is a dtrain::error; the
/// children are the cases a caller can act on.

#include <stdexcept>
#include <string>

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

/// The rendezvous store could not be reached, served or trusted.
class rendezvous_error : public error {
 public:
  using error::error;
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

}  // namespace dtrain
