#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/server_limits.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/server_limits.hpp, not this file.

#include <dtrain/rendezvous/server_limits.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE bool byte_budget::try_take(std::uint64_t n) {
  const std::uint64_t used = used_.load();
  if (n > cap_ - used) return false;
  used_.store(used + n);
  return true;
}

DTRAIN_DETAIL_INLINE void byte_budget::give_back(reactor& r, std::uint64_t n) {
  const std::uint64_t used = used_.load();
  used_.store(used - std::min(n, used));
  for (wait_slot* s : waiters_) r.wake_up(*s);
}

DTRAIN_DETAIL_INLINE std::size_t connection_capacity(std::size_t wanted, std::size_t reserve) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return wanted;
  const rlim_t need = static_cast<rlim_t>(wanted + reserve);
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < need) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? need : std::min(need, lim.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  if (lim.rlim_cur == RLIM_INFINITY) return wanted;
  const auto limit = static_cast<std::size_t>(lim.rlim_cur);
  return std::min(wanted, limit > reserve ? limit - reserve : std::size_t{1});
}

DTRAIN_DETAIL_INLINE bool spare_descriptor::refuse_one(int listener) {
  fd_.reset();
  int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) ::close(fd);
  open();
  return fd >= 0;
}

DTRAIN_DETAIL_INLINE const char* describe(rejection r) {
  switch (r) {
    case rejection::over_connection_cap: return "over the connection cap";
    case rejection::out_of_descriptors: return "out of file descriptors";
    case rejection::handshake: return "failed handshake";
    case rejection::protocol: return "protocol violation";
    case rejection::idle: return "idle";
    case rejection::broken: return "broken while waiting";
    case rejection::count_: break;
  }
  return "?";
}

DTRAIN_DETAIL_INLINE bool rejection_log::note(rejection r) {
  ++counts_[static_cast<std::size_t>(r)];
  ++total_;
  return r != rejection::idle && ++detailed_ <= detailed_per_period;
}

DTRAIN_DETAIL_INLINE std::optional<std::string> rejection_log::summary(clock::time_point now) {
  if (now - since_ < period) return std::nullopt;
  std::optional<std::string> out;
  const std::uint64_t hidden = total_ - std::min(detailed_, detailed_per_period) -
                               counts_[static_cast<std::size_t>(rejection::idle)];
  if (hidden > 0) {
    std::string text =
        "refused or closed " + std::to_string(total_) + " connections in the last " +
        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - since_).count()) +
        " s:";
    const char* sep = " ";
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      if (counts_[i] == 0) continue;
      text += sep + std::to_string(counts_[i]) + " " + describe(static_cast<rejection>(i));
      sep = ", ";
    }
    out = text + " (the first " + std::to_string(detailed_per_period) + " were logged in full)";
  }
  counts_.fill(0);
  total_ = 0;
  detailed_ = 0;
  since_ = now;
  return out;
}

}  // namespace dtrain::detail
