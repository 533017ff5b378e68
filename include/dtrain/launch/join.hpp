#pragma once
/// @file
/// How a worker waits for the others at rendezvous, and says so. Every rank
/// sets its report and counts itself in (launch/protocol.hpp's job_keys);
/// rank 0 waits until everyone has joined and then places them. While a rank
/// waits it says every few seconds who has joined and who has not ("1 of 2
/// ranks joined; waiting for rank 1"), and at its timeout it names the ranks
/// that never came and the likely causes, instead of a store key.

#include <dtrain/error.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// One rank's wait at rendezvous, through `Store` (the job's prefix store).
template <store Store>
class rendezvous_wait {
 public:
  using milliseconds = std::chrono::milliseconds;

  struct setup {
    std::string endpoint;  ///< "host:port" of the store, for messages
    int rank = 0;
    int size = 1;
    milliseconds timeout{};                       ///< how long a rank waits for the others
    milliseconds interval{};                      ///< how often it says so
    std::function<void(std::string_view)> say{};  ///< where it says so (detail::say)
    std::string world_size_origin;                ///< "WORLD_SIZE=4", for the likely causes
  };

  rendezvous_wait(Store& store, setup s) : store_(store), s_(std::move(s)) {}

  /// Sets this rank's report and counts it in; the last rank to join marks
  /// everyone joined.
  void join(std::string_view report) {
    store_.set(job_keys::report(s_.rank), report);
    if (store_.add(job_keys::joined, 1) == s_.size) {
      store_.set(job_keys::joined_all, present_value());
    }
  }

  /// Rank 0: waits until every rank has joined, saying who is missing every
  /// interval. Throws timeout_error naming the missing ranks and the likely
  /// causes after the timeout.
  void await_everyone() {
    const std::string all(job_keys::joined_all);
    if (!await(all, true)) throw timeout_error(never_joined());
  }

  /// Every other rank: the value of `key` (rank 0's answer), once set. While
  /// rank 0 itself has not joined, says who is missing every interval (rank 0
  /// says it otherwise). Throws timeout_error after the timeout, naming the
  /// missing ranks, or rank 0 when everyone joined but no answer came.
  [[nodiscard]] std::string await_answer(std::string_view key) {
    const std::string wanted(key);
    if (await(wanted, false)) return store_.get(wanted);
    if (joined() < s_.size) throw timeout_error(never_joined());
    throw timeout_error(prefix() + " timed out after " + whole_seconds(s_.timeout) +
                        ": every rank joined, but rank 0 did not answer (store key \"" + wanted +
                        "\"); see rank 0's output for why");
  }

  /// What the wait looks like now: "1 of 2 ranks joined; waiting for rank 1".
  [[nodiscard]] std::string progress() {
    const std::int64_t count = joined();
    const std::vector<int> missing = missing_ranks();
    std::string out = std::to_string(count) + " of " + std::to_string(s_.size) + " ranks joined";
    if (!missing.empty()) out += "; waiting for " + rank_list(missing, s_.size - count);
    return out;
  }

 private:
  using steady = std::chrono::steady_clock;

  /// The most ranks a message names.
  static constexpr std::size_t named_ranks = 8;
  /// The most keys one check() asks for (the store's default limit is 4096).
  static constexpr int keys_per_check = 1024;

  // Waits for `key` in slices of the interval; reports between slices (rank
  // 0 always, the others while rank 0 is missing). False at the timeout.
  bool await(const std::string& key, bool report_always) {
    const auto start = steady::now();
    const auto deadline = start + s_.timeout;
    const std::string keys[] = {key};
    for (;;) {
      const auto left = std::chrono::ceil<milliseconds>(deadline - steady::now());
      if (left <= milliseconds::zero()) return false;
      try {
        store_.wait(keys, s_.interval > milliseconds::zero() ? std::min(left, s_.interval) : left);
        return true;
      } catch (const timeout_error&) {
        // The store ended this slice of the wait; the connection stays sound.
      }
      const auto now = steady::now();
      if (now >= deadline) return false;
      if (report_always || !store_.check(std::vector<std::string>{job_keys::report(0)})) {
        say(s_.say, prefix() + ": " + progress() + " (" +
                        whole_seconds(std::chrono::duration_cast<milliseconds>(now - start)) +
                        " of " + whole_seconds(s_.timeout) + ")");
      }
    }
  }

  [[nodiscard]] std::string prefix() const { return "rendezvous at " + s_.endpoint; }

  [[nodiscard]] std::int64_t joined() { return store_.add(job_keys::joined, 0); }

  // The first named_ranks ranks whose report is missing, found by halving
  // ranges whose check() fails: a few requests when few are missing.
  [[nodiscard]] std::vector<int> missing_ranks() {
    std::vector<int> out;
    find_missing(0, s_.size, out);
    return out;
  }
  void find_missing(int lo, int hi, std::vector<int>& out) {
    if (lo >= hi || out.size() >= named_ranks) return;
    if (hi - lo <= keys_per_check) {
      std::vector<std::string> keys;
      for (int r = lo; r < hi; ++r) keys.push_back(job_keys::report(r));
      if (store_.check(keys)) return;
      if (hi - lo == 1) {
        out.push_back(lo);
        return;
      }
    }
    const int mid = lo + (hi - lo) / 2;
    find_missing(lo, mid, out);
    find_missing(mid, hi, out);
  }

  // "rank 1", "ranks 1, 3", "998 ranks, among them 1, 2, ..., 8".
  static std::string rank_list(const std::vector<int>& ranks, std::int64_t total) {
    std::string names;
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      names += (i ? ", " : "") + std::to_string(ranks[i]);
    }
    if (total > static_cast<std::int64_t>(ranks.size())) {
      return std::to_string(total) + " ranks, among them " + names;
    }
    return (ranks.size() == 1 ? "rank " : "ranks ") + names;
  }

  [[nodiscard]] std::string never_joined() {
    const std::int64_t count = joined();
    const std::vector<int> missing = missing_ranks();
    const std::string who = rank_list(missing, s_.size - count);
    const bool one = s_.size - count == 1;
    return prefix() + " timed out after " + whole_seconds(s_.timeout) + ": " +
           std::to_string(count) + " of " + std::to_string(s_.size) + " ranks joined; " + who +
           " never did. Likely causes: MASTER_ADDR or MASTER_PORT differ between ranks "
           "(this rank met at " +
           s_.endpoint + "), a firewall blocks that port, " + (one ? "that rank" : "those ranks") +
           " never started or failed before joining (see " + (one ? "its" : "their") +
           " output), or the world size (" + s_.world_size_origin +
           ") is larger than the number of ranks started";
  }

  Store& store_;
  setup s_;
};

}  // namespace dtrain::detail
