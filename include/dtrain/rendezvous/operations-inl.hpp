#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/operations.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/operations.hpp, not this file.

#include <dtrain/rendezvous/operations.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE task<std::string> store_operations::handle(
    store_request& q) {  // not a coroutine: runs the handler's
  const std::uint8_t code = q.fields.u8("op");
  const handler h = handlers()[code];
  if (h == nullptr) throw wire::violation("unknown operation " + std::to_string(code));
  return (this->*h)(q);
}

DTRAIN_DETAIL_INLINE std::string store_operations::refusal(std::string_view message) {
  std::string body;
  wire::writer(body).u8(static_cast<std::uint8_t>(wire::status::error)).bytes32(message);
  return body;
}

DTRAIN_DETAIL_INLINE auto store_operations::handlers() -> const std::array<handler, 256>& {
  static const std::array<handler, 256> table = make_handlers();
  return table;
}

DTRAIN_DETAIL_INLINE auto store_operations::make_handlers() -> std::array<handler, 256> {
  std::array<handler, 256> t{};
  t[static_cast<std::uint8_t>(op::set)] = &store_operations::set;
  t[static_cast<std::uint8_t>(op::get)] = &store_operations::get;
  t[static_cast<std::uint8_t>(op::add)] = &store_operations::add;
  t[static_cast<std::uint8_t>(op::compare_set)] = &store_operations::compare_set;
  t[static_cast<std::uint8_t>(op::wait)] = &store_operations::wait;
  t[static_cast<std::uint8_t>(op::check)] = &store_operations::check;
  t[static_cast<std::uint8_t>(op::erase)] = &store_operations::erase;
  t[static_cast<std::uint8_t>(op::num_keys)] = &store_operations::num_keys;
  t[static_cast<std::uint8_t>(op::ping)] = &store_operations::ping;
  t[static_cast<std::uint8_t>(op::lease)] = &store_operations::lease;
  return t;
}

DTRAIN_DETAIL_INLINE steady::time_point store_operations::deadline_after(std::uint64_t ms) {
  constexpr std::uint64_t ten_years = 10ull * 365 * 24 * 3600 * 1000;
  return steady::now() + std::chrono::milliseconds(std::min(ms, ten_years));
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::set(store_request& q) {
  auto key = read_key(q);
  auto value = q.fields.bytes32("value", limits_.max_value_size);
  q.fields.finish("set request");
  state_.set(key, value);
  changed();
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::get(store_request& q) {
  auto key = read_key(q);
  auto ms = q.fields.u64("timeout");
  q.fields.finish("get request");
  const std::array<std::string_view, 1> keys{key};
  const auto deadline = deadline_after(ms);
  std::uint64_t reserved = 0;
  do {
    if (!co_await wait_for(q, keys, deadline)) co_return reply(status::timeout);
  } while (!co_await reserve_value(q, key, reserved));
  co_return ok([&](wire::writer& w) { w.bytes32(*state_.find(key)); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::add(store_request& q) {
  auto key = read_key(q);
  auto delta = q.fields.i64("delta");
  q.fields.finish("add request");
  const std::int64_t sum = state_.add(key, delta);
  changed();
  co_return ok([&](wire::writer& w) { w.i64(sum); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::compare_set(store_request& q) {
  auto key = read_key(q);
  auto expected = q.fields.bytes32("expected value", limits_.max_value_size);
  auto desired = q.fields.bytes32("desired value", limits_.max_value_size);
  q.fields.finish("compare_set request");
  std::uint64_t reserved = 0;
  (void)co_await reserve_value(q, key, reserved);  // the reply may copy the value
  const std::string_view now = state_.compare_set(key, expected, desired);
  changed();
  co_return ok([&](wire::writer& w) { w.bytes32(now); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::wait(store_request& q) {
  auto keys = wire::read_keys(q.fields, limits_);
  auto ms = q.fields.u64("timeout");
  q.fields.finish("wait request");
  if (!co_await wait_for(q, keys, deadline_after(ms))) co_return reply(status::timeout);
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::check(store_request& q) {
  auto keys = wire::read_keys(q.fields, limits_);
  q.fields.finish("check request");
  const bool all = state_.check(keys);
  co_return ok([&](wire::writer& w) { w.u8(all ? 1 : 0); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::erase(store_request& q) {
  auto key = read_key(q);
  q.fields.finish("erase request");
  const bool existed = state_.erase(key);
  changed();
  co_return ok([&](wire::writer& w) { w.u8(existed ? 1 : 0); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::num_keys(store_request& q) {
  q.fields.finish("num_keys request");
  co_return ok([&](wire::writer& w) { w.u64(state_.size()); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::ping(store_request& q) {
  q.fields.finish("ping request");
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::lease(store_request& q) {
  auto key = read_key(q);
  auto value = q.fields.bytes32("value", limits_.max_value_size);
  q.fields.finish("lease request");
  auto& held = q.c.leases();
  auto mine =
      std::find_if(held.begin(), held.end(), [&](const auto& kv) { return kv.first == key; });
  if (mine == held.end() && held.size() >= wire::max_leases_per_connection) {
    throw store_refusal("lease(\"" + std::string(key) + "\"): this connection holds " +
                        std::to_string(held.size()) + " leased keys, the most one may");
  }
  if (value.size() > wire::max_lease_value) {
    throw store_refusal("lease(\"" + std::string(key) + "\"): a value of " +
                        std::to_string(value.size()) + " bytes; a leased key holds at most " +
                        std::to_string(wire::max_lease_value));
  }
  state_.set(key, value);
  changed();
  if (mine == held.end()) {
    held.emplace_back(std::string(key), std::string(value));
  } else {
    mine->second = value;
  }
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE void store_operations::release(server_connection& c) {
  for (const auto& [key, value] : c.leases()) {
    const std::string* now = state_.find(key);
    if (now != nullptr && *now == value) state_.erase(key);
  }
  c.leases().clear();
  changed();
}

DTRAIN_DETAIL_INLINE task<bool> store_operations::reserve_value(store_request& q,
                                                                std::string_view key,
                                                                std::uint64_t& reserved) {
  for (;;) {
    const std::string* value = state_.find(key);
    if (value == nullptr) co_return false;
    const std::uint64_t size = value->size();
    if (size <= reserved) co_return true;
    co_await q.c.reserve(q.held, size - reserved, q.c.io_deadline(),
                         "a reply of " + std::to_string(size) + " bytes");
    reserved = size;
  }
}

DTRAIN_DETAIL_INLINE task<bool> store_operations::wait_for(store_request& q,
                                                           std::span<const std::string_view> keys,
                                                           steady::time_point deadline) {
  bool charged = false;
  for (;;) {
    std::vector<std::string> missing = state_.missing(keys);
    if (missing.empty()) co_return true;
    if (!charged) {
      // A wait holds a copy of each missing key twice (here and in the state's waiters).
      std::uint64_t bytes = 0;
      for (const auto& k : missing) bytes += 2 * (k.size() + 64);
      co_await q.c.reserve(q.held, bytes, q.c.io_deadline(),
                           "a wait on " + std::to_string(missing.size()) + " keys");
      charged = true;
      continue;  // keys may have been set while it waited for the budget
    }
    const kv_state::watch watching(state_, q.c.waiter(), std::move(missing));
    ++waiting_;
    const wake w = co_await q.c.wait(EPOLLIN | EPOLLRDHUP, deadline);
    --waiting_;
    switch (w) {
      case wake::event:
      case wake::none: continue;
      case wake::timeout: co_return false;
      case wake::stop: throw server_stopping{};
      case wake::io: break;
    }
    switch (q.c.peek()) {
      case hangup::none: continue;
      case hangup::request: throw wire::violation("sent a new request while its wait was pending");
      case hangup::orderly: throw client_gone{};
      case hangup::broken: throw client_gone{"waiting for \"" + watching.keys().front() + "\""};
    }
  }
}

}  // namespace dtrain::detail
