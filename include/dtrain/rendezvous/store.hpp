#pragma once
/// @file
/// The `store` concept (what bootstraps the engines and runs barriers), and
/// prefix_store, which gives each job, restart round and subsystem its own
/// namespace within one store.

#include <chrono>
#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// A key-value store that every rank reaches: set / get (waits) / add /
/// compare_set / wait / check / erase, and barrier. Gloo's five-method store
/// is the model.
template <class S>
concept store = requires(S& s, std::string_view key, std::span<const std::string> keys,
                         std::chrono::milliseconds timeout) {
  s.set(key, key);
  { s.get(key) } -> std::convertible_to<std::string>;
  { s.get(key, timeout) } -> std::convertible_to<std::string>;
  { s.add(key, std::int64_t{1}) } -> std::convertible_to<std::int64_t>;
  { s.compare_set(key, key, key) } -> std::convertible_to<std::string>;
  s.wait(keys);
  s.wait(keys, timeout);
  { s.check(keys) } -> std::convertible_to<bool>;
  { s.erase(key) } -> std::convertible_to<bool>;
  { s.num_keys() } -> std::convertible_to<std::int64_t>;
  s.barrier(key, 1);
  s.barrier(key, 1, timeout);
};

/// A view of another store in which every key (and barrier name) is
/// `prefix/key`. Nests: prefix_store(prefix_store(s, "job7"), "restart2").
/// Does not own the underlying store, which must outlive it.
template <store S>
class prefix_store {
 public:
  using milliseconds = std::chrono::milliseconds;

  prefix_store(S& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix) + "/") {}

  /// The store under the prefix.
  [[nodiscard]] S& inner() noexcept { return inner_; }

  void set(std::string_view key, std::string_view value) { inner_.set(full(key), value); }
  [[nodiscard]] std::string get(std::string_view key) { return inner_.get(full(key)); }
  [[nodiscard]] std::string get(std::string_view key, milliseconds timeout) {
    return inner_.get(full(key), timeout);
  }
  std::int64_t add(std::string_view key, std::int64_t delta) {
    return inner_.add(full(key), delta);
  }
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired) {
    return inner_.compare_set(full(key), expected, desired);
  }
  void wait(std::span<const std::string> keys) { inner_.wait(full(keys)); }
  void wait(std::span<const std::string> keys, milliseconds timeout) {
    inner_.wait(full(keys), timeout);
  }
  [[nodiscard]] bool check(std::span<const std::string> keys) { return inner_.check(full(keys)); }
  bool erase(std::string_view key) { return inner_.erase(full(key)); }
  /// Keys in the whole underlying store, not only under this prefix.
  [[nodiscard]] std::int64_t num_keys() { return inner_.num_keys(); }
  void barrier(std::string_view name, int count) { inner_.barrier(full(name), count); }
  void barrier(std::string_view name, int count, milliseconds timeout) {
    inner_.barrier(full(name), count, timeout);
  }

  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }

 private:
  std::string full(std::string_view key) const { return prefix_ + std::string(key); }
  std::vector<std::string> full(std::span<const std::string> keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(full(k));
    return out;
  }

  S& inner_;
  std::string prefix_;
};

}  // namespace dtrain
