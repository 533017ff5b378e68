#pragma once
/// @file
/// What the store holds and what its operations mean, apart from how clients
/// reach it: the keys and values, who waits for which key, and the cap on the
/// bytes stored. The server (server.hpp) parses a request and calls one
/// function here; no socket, coroutine or reactor is involved, so the store's
/// meaning is tested without a connection (tests/unit/test_kv_state.cpp).
/// Like the server's reactor, it is used from one thread.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// A request the store understood and refused (a counter that is not a
/// number, a value past the cap). The message goes to the client in an error
/// reply, and its connection stays open.
class store_refusal : public rendezvous_error {
 public:
  using rendezvous_error::rendezvous_error;
};

/// Whoever waits for keys to be set: called once a key it watches is set.
/// The server's resumes the waiting connection.
using kv_waiter = std::function<void()>;

/// The store's keys and values, their waiters and the stored-bytes cap.
class kv_state {
  // Transparent hashing: look keys up by string_view without copying them.
  struct key_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  template <class T>
  using by_key = std::unordered_map<std::string, T, key_hash, std::equal_to<>>;

 public:
  /// A state that refuses to hold more than `max_stored_bytes` of keys and
  /// values (store_limits::max_stored_bytes).
  explicit kv_state(std::uint64_t max_stored_bytes) : cap_(max_stored_bytes) {}
  kv_state(const kv_state&) = delete;
  kv_state& operator=(const kv_state&) = delete;

  /// A waiter's registration for keys; it ends, and the waiter is forgotten,
  /// when this is destroyed (the wait is over or its client went away).
  class watch {
   public:
    watch(kv_state& state, const kv_waiter& waiter, std::vector<std::string> keys)
        : state_(&state), waiter_(&waiter), keys_(std::move(keys)) {
      for (const auto& k : keys_) state_->waiters_[k].push_back(waiter_);
    }
    watch(const watch&) = delete;
    watch& operator=(const watch&) = delete;
    ~watch();
    /// The keys watched, in the order given.
    [[nodiscard]] const std::vector<std::string>& keys() const noexcept { return keys_; }

   private:
    kv_state* state_;
    const kv_waiter* waiter_;
    std::vector<std::string> keys_;
  };

  /// The value at `key`, or null; valid until the next change.
  [[nodiscard]] const std::string* find(std::string_view key) const;

  /// Which of `keys` are not set, in their order.
  [[nodiscard]] std::vector<std::string> missing(std::span<const std::string_view> keys) const;

  /// Whether every one of `keys` is set (true for none).
  [[nodiscard]] bool check(std::span<const std::string_view> keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](auto k) { return data_.contains(k); });
  }

  /// Sets `key` to `value` and wakes its waiters. Throws store_refusal,
  /// changing nothing, when the stored bytes would pass the cap.
  void set(std::string_view key, std::string_view value) {
    if (!store(key, value)) throw over_capacity("set", key, value.size());
  }

  /// Adds `delta` to the decimal integer at `key` (0 when missing) and returns
  /// the sum. Throws store_refusal when the key holds something else, the sum
  /// would overflow, or the cap would be passed.
  std::int64_t add(std::string_view key, std::int64_t delta);

  /// Sets `key` to `desired` if it holds `expected` (a missing key matches an
  /// empty `expected`), and returns what it holds then (empty when missing),
  /// valid until the next change. Throws store_refusal as set() does.
  std::string_view compare_set(std::string_view key, std::string_view expected,
                               std::string_view desired);

  /// Removes `key`; false if it was not set. Its waiters go on waiting.
  bool erase(std::string_view key);

  /// Keys set.
  [[nodiscard]] std::size_t size() const noexcept { return data_.size(); }
  /// Bytes of the keys and values held, the figure the cap bounds.
  [[nodiscard]] std::uint64_t stored_bytes() const noexcept { return stored_; }
  /// Keys that someone waits for.
  [[nodiscard]] std::size_t watched_keys() const noexcept { return waiters_.size(); }

 private:
  // Sets key to value and wakes its waiters; false, changing nothing, when the
  // stored bytes would pass the cap (a change that does not grow them always passes).
  bool store(std::string_view key, std::string_view value);

  store_refusal over_capacity(const char* what, std::string_view key, std::size_t value_size) const;

  std::uint64_t cap_;
  std::uint64_t stored_ = 0;
  by_key<std::string> data_;
  by_key<std::vector<const kv_waiter*>> waiters_;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/kv_state-inl.hpp>
#endif
