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

/// The connections the server can hold: its option, lowered to what the
/// descriptor limit leaves after `reserve` descriptors for everything else.
/// Raises the soft RLIMIT_NOFILE towards the hard limit first, as servers
/// that expect thousands of clients do.
DTRAIN_DETAIL_INLINE std::size_t connection_capacity(std::size_t wanted, std::size_t reserve = 64);

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

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/server_limits-inl.hpp>
#endif
