#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/kv_state.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/kv_state.hpp, not this file.

#include <dtrain/rendezvous/kv_state.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE kv_state::watch::~watch() {
  for (const auto& k : keys_) {
    auto it = state_->waiters_.find(k);
    if (it == state_->waiters_.end()) continue;  // set meanwhile: its waiters were woken
    std::erase(it->second, waiter_);
    if (it->second.empty()) state_->waiters_.erase(it);
  }
}

DTRAIN_DETAIL_INLINE const std::string* kv_state::find(std::string_view key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> kv_state::missing(
    std::span<const std::string_view> keys) const {
  std::vector<std::string> out;
  for (auto k : keys) {
    if (!data_.contains(k)) out.emplace_back(k);
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::int64_t kv_state::add(std::string_view key, std::int64_t delta) {
  std::int64_t current = 0;
  if (const std::string* text = find(key)) {
    auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), current);
    if (ec != std::errc() || end != text->data() + text->size()) {
      throw store_refusal("add(\"" + std::string(key) +
                          "\"): the key holds a value that is not an integer");
    }
  }
  std::int64_t next = 0;
  if (__builtin_add_overflow(current, delta, &next)) {
    throw store_refusal("add(\"" + std::string(key) + "\"): the counter would overflow");
  }
  if (!store(key, std::to_string(next))) throw over_capacity("add", key, 20);
  return next;
}

DTRAIN_DETAIL_INLINE std::string_view kv_state::compare_set(std::string_view key,
                                                            std::string_view expected,
                                                            std::string_view desired) {
  const std::string* current = find(key);
  const bool matches = current ? *current == expected : expected.empty();
  if (matches && !store(key, desired)) throw over_capacity("compare_set", key, desired.size());
  current = find(key);
  return current ? std::string_view(*current) : std::string_view{};
}

DTRAIN_DETAIL_INLINE bool kv_state::erase(std::string_view key) {
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  stored_ -= it->first.size() + it->second.size();
  data_.erase(it);
  return true;
}

DTRAIN_DETAIL_INLINE bool kv_state::store(std::string_view key, std::string_view value) {
  auto it = data_.find(key);
  const std::uint64_t before = it == data_.end() ? 0 : key.size() + it->second.size();
  const std::uint64_t after = stored_ - before + key.size() + value.size();
  if (after > cap_ && after > stored_) return false;
  stored_ = after;
  if (it != data_.end()) {
    it->second.assign(value);
  } else {
    data_.emplace(std::string(key), std::string(value));
  }
  if (auto w = waiters_.find(key); w != waiters_.end()) {
    auto woken = std::move(w->second);
    waiters_.erase(w);
    for (const kv_waiter* waiter : woken) (*waiter)();
  }
  return true;
}

DTRAIN_DETAIL_INLINE store_refusal kv_state::over_capacity(const char* what, std::string_view key,
                                                           std::size_t value_size) const {
  return store_refusal(std::string(what) + "(\"" + std::string(key.substr(0, 200)) + "\") of " +
                       std::to_string(value_size) + " bytes: the store holds " +
                       std::to_string(stored_) + " bytes and its cap is " + std::to_string(cap_) +
                       " (store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
}

}  // namespace dtrain::detail
