#pragma once
/// @file
/// The store's operations as the wire carries them (protocol.hpp): one
/// handler per operation code, each of which parses its request's fields,
/// asks the state (kv_state.hpp) and builds the reply. A get or wait on a
/// missing key suspends its connection until the key is set, the deadline
/// passes or the client goes away. Runs on the server's reactor thread.

#include <dtrain/config.hpp>
#include <dtrain/rendezvous/kv_state.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/protocol.hpp>
#include <dtrain/rendezvous/reactor.hpp>
#include <dtrain/rendezvous/server_connection.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/epoll.h>

namespace dtrain::detail {

/// One request on its way through a handler: its connection, the bytes it
/// holds against the budget, and its fields after the operation code.
struct store_request {
  server_connection& c;
  held_bytes& held;
  wire::reader& fields;
};

/// The store's state and the handlers of its operations.
class store_operations {
 public:
  explicit store_operations(const store_limits& limits)
      : limits_(limits), state_(limits.max_stored_bytes) {}
  store_operations(const store_operations&) = delete;
  store_operations& operator=(const store_operations&) = delete;

  /// The reply body to the request whose body `q.fields` reads, from the
  /// handler of its operation code. Throws wire::violation for an unknown or
  /// malformed request (the connection is closed), store_refusal for one the
  /// state refused (an error reply), and what the connection's I/O throws.
  task<std::string> handle(store_request& q);

  /// Bytes of the keys and values held. Callable from any thread.
  [[nodiscard]] std::uint64_t stored_bytes() const noexcept { return stored_bytes_.load(); }
  /// Connections suspended in a get or wait. Callable from any thread.
  [[nodiscard]] std::size_t waiting() const noexcept { return waiting_.load(); }

  /// Erases the keys connection `c` leased (wire::op::lease), as it ends.
  void release(server_connection& c);

  /// The reply that tells a client the store refused its request.
  static std::string refusal(std::string_view message);

 private:
  using handler = task<std::string> (store_operations::*)(store_request&);
  using op = wire::op;
  using status = wire::status;

  // The handler of each operation code; null for codes that name none. Made
  // once at run time by a plain function, not by a constexpr lambda: under
  // nvcc's --expt-relaxed-constexpr (PyTorch's CUDA flags) constexpr code is
  // compiled for the device too, where these member functions do not exist.
  static const std::array<handler, 256>& handlers();
  static std::array<handler, 256> make_handlers();

  static std::string reply(status s) { return std::string(1, static_cast<char>(s)); }

  // status::ok followed by what `fill` writes.
  template <class Fill>
  static std::string ok(Fill&& fill) {
    std::string out = reply(status::ok);
    wire::writer w(out);
    std::forward<Fill>(fill)(w);
    return out;
  }

  static steady::time_point deadline_after(std::uint64_t ms);

  std::string_view read_key(store_request& q) {
    return q.fields.bytes32("key", limits_.max_key_size);
  }

  // Every handler that changes the state ends here, for stored_bytes().
  void changed() { stored_bytes_ = state_.stored_bytes(); }

  task<std::string> set(store_request& q);

  task<std::string> get(store_request& q);

  task<std::string> add(store_request& q);

  task<std::string> compare_set(store_request& q);

  task<std::string> wait(store_request& q);

  task<std::string> check(store_request& q);

  task<std::string> erase(store_request& q);

  task<std::string> num_keys(store_request& q);

  task<std::string> ping(store_request& q);

  task<std::string> lease(store_request& q);

  // Reserves, before a reply that copies the value at `key` is built, what
  // that reply will hold until the client reads it. False when the key is
  // gone meanwhile. Loops because the value may change while it waits.
  task<bool> reserve_value(store_request& q, std::string_view key, std::uint64_t& reserved);

  // Waits until every key exists (true) or the deadline passes (false).
  // Watches the connection meanwhile: a client that goes away ends the wait,
  // quietly when it closed its end (it exited, or gave up), with a reason to
  // log when its connection broke.
  task<bool> wait_for(store_request& q, std::span<const std::string_view> keys,
                      steady::time_point deadline);

  const store_limits limits_;
  kv_state state_;
  // Mirrors for the server's stats(), read from other threads: written here, never read here.
  std::atomic<std::uint64_t> stored_bytes_{0};  // state_.stored_bytes() after the last change
  std::atomic<std::size_t> waiting_{0};         // connections suspended in wait_for
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/operations-inl.hpp>
#endif
