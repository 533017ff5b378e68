// The host control plane (store_channel, control_plane) and the watchdog that
// follows work nobody waits for on the host.
#include "support.hpp"

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

const dtrain::store_options quick{.timeout = 20s};

/// Work that never finishes on its own; counts the engine's timeout hook.
class stuck_work final : public dtrain::detail::work_state {
 public:
  stuck_work(std::chrono::milliseconds timeout, std::atomic<int>& aborted, bool finish_when_aborted)
      : work_state(dtrain::detail::collective_info{.collective = "allreduce",
                                                   .engine = "test",
                                                   .rank = 0,
                                                   .size = 2,
                                                   .count = 1024,
                                                   .type = 0,
                                                   .op = 0},
                   timeout),
        aborted_(aborted),
        finish_when_aborted_(finish_when_aborted) {}
  bool poll() override { return finish_when_aborted_ && aborted_ > 0; }
  void on_timeout() noexcept override { ++aborted_; }

 private:
  std::atomic<int>& aborted_;
  bool finish_when_aborted_;
};

/// Work whose abort blocks until released, as ncclCommAbort does behind a
/// CUDA stream that a host function holds.
class abort_blocks_work final : public dtrain::detail::work_state {
 public:
  explicit abort_blocks_work(std::atomic<bool>& released)
      : work_state("allreduce(sum, 8 x float32) on rank 0 of 2 (test)", 100ms),
        released_(released) {}
  bool poll() override { return false; }
  void on_timeout() noexcept override {
    while (!released_.load()) std::this_thread::sleep_for(1ms);
  }

 private:
  std::atomic<bool>& released_;
};

class failing_work final : public dtrain::detail::work_state {
 public:
  failing_work() : work_state("broadcast(4 x int32) on rank 1 of 2 (test)", 10s) {
    fail(std::make_exception_ptr(dtrain::backend_error("the engine says no", 7)));
  }
  bool poll() override { return true; }
};

/// Work that finishes at its `polls_needed`-th poll, and counts its polls.
class counted_work final : public dtrain::detail::work_state {
 public:
  explicit counted_work(int polls_needed)
      : work_state("barrier() on rank 0 of 2 (test)", 10s), needed_(polls_needed) {}
  bool poll() override { return ++polls >= needed_; }
  int polls = 0;

 private:
  int needed_;
};

}  // namespace

TEST_CASE("work: copies share the end, and the timeout, that one of them saw") {
  auto counted = std::make_shared<counted_work>(3);
  dtrain::work first(counted);
  const dtrain::work copy = first;
  first.wait();
  CHECK(counted->polls == 3);
  dtrain::work second = copy;
  CHECK(second.test());  // done, without asking the engine again
  CHECK(second.exception() == nullptr);
  CHECK(counted->polls == 3);

  std::atomic<int> aborted{0};
  dtrain::work stuck(std::make_shared<stuck_work>(200ms, aborted, false));
  dtrain::work other = stuck;
  CHECK_FALSE(other.test());
  CHECK_THROWS_WITH_AS(stuck.wait(), doctest::Contains("did not finish within 0.2 s"),
                       dtrain::timeout_error);
  CHECK(aborted == 1);
  CHECK(other.test());  // the copy knows it is over: it neither waits nor aborts again
  REQUIRE(other.exception() != nullptr);
  CHECK_THROWS_WITH_AS(other.wait(), doctest::Contains("did not finish within 0.2 s"),
                       dtrain::timeout_error);
  CHECK(aborted == 1);
}

namespace {
/// `size` ranks on threads, each with its own client of `server`:
/// body(client, rank). Each rank's exception's text, or "".
std::vector<std::string> on_store_ranks(
    dtrain::store_server& server, int size,
    const std::function<void(dtrain::store_client&, int)>& body) {
  std::vector<std::string> failures(static_cast<std::size_t>(size));
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      try {
        dtrain::store_client client("127.0.0.1", server.port(), quick);
        body(client, r);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  return failures;
}
}  // namespace

TEST_CASE("control plane: store_channel allgathers and broadcasts among threads, and cleans up") {
  dtrain::store_server server("127.0.0.1", 0, quick);
  constexpr int size = 4;
  std::vector<std::vector<std::int64_t>> gathered(size);
  std::vector<std::vector<std::uint8_t>> received(size);
  const auto failures = on_store_ranks(server, size, [&](dtrain::store_client& client, int r) {
    dtrain::store_channel channel(client, r, size, "test-control");
    dtrain::control_plane plane(channel);
    for (int round = 0; round < 3; ++round) {
      const std::int64_t mine[2] = {r * 10 + round, -r};
      gathered[static_cast<std::size_t>(r)].assign(2 * size, 0);
      plane.allgather(mine, gathered[static_cast<std::size_t>(r)]);
      std::vector<std::uint8_t> bytes(5, static_cast<std::uint8_t>(r == 2 ? 40 + round : 0));
      plane.broadcast(bytes, 2);
      received[static_cast<std::size_t>(r)] = bytes;
    }
  });
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r);
    CHECK(failures[static_cast<std::size_t>(r)].empty());
    for (int from = 0; from < size; ++from) {
      CHECK(gathered[static_cast<std::size_t>(r)][static_cast<std::size_t>(2 * from)] ==
            from * 10 + 2);
      CHECK(gathered[static_cast<std::size_t>(r)][static_cast<std::size_t>(2 * from + 1)] == -from);
    }
    CHECK(received[static_cast<std::size_t>(r)] == std::vector<std::uint8_t>(5, 42));
  }
  // The last reader of every round erased it: nothing is left behind.
  dtrain::store_client check("127.0.0.1", server.port(), quick);
  CHECK(check.num_keys() == 0);
}

namespace {
/// A store that counts the bytes its gets returned (a store_client underneath).
struct counting_store {
  dtrain::store_client& inner;
  std::size_t got = 0;
  void set(std::string_view k, std::string_view v) { inner.set(k, v); }
  std::string get(std::string_view k) {
    std::string v = inner.get(k);
    got += v.size();
    return v;
  }
  std::string get(std::string_view k, std::chrono::milliseconds t) {
    std::string v = inner.get(k, t);
    got += v.size();
    return v;
  }
  std::int64_t add(std::string_view k, std::int64_t d) { return inner.add(k, d); }
  std::string compare_set(std::string_view k, std::string_view e, std::string_view d) {
    return inner.compare_set(k, e, d);
  }
  void wait(std::span<const std::string> keys) { inner.wait(keys); }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds t) { inner.wait(keys, t); }
  bool check(std::span<const std::string> keys) { return inner.check(keys); }
  bool erase(std::string_view k) { return inner.erase(k); }
  std::int64_t num_keys() { return inner.num_keys(); }
  void barrier(std::string_view k, int n) { inner.barrier(k, n); }
  void barrier(std::string_view k, int n, std::chrono::milliseconds t) { inner.barrier(k, n, t); }
};
static_assert(dtrain::store<counting_store>);
}  // namespace

TEST_CASE(
    "control plane: a broadcast to some ranks reads nothing from the store on the others, and "
    "cleans up") {
  dtrain::store_server server("127.0.0.1", 0, quick);
  constexpr int size = 4;
  std::vector<std::vector<std::uint8_t>> received(size);
  std::vector<std::size_t> got(size);
  const auto failures = on_store_ranks(server, size, [&](dtrain::store_client& client, int r) {
    counting_store counted{client};
    dtrain::store_channel channel(counted, r, size, "test-some");
    dtrain::control_plane plane(channel);
    for (int round = 0; round < 3; ++round) {
      std::vector<std::uint8_t> bytes(1000, static_cast<std::uint8_t>(r == 1 ? 7 : 0));
      plane.broadcast(bytes, 1, r == 3);  // rank 1 to rank 3 alone
      received[static_cast<std::size_t>(r)] = bytes;
    }
    got[static_cast<std::size_t>(r)] = counted.got;
  });
  for (int r = 0; r < size; ++r) {
    INFO("rank " << r);
    CHECK(failures[static_cast<std::size_t>(r)].empty());
    CHECK(received[static_cast<std::size_t>(r)] ==
          std::vector<std::uint8_t>(1000, r == 0 || r == 2 ? 0 : 7));
  }
  CHECK(got[0] == 0);
  CHECK(got[2] == 0);
  CHECK(got[3] == 3000);
  dtrain::store_client check("127.0.0.1", server.port(), quick);
  CHECK(check.num_keys() == 0);
}

TEST_CASE("control plane: a rank that sends another length is a rendezvous_error naming the key") {
  dtrain::store_server server("127.0.0.1", 0, quick);
  std::string failure;
  std::thread other([&] {
    dtrain::store_client client("127.0.0.1", server.port(), quick);
    dtrain::store_channel channel(client, 1, 2);
    std::vector<std::uint8_t> longer(9, 1);
    channel.broadcast(longer, 1);
  });
  dtrain::store_client client("127.0.0.1", server.port(), quick);
  dtrain::store_channel channel(client, 0, 2);
  std::vector<std::uint8_t> bytes(4, 0);
  try {
    channel.broadcast(bytes, 1);
  } catch (const dtrain::rendezvous_error& e) {
    failure = e.what();
  }
  other.join();
  CHECK_CONTAINS(failure, "control/1/root");
  CHECK_CONTAINS(failure, "has 9 bytes, rank 0 expected 4");
}

namespace {

/// What each of `size` ranks (threads, each with its own client) got from
/// broadcast_or_fail under store key "boot/value": the value, or its error.
struct bootstrap_results {
  std::vector<std::string> values, errors;
  // Not vector<bool>: its elements share words, and each rank's thread writes its own.
  std::vector<char> was_rendezvous_error, was_config_error;
  std::chrono::steady_clock::time_point root_ended{};            // when rank 0 returned or threw
  std::vector<std::chrono::steady_clock::time_point> started{};  // when each rank began its call
  std::int64_t failure_reads = 0;  // ranks that counted themselves as having read it
};
/// `size` ranks as threads; every rank but 0 starts `late` after it.
template <class Produce>
bootstrap_results bootstrap_over_store(int size, Produce produce,
                                       std::chrono::milliseconds late = 0ms) {
  dtrain::store_server server("127.0.0.1", 0, {.timeout = 20s, .log = [](std::string_view) {}});
  const auto n = static_cast<std::size_t>(size);
  bootstrap_results out{std::vector<std::string>(n), std::vector<std::string>(n),
                        std::vector<char>(n), std::vector<char>(n)};
  out.started.resize(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      if (r != 0) std::this_thread::sleep_for(late);
      const auto start = std::chrono::steady_clock::now();
      out.started[i] = start;  // each thread its own slot
      struct timing {
        int rank;
        std::chrono::steady_clock::time_point start;
        std::chrono::steady_clock::time_point& ended;
        ~timing() {
          if (rank == 0) ended = std::chrono::steady_clock::now();
        }
      } timed{r, start, out.root_ended};
      try {
        dtrain::store_client client("127.0.0.1", server.port(), quick);
        dtrain::prefix_store<dtrain::store_client> job(client, "job");
        out.values[i] = dtrain::detail::broadcast_or_fail(
            dtrain::detail::store_relay(job, "boot/value", r, size), "the test value", produce);
      } catch (const dtrain::config_error& e) {
        out.errors[i] = e.what();
        out.was_config_error[i] = true;
      } catch (const dtrain::rendezvous_error& e) {
        out.errors[i] = e.what();
        out.was_rendezvous_error[i] = true;
      } catch (const std::exception& e) {
        out.errors[i] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  dtrain::store_client client("127.0.0.1", server.port(), quick);
  out.failure_reads = client.add("job/boot/value/failure_read", 0);
  return out;
}

}  // namespace

TEST_CASE("broadcast_or_fail: rank 0's value reaches every rank through the store") {
  int calls = 0;
  const auto got = bootstrap_over_store(3, [&] {
    ++calls;
    return std::string("v\0lue", 5);
  });
  CHECK(calls == 1);  // only rank 0 produces it
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(got.errors[static_cast<std::size_t>(r)].empty());
    CHECK(got.values[static_cast<std::size_t>(r)] == std::string("v\0lue", 5));
  }
}

TEST_CASE("broadcast_or_fail: when rank 0 fails, every rank fails at once with rank 0's message") {
  // The store waits 20 s: a rank that waited for a value instead would end with a timeout_error.
  const auto got = bootstrap_over_store(
      3, []() -> std::string { throw dtrain::config_error("DEVICE=7 is not a device here"); });
  CHECK(got.was_config_error[0]);  // rank 0 throws its own error, unchanged
  CHECK(got.errors[0] == "DEVICE=7 is not a device here");
  for (int r = 1; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(got.was_rendezvous_error[static_cast<std::size_t>(r)]);
    CHECK(got.errors[static_cast<std::size_t>(r)] ==
          "rank 0 could not provide the test value: DEVICE=7 is not a device here");
  }
}

TEST_CASE("broadcast_or_fail: a failed root stays until the others have read its failure") {
  // Rank 0 may host the store: had it returned at once, ranks that start
  // 300 ms later would find no store, only "could not reach".
  const auto got = bootstrap_over_store(
      3, []() -> std::string { throw dtrain::config_error("no GPU"); }, 300ms);
  for (int r = 1; r < 3; ++r) {
    INFO("rank " << r);
    CHECK(got.errors[static_cast<std::size_t>(r)] ==
          "rank 0 could not provide the test value: no GPU");
  }
  CHECK(got.failure_reads == 2);
  // It cannot have seen their reads before they started: it returned after
  // the last of them began its call (not a timing threshold: the order).
  CHECK(got.root_ended >= std::max(got.started[1], got.started[2]));
  // A value needs no such wait, and nobody counts a read.
  const auto ok = bootstrap_over_store(
      3, [] { return std::string("v"); }, 300ms);
  CHECK(ok.values[2] == "v");
  CHECK(ok.failure_reads == 0);
}

TEST_CASE(
    "broadcast_or_fail: a value that is not an outcome is a rendezvous_error naming the key") {
  dtrain::store_server server("127.0.0.1", 0, quick);
  dtrain::store_client client("127.0.0.1", server.port(), quick);
  client.set("boot/value", "written by someone else");
  try {
    (void)dtrain::detail::broadcast_or_fail(dtrain::detail::store_relay(client, "boot/value", 1, 2),
                                            "the test value", [] { return std::string(); });
    FAIL("a foreign value was accepted");
  } catch (const dtrain::rendezvous_error& e) {
    CHECK_CONTAINS(e.what(), "store key \"boot/value\" does not hold the test value");
    CHECK_CONTAINS(e.what(), "the ok flag is 119, not 0 or 1");
  }
  // The one format: a flag, then the value or the producer's error.
  using dtrain::detail::wire::outcome;
  const outcome failed = outcome::decode("k", outcome{false, "why"}.encode(), "x");
  CHECK((!failed.ok && failed.text == "why"));
  CHECK_THROWS_AS((void)outcome::decode("k", outcome{true, "v"}.encode() + "!", "x"),
                  dtrain::rendezvous_error);
}

namespace {

/// What each rank got from a verdict among `problems.size()` ranks (threads,
/// each with its own client), and then from agree_or_throw<checkpoint_error>
/// on the same problems: its error, or nothing.
struct verdict_results {
  std::vector<dtrain::verdict> verdicts;
  std::vector<std::string> errors;
  // Not vector<bool>: its elements share words, and each rank's thread writes its own.
  std::vector<char> was_checkpoint_error;
  std::int64_t keys_left = -1;  // what the control plane left in the store
};
verdict_results verdict_among_threads(const std::vector<std::string>& problems) {
  dtrain::store_server server("127.0.0.1", 0, quick);
  const int size = static_cast<int>(problems.size());
  const auto n = problems.size();
  verdict_results out{std::vector<dtrain::verdict>(n), std::vector<std::string>(n),
                      std::vector<char>(n)};
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      const auto i = static_cast<std::size_t>(r);
      try {
        dtrain::store_client client("127.0.0.1", server.port(), quick);
        dtrain::store_channel channel(client, r, size, "test-verdict");
        dtrain::control_plane plane(channel);
        out.verdicts[i] = dtrain::gather_verdict(plane, problems[i]);
        dtrain::agree_or_throw<dtrain::checkpoint_error>(plane, "load the test step", problems[i]);
      } catch (const std::exception& e) {
        out.errors[i] = e.what();
        out.was_checkpoint_error[i] = dynamic_cast<const dtrain::checkpoint_error*>(&e) != nullptr;
      }
    });
  }
  for (auto& t : ranks) t.join();
  dtrain::store_client check("127.0.0.1", server.port(), quick);
  out.keys_left = check.num_keys();
  return out;
}

}  // namespace

TEST_CASE("verdict: when every rank is ok, every rank returns and the store is left clean") {
  const auto got = verdict_among_threads({"", "", "", ""});
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(got.errors[r].empty());
    CHECK(got.verdicts[r].ok());
    CHECK(got.verdicts[r].first_failed() == -1);
    CHECK(got.verdicts[r].first_problem.empty());
  }
  CHECK(got.keys_left == 0);
}

TEST_CASE("verdict: the rank that failed throws its own message, every other rank names it") {
  const auto got = verdict_among_threads({"", "", "checkpoint: disk full (rank 2)", ""});
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << got.errors[r]);
    CHECK(got.was_checkpoint_error[r]);  // the caller's type, on every rank
    CHECK(got.verdicts[r].failed == std::vector<int>{2});
    CHECK(got.verdicts[r].first_problem == "checkpoint: disk full (rank 2)");
    CHECK(got.errors[r] == (r == 2 ? "checkpoint: disk full (rank 2)"
                                   : "rank 2 could not load the test step, so every rank stops: "
                                     "checkpoint: disk full (rank 2)"));
  }
  CHECK(got.keys_left == 0);
}

TEST_CASE("verdict: when several ranks fail, the others name them all and carry the lowest's") {
  const auto got = verdict_among_threads({"", "no space (rank 1)", "", "bad file (rank 3)"});
  CHECK(got.errors[1] == "no space (rank 1)");
  CHECK(got.errors[3] == "bad file (rank 3)");
  for (const std::size_t r : {0u, 2u}) {
    INFO("rank " << r);
    CHECK(got.verdicts[r].first_failed() == 1);
    CHECK(got.verdicts[r].failed == std::vector<int>{1, 3});
    CHECK(got.errors[r] ==
          "ranks 1, 3 could not load the test step, so every rank stops; rank 1's error: no "
          "space (rank 1)");
  }
  // A message longer than the limit reaches the others cut, not refused.
  const std::string longer(dtrain::verdict_text_limit + 100, 'x');
  const auto cut = verdict_among_threads({longer, ""});
  CHECK(cut.errors[0] == longer);
  CHECK(cut.verdicts[1].first_problem == longer.substr(0, dtrain::verdict_text_limit));
  // The message is the verdict's own: any rank can make it again.
  const dtrain::verdict one{.failed = {0}, .first_problem = "why"};
  CHECK(one.message("do it") == "rank 0 could not do it, so every rank stops: why");
}

TEST_CASE("verdict: by default a failure is a dtrain::error, and one rank needs nobody else") {
  dtrain::store_server server("127.0.0.1", 0, quick);
  dtrain::store_client client("127.0.0.1", server.port(), quick);
  dtrain::store_channel channel(client, 0, 1, "test-verdict-alone");
  dtrain::control_plane plane(channel);
  dtrain::agree_or_throw(plane, "do it", "");
  CHECK_THROWS_WITH_AS(dtrain::agree_or_throw(plane, "do it", "this rank's reason"),
                       "this rank's reason", dtrain::error);
  CHECK_THROWS_AS(dtrain::agree_or_throw<dtrain::config_error>(plane, "do it", "why"),
                  dtrain::config_error);
  CHECK(client.num_keys() == 0);
}

TEST_CASE("watchdog: work that never finishes is a timeout_error naming the collective, in time") {
  std::atomic<int> aborted{0};
  std::optional<dtrain::watchdog> dog(std::in_place);
  const auto start = std::chrono::steady_clock::now();
  dog->watch(dtrain::work(std::make_shared<stuck_work>(500ms, aborted, false)));
  CHECK(dog->failure() == nullptr);  // nothing is known before the timeout
  std::exception_ptr failure = dog->drain();
  const auto took = std::chrono::steady_clock::now() - start;
  REQUIRE(failure != nullptr);
  CHECK(took >= 500ms);
  CHECK(took < 1500ms);  // within the timeout plus one second
  try {
    std::rethrow_exception(failure);
  } catch (const dtrain::timeout_error& e) {
    CHECK_CONTAINS(std::string(e.what()), "allreduce(sum, 1024 x float32) on rank 0 of 2 (test)");
    CHECK_CONTAINS(std::string(e.what()), "did not finish within 0.5 s");
    CHECK_CONTAINS(std::string(e.what()), "counted from launch");
  }
  CHECK(dog->failure() == failure);
  dog.reset();          // the abort runs after the failure is reported; the destructor joins it
  CHECK(aborted == 1);  // the engine's hook ran: NCCL aborts its communicator there
}

TEST_CASE("watchdog: the deadline counts from launch, work is followed in order, errors are kept") {
  std::atomic<int> aborted{0};
  // Two stuck pieces with the same timeout, handed over together: both time
  // out at about the same moment, not one after the other.
  const auto start = std::chrono::steady_clock::now();
  {
    dtrain::watchdog dog;
    dog.watch(dtrain::work(std::make_shared<stuck_work>(400ms, aborted, false)));
    dog.watch(dtrain::work(std::make_shared<stuck_work>(400ms, aborted, false)));
    const std::exception_ptr first = dog.drain();  // returns at the first failure
    REQUIRE(first != nullptr);
    CHECK_THROWS_WITH_AS(
        std::rethrow_exception(first),
        doctest::Contains("watchdog: allreduce(sum, 1024 x float32) on rank 0 of 2"),
        dtrain::timeout_error);
  }  // the destructor follows the second to its end
  CHECK(aborted == 2);
  CHECK(std::chrono::steady_clock::now() - start < 1400ms);

  dtrain::watchdog second;
  second.watch(dtrain::work(std::make_shared<failing_work>()));
  std::exception_ptr failure = second.drain();
  REQUIRE(failure != nullptr);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(failure), doctest::Contains("the engine says no"),
                       dtrain::backend_error);

  dtrain::watchdog quiet;
  quiet.watch(dtrain::work());  // already complete
  CHECK(quiet.drain() == nullptr);
}

TEST_CASE("watchdog: a failure its owner never asked for goes to run(), once") {
  std::atomic<int> aborted{0};
  dtrain::detail::late_failure_hold hold;
  {
    dtrain::watchdog dog;  // destroyed normally, with its work still running
    dog.watch(dtrain::work(std::make_shared<stuck_work>(200ms, aborted, false)));
  }
  const std::exception_ptr late = hold.take();
  REQUIRE(late != nullptr);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(late),
                       doctest::Contains("did not finish within 0.2 s"), dtrain::timeout_error);
  CHECK(hold.take() == nullptr);  // taken
  {
    dtrain::watchdog asked;  // its owner saw the failure: nothing more to report
    asked.watch(dtrain::work(std::make_shared<stuck_work>(200ms, aborted, false)));
    CHECK(asked.drain() != nullptr);
  }
  CHECK(hold.take() == nullptr);
  try {
    dtrain::watchdog failing;  // its owner failed: that failure is the one reported
    failing.watch(dtrain::work(std::make_shared<stuck_work>(200ms, aborted, false)));
    throw std::runtime_error("the owner's own failure");
  } catch (const std::runtime_error&) {
  }
  CHECK(hold.take() == nullptr);
}

TEST_CASE("watchdog: a timeout is reported before the abort, which may block") {
  std::atomic<bool> released{false};
  dtrain::watchdog dog;
  dog.watch(dtrain::work(std::make_shared<abort_blocks_work>(released)));
  // Were the failure kept only after the abort, drain() would never return.
  const std::exception_ptr failure = dog.drain();
  REQUIRE(failure != nullptr);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(failure), doctest::Contains("did not finish within"),
                       dtrain::timeout_error);
  CHECK(dog.failure() == failure);
  released = true;  // the abort ends; the destructor joins
}
