#pragma once
/// @file
/// How each rank's NCCL initialisation ended, told to the other ranks through
/// the store: a rank whose init fails says so, and the others, still waiting
/// for init (a peer that failed never joins), stop waiting and name it.

#include <dtrain/detail/wire.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/broadcast.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>

namespace dtrain::detail {

/// How often a rank waiting for NCCL's init asks the store whether a peer's
/// init failed: one request per rank per period while init runs.
inline constexpr std::chrono::milliseconds nccl_init_poll{200};

/// The store constructor's view of the other ranks' NCCL init. Each rank sets
/// how its init ended under "<key>/init/<rank>" (a wire::outcome: ok, or its
/// error) and counts a failure under "<key>/init/failures". While a rank waits
/// for init, watch() polls that count from a thread of its own (every
/// nccl_init_poll) and, at the first failure, reads which rank failed and
/// why, and calls `on_failure` once; peer_failure() says it afterwards.
///
/// The watching thread uses the store while the constructor's thread waits
/// on NCCL and does not (a store shared with other threads must be
/// thread-safe, as store_client is). A store that fails while watched ends
/// the watch: init_timeout still bounds the wait.
template <store Store>
class nccl_init_outcomes {
 public:
  nccl_init_outcomes(Store& store, const std::string& key, int rank, int size)
      : store_(store), base_(key + "/init/"), rank_(rank), size_(size) {}
  nccl_init_outcomes(const nccl_init_outcomes&) = delete;
  nccl_init_outcomes& operator=(const nccl_init_outcomes&) = delete;
  ~nccl_init_outcomes() { stop(); }

  /// Starts watching the other ranks; `on_failure()` (noexcept) runs on the
  /// watching thread, once, when one of them has failed.
  template <class OnFailure>
  void watch(OnFailure on_failure) {
    watcher_ = std::jthread([this, on_failure](std::stop_token stop) mutable {
      std::mutex mutex;
      std::condition_variable_any pause;
      std::unique_lock lock(mutex);
      while (!stop.stop_requested()) {
        try {
          if (find_failure()) {
            on_failure();
            // Rank 0 may host the store: it stays (at most the relay's
            // linger) until every other rank has read the failure too, or
            // one that polls a moment later finds the store gone and waits
            // for its init timeout. stop() waits for this.
            if (rank_ == 0) relay(failed_rank_).failure_carried();
            return;
          }
        } catch (...) {
          return;  // the store is failing: the init's own timeout decides
        }
        pause.wait_for(lock, stop, nccl_init_poll, [] { return false; });
      }
    });
  }

  /// Stops watching (and waits for the thread): peer_failure() is final then.
  /// On rank 0 after a peer's failure, that is once the others have read it.
  void stop() noexcept {
    if (!watcher_.joinable()) return;
    watcher_.request_stop();
    watcher_.join();
  }

  /// "rank R failed: <its message>" for the first failed peer watch() saw;
  /// empty when it saw none. Read after stop().
  [[nodiscard]] const std::string& peer_failure() const noexcept { return failure_; }

  /// This rank's init ended well. Never throws: nobody waits for it.
  void succeeded() noexcept {
    try {
      store_.set(own_key(), wire::outcome{true, {}}.encode());
    } catch (...) {
      // A store that is failing now fails the next thing that needs it.
    }
  }

  /// This rank's init failed with `message`: says so; rank 0, which may host
  /// the store, then waits (at most store_relay's linger) until the others
  /// have read it. Never throws: this rank's own failure is what counts.
  void failed(const std::string& message) noexcept {
    try {
      store_.set(own_key(), wire::outcome{false, message}.encode());
      (void)store_.add(base_ + "failures", 1);  // after the set: a count finds its key
      // Not on other ranks: rank 0 leaves once it has read, and the store with it.
      if (rank_ == 0) relay(rank_).failure_carried();
    } catch (...) {
      // The store is gone: the others end with their init timeout.
    }
  }

 private:
  [[nodiscard]] std::string own_key() const { return base_ + std::to_string(rank_); }
  // A failure under "<key>/init/<root>", as broadcast_or_fail's store relay
  // counts its readers, so that a failed rank that hosts the store stays for them.
  [[nodiscard]] store_relay<Store> relay(int root) {
    return store_relay<Store>(store_, base_ + std::to_string(root), rank_, size_, root);
  }

  // On the watching thread: whether a peer has failed (then failure_ says which).
  bool find_failure() {
    if (store_.add(base_ + "failures", 0) == 0) return false;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const std::array<std::string, 1> key{base_ + std::to_string(r)};
      if (!store_.check(key)) continue;
      const wire::outcome got = wire::outcome::decode("store key \"" + key[0] + "\"",
                                                      store_.get(key[0]), "a rank's NCCL init");
      if (got.ok) continue;
      failure_ = "rank " + std::to_string(r) + " failed: " + got.text;
      failed_rank_ = r;
      relay(r).failure_read();
      return true;
    }
    return false;
  }

  Store& store_;
  std::string base_;
  int rank_;
  int size_;
  std::string failure_;
  int failed_rank_ = -1;
  std::jthread watcher_;  // last: stopped before the rest goes
};

/// The id constructor's: there is no store, so no rank hears of another's init.
struct nccl_init_alone {
  template <class OnFailure>
  void watch(OnFailure) {}
  void stop() noexcept {}
  [[nodiscard]] const std::string& peer_failure() const noexcept {
    static const std::string none;
    return none;
  }
  void succeeded() noexcept {}
  void failed(const std::string&) noexcept {}
};

}  // namespace dtrain::detail
