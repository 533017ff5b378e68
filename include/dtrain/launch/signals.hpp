#pragma once
/// @file
/// The signals a node agent catches while it runs: SIGINT, SIGTERM and SIGHUP
/// end the job (forwarded to the workers), SIGUSR1 asks the workers for desync
/// diagnostics and stops nothing. The handlers only record the signal; the
/// agent's loop and its waits read it.

#include <dtrain/config.hpp>

#include <array>
#include <csignal>
#include <cstddef>

namespace dtrain::detail {

/// The last signal that asks the agent to end the job (0: none).
inline volatile std::sig_atomic_t agent_signal = 0;

inline void record_agent_signal(int sig) { agent_signal = sig; }

/// SIGUSR1s the agent received and has not forwarded yet: they ask the
/// workers for desync diagnostics and stop nothing.
inline volatile std::sig_atomic_t agent_diagnostics_requests = 0;

inline void record_diagnostics_request(int) { agent_diagnostics_requests = 1; }

/// The signal that ends the job, if one arrived (0: none).
[[nodiscard]] inline int pending_agent_signal() noexcept { return agent_signal; }

/// Takes a pending SIGUSR1 request: true once per request.
[[nodiscard]] DTRAIN_DETAIL_INLINE bool take_diagnostics_request() noexcept;

/// Catches SIGINT, SIGTERM and SIGHUP while the agent runs, so it can forward
/// them to the workers, and SIGUSR1, which it forwards without stopping them
/// (desync diagnostics); restores the previous handlers afterwards.
class agent_signal_scope {
 public:
  agent_signal_scope();
  agent_signal_scope(const agent_signal_scope&) = delete;
  agent_signal_scope& operator=(const agent_signal_scope&) = delete;
  ~agent_signal_scope();
  static constexpr std::array<int, 3> signals{SIGINT, SIGTERM, SIGHUP};

 private:
  std::array<struct sigaction, 3> previous_{};
  struct sigaction previous_usr1_ {};
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/signals-inl.hpp>
#endif
