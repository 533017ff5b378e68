#pragma once
/// @file
/// What keeps the store server's resources bounded: a byte budget shared by
/// its connections, a spare descriptor for refusing connections when the
/// process has run out, and a log that summarises floods instead of writing
/// a line per rejected connection. All run on the server's reactor thread.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/rendezvous/reactor.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

/// Bytes that connections may hold at once. A connection that cannot take
/// what it needs waits (server_connection::reserve); give_back wakes the waiters.
class byte_budget {
 public:
  explicit byte_budget(std::uint64_t cap) : cap_(cap) {}

  [[nodiscard]] bool try_take(std::uint64_t n);
  void give_back(reactor& r, std::uint64_t n);
  void wait_here(wait_slot& s) { waiters_.push_back(&s); }
  void stop_waiting(wait_slot& s) { std::erase(waiters_, &s); }
  [[nodiscard]] std::uint64_t cap() const noexcept { return cap_; }
  /// Bytes held now. Unlike the rest, callable from any thread (for stats()).
  [[nodiscard]] std::uint64_t used() const noexcept { return used_.load(); }

 private:
  std::uint64_t cap_;
  // Changed on the reactor thread only; atomic so that stats() can read it from others.
  std::atomic<std::uint64_t> used_{0};
  std::deque<wait_slot*> waiters_;
};

#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// The connections the server can hold: its option, lowered to what the
/// descriptor limit leaves after `reserve` descriptors for everything else.
/// Raises the soft RLIMIT_NOFILE towards the hard limit first, as servers
/// that expect thousands of clients do.
DTRAIN_DETAIL_INLINE std::size_t connection_capacity(std::size_t wanted, std::size_t reserve = 64);
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// One descriptor kept open so that, when accept() fails for lack of
/// descriptors, the server can still take the pending connection off the
/// queue and close it, instead of leaving it to spin on the listen socket.
class spare_descriptor {
 public:
  spare_descriptor() { open(); }
  /// Accepts one pending connection on `listener` and closes it; true if one was.
  bool refuse_one(int listener);

 private:
  void open() { fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }
  unique_fd fd_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool spare_descriptor::refuse_one(int listener) {
  fd_.reset();
  int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) ::close(fd);
  open();
  return fd >= 0;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Why the server closed or refused a connection.
enum class rejection : std::uint8_t {
  over_connection_cap,
  out_of_descriptors,
  handshake,  ///< wrong token, version or magic, or too slow
  protocol,   ///< a malformed or oversized request
  idle,
  broken,  ///< a client's connection broke (a reset) while it waited
  count_
};

DTRAIN_DETAIL_INLINE const char* describe(rejection r);
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// Logs the first few rejections of each period in full and the rest as one
/// summary line per period, so a flood costs a few lines, not one per
/// connection (a fuzzer once made 28.5 MB of log in ten minutes).
class rejection_log {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds period{10};
  static constexpr std::uint64_t detailed_per_period = 5;

  /// Counts one; true when it should be logged in full.
  bool note(rejection r);

  /// Once per period, the summary of what was not logged in full (if any).
  std::optional<std::string> summary(clock::time_point now);

 private:
  std::array<std::uint64_t, static_cast<std::size_t>(rejection::count_)> counts_{};
  std::uint64_t total_ = 0;
  std::uint64_t detailed_ = 0;
  clock::time_point since_ = clock::now();
};

#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
