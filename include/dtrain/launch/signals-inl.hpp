#pragma once
/// @file
/// The non-template bodies of dtrain/launch/signals.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/signals.hpp, not this file.

#include <dtrain/launch/signals.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE bool take_diagnostics_request() noexcept {
  if (agent_diagnostics_requests == 0) return false;
  agent_diagnostics_requests = 0;
  return true;
}

DTRAIN_DETAIL_INLINE agent_signal_scope::agent_signal_scope() {
  agent_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = record_agent_signal;
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &sa, &previous_[i]);
  agent_diagnostics_requests = 0;
  sa.sa_handler = record_diagnostics_request;
  ::sigaction(SIGUSR1, &sa, &previous_usr1_);
}

DTRAIN_DETAIL_INLINE agent_signal_scope::~agent_signal_scope() {
  for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &previous_[i], nullptr);
  ::sigaction(SIGUSR1, &previous_usr1_, nullptr);
}

}  // namespace dtrain::detail
