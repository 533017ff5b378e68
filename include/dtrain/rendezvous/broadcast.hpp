#pragma once
/// @file
/// broadcast_or_fail: one rank produces a value that every rank needs to
/// start (the store's address, the store token, an NCCL unique id), and every
/// rank returns it; or, when that rank fails to produce it, every rank fails
/// at once with that rank's own message instead of waiting out a timeout for
/// a value that never comes. The channel (a relay) is the caller's: a key of
/// the store (store_relay, here), or an MPI broadcast before any store exists
/// (backend/mpi/mpi.hpp's mpi_relay). The message is a wire::outcome, whatever
/// the channel.

#include <dtrain/detail/wire.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <chrono>
#include <concepts>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace dtrain::detail {

/// What carries broadcast_or_fail's message: `carry(message, what)` sends
/// `message` on the root and replaces it with the root's on every other rank
/// (`what` names the broadcast in the channel's own errors); `root()` is the
/// producing rank, `is_root()` whether this is it, and `where()` names the
/// channel in errors ("store key dtrain/job/nccl/unique_id").
template <class R>
concept broadcast_relay = requires(R& r, std::string& message, const std::string& what) {
  r.carry(message, what);
  { r.root() } -> std::convertible_to<int>;
  { r.is_root() } -> std::convertible_to<bool>;
  { r.where() } -> std::convertible_to<std::string>;
};

/// A key of the store as broadcast_or_fail's channel: the root sets it, every
/// other rank gets it, waiting at most the store's timeout. Give each value
/// its own key: the key is never erased (a late rank still finds it).
///
/// A root that failed may host the store (rank 0 under per-process launch):
/// when it exits, its failure goes with it, and a rank that had not read it
/// yet hears only that the store is gone. So after carrying a failure, the
/// root waits until the `size - 1` others have read it (each counts itself
/// under "<key>/failure_read"), at most `linger`.
template <store Store>
class store_relay {
 public:
  static constexpr std::chrono::milliseconds default_linger{10'000};

  store_relay(Store& store, std::string key, int rank, int size, int root = 0,
              std::chrono::milliseconds linger = default_linger)
      : store_(store),
        key_(std::move(key)),
        rank_(rank),
        size_(size),
        root_(root),
        linger_(linger) {}
  void carry(std::string& message, const std::string& /*what*/) {
    if (is_root()) {
      store_.set(key_, message);
    } else {
      message = store_.get(key_);
    }
  }
  /// On a rank other than the root that read the root's failure.
  void failure_read() { (void)store_.add(read_key(), 1); }
  /// On the root, after carrying its failure: waits for the others to read it
  /// (at most `linger`). Never throws: the root's own failure is what counts.
  void failure_carried() noexcept {
    try {
      const auto deadline = std::chrono::steady_clock::now() + linger_;
      while (store_.add(read_key(), 0) < size_ - 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } catch (...) {
      // The store is gone or failing: nobody can read the failure any more.
    }
  }
  [[nodiscard]] int root() const noexcept { return root_; }
  [[nodiscard]] bool is_root() const noexcept { return rank_ == root_; }
  [[nodiscard]] std::string where() const { return "store key \"" + key_ + "\""; }

 private:
  [[nodiscard]] std::string read_key() const { return key_ + "/failure_read"; }

  Store& store_;
  std::string key_;
  int rank_;
  int size_;
  int root_;
  std::chrono::milliseconds linger_;
};

/// Rank `relay.root()` calls `produce()` (which returns the value as a
/// std::string) and every rank returns that value. Every rank calls it, as a
/// collective, whatever it holds.
///
/// When `produce()` throws, the root sends its message in place of the value
/// and then rethrows its own exception, unchanged; every other rank throws
/// rendezvous_error "rank R could not provide <what>: <R's message>". A
/// message that is not a wire::outcome is a rendezvous_error naming `where()`
/// and `what`; a failure of the channel itself (the store's timeout, an MPI
/// error) propagates, except on a root that has failed already, which throws
/// its own failure.
template <broadcast_relay Relay, class Produce>
[[nodiscard]] std::string broadcast_or_fail(Relay&& relay, std::string_view what,
                                            Produce&& produce) {
  const std::string about(what);
  std::string message;
  std::exception_ptr failure;
  if (relay.is_root()) {
    try {
      message = wire::outcome{true, std::forward<Produce>(produce)()}.encode();
    } catch (...) {
      failure = std::current_exception();
      message = wire::outcome{false, current_failure().second}.encode();
    }
  }
  try {
    relay.carry(message, "broadcasting " + about);
  } catch (...) {
    if (failure) std::rethrow_exception(failure);
    throw;
  }
  if (failure) {
    // A relay that can say so lets the root stay until the others have read its failure.
    if constexpr (requires { relay.failure_carried(); }) relay.failure_carried();
    std::rethrow_exception(failure);
  }
  wire::outcome got = wire::outcome::decode(relay.where(), message, about);
  if (!got.ok) {
    if constexpr (requires { relay.failure_read(); }) {
      try {
        relay.failure_read();
      } catch (...) {
        // The root's message is what this rank reports, whatever the channel does now.
      }
    }
    throw rendezvous_error("rank " + std::to_string(relay.root()) + " could not provide " + about +
                           ": " + got.text);
  }
  return std::move(got.text);
}

}  // namespace dtrain::detail
