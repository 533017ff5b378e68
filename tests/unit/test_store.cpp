// The rendezvous store's operations, from threads and from processes.
#include "../peers/store_workload.hpp"
#include "store_support.hpp"

#include <atomic>
#include <csignal>
#include <optional>
#include <set>
#include <span>
#include <thread>

using dtrain::store_client;
using dtrain::store_options;
using dtrain::store_server;
using namespace std::chrono_literals;
using dtrain_test::config_error_text;

namespace {
const store_options quick{.timeout = 20s};
}

TEST_CASE("store: every operation, with its results") {
  store_server server("127.0.0.1", 0, quick);
  REQUIRE(server.port() > 0);
  store_client s("127.0.0.1", server.port(), quick);

  s.set("a", "1");
  CHECK(s.get("a") == "1");
  s.set("a", std::string("bin\0ary", 7));
  CHECK(s.get("a") == std::string("bin\0ary", 7));
  s.set("empty", "");
  CHECK(s.get("empty").empty());

  CHECK(s.add("counter", 5) == 5);
  CHECK(s.add("counter", -7) == -2);
  CHECK(s.get("counter") == "-2");
  CHECK(s.add("counter", 0) == -2);

  // compare_set: a missing key matches an empty expected value.
  CHECK(s.compare_set("cas", "x", "y").empty());
  CHECK_FALSE(s.check(std::vector<std::string>{"cas"}));
  CHECK(s.compare_set("cas", "", "first") == "first");
  CHECK(s.compare_set("cas", "wrong", "second") == "first");
  CHECK(s.compare_set("cas", "first", "second") == "second");

  CHECK(s.check(std::vector<std::string>{"a", "counter"}));
  CHECK_FALSE(s.check(std::vector<std::string>{"a", "nope"}));
  CHECK(s.check(std::vector<std::string>{}));
  s.wait(std::vector<std::string>{"a", "counter"}, 1s);

  CHECK(s.num_keys() == 4);
  CHECK(s.erase("a"));
  CHECK_FALSE(s.erase("a"));
  CHECK(s.num_keys() == 3);
  s.ping();
}

TEST_CASE(
    "store: get waits for the key, a timeout names the key and the time and keeps the client "
    "usable") {
  store_server server("127.0.0.1", 0, quick);
  store_client waiter("127.0.0.1", server.port(), quick);
  store_client setter("127.0.0.1", server.port(), quick);
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    setter.set("late", "here");
  });
  CHECK(waiter.get("late") == "here");
  t.join();

  try {
    (void)waiter.get("never", 100ms);
    FAIL("get of a missing key returned");
  } catch (const dtrain::timeout_error& e) {
    CHECK(std::string(e.what()) ==
          "get(\"never\") on the store at 127.0.0.1:" + std::to_string(server.port()) +
              " waited 0.1 s and the key was never set");
  }
  try {
    waiter.wait(std::vector<std::string>{"late", "never"}, 100ms);
    FAIL("wait for a missing key returned");
  } catch (const dtrain::timeout_error& e) {
    CHECK_CONTAINS(e.what(), "wait(\"late\", \"never\")");
  }
  CHECK(waiter.get("late") == "here");  // a server-side timeout leaves the connection sound
}

TEST_CASE("store: refused requests are errors with the server's reason") {
  store_server server("127.0.0.1", 0, quick);
  store_client s("127.0.0.1", server.port(), quick);
  s.set("text", "not a number");
  try {
    s.add("text", 1);
    FAIL("add on text succeeded");
  } catch (const dtrain::rendezvous_error& e) {
    CHECK_CONTAINS(e.what(), "add(\"text\"): the key holds a value that is not an integer");
  }
  s.set("big", "9223372036854775807");
  CHECK_THROWS_AS(s.add("big", 1), dtrain::rendezvous_error);
  CHECK(s.get("big") == "9223372036854775807");
}

TEST_CASE(
    "store: barrier, reused by name across generations, and its timeout says who is missing") {
  store_server server("127.0.0.1", 0, quick);
  constexpr int n = 6;
  std::vector<std::thread> threads;
  std::atomic<int> passed{0};
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&] {
      store_client c("127.0.0.1", server.port(), quick);
      for (int round = 0; round < 3; ++round) {
        c.barrier("sync", n);
        ++passed;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(passed == 3 * n);

  store_client lonely("127.0.0.1", server.port(), quick);
  try {
    lonely.barrier("pair", 2, 100ms);
    FAIL("a barrier of 2 passed with 1");
  } catch (const dtrain::timeout_error& e) {
    CHECK_CONTAINS(e.what(), "barrier(\"pair\")");
    CHECK_CONTAINS(e.what(), "1 of 2 arrived");
  }
  CHECK(config_error_text([&] { lonely.barrier("zero", 0); }) ==
        "barrier(\"zero\") count 0 must be at least 1");
}

TEST_CASE("store: every operation from many threads at once, each with its own client") {
  store_server server("127.0.0.1", 0, quick);
  constexpr int world = 8;
  std::vector<std::string> failures(world);
  std::vector<std::thread> pool;
  for (int r = 0; r < world; ++r) {
    pool.emplace_back([&, r] {
      store_client c("127.0.0.1", server.port(), quick);
      dtrain::prefix_store job(c, "job");
      failures[static_cast<std::size_t>(r)] = dtrain_test::store_workload(job, r, world);
      for (int i = 0; i < 200; ++i) c.add("total", 1);
    });
  }
  for (auto& t : pool) t.join();
  for (int r = 0; r < world; ++r)
    CHECK_MESSAGE(failures[static_cast<std::size_t>(r)].empty(),
                  "rank " << r << ": " << failures[static_cast<std::size_t>(r)]);
  store_client c("127.0.0.1", server.port(), quick);
  CHECK(c.get("total") == std::to_string(world * 200));
  dtrain::prefix_store job(c, "job");
  CHECK(job.get("arrived") == std::to_string(world));
  std::set<std::string> leaders;
  for (int r = 0; r < world; ++r) leaders.insert(job.get("saw/" + std::to_string(r)));
  CHECK(leaders.size() == 1);
}

TEST_CASE("store: every operation from ranks in separate processes") {
  store_server server("127.0.0.1", 0, quick);
  constexpr int world = 4;
  std::vector<dtrain_test::child> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(
        dtrain_test::spawn({dtrain_test::store_peer(), "work", std::to_string(server.port()),
                            std::to_string(r), std::to_string(world)}));
  }
  for (auto& r : ranks) CHECK(r.wait() == 0);
  store_client c("127.0.0.1", server.port(), quick);
  dtrain::prefix_store job(c, "job");
  CHECK(job.get("arrived") == std::to_string(world));
  std::set<std::string> leaders;
  for (int r = 0; r < world; ++r) leaders.insert(job.get("saw/" + std::to_string(r)));
  REQUIRE(leaders.size() == 1);
  CHECK(std::stoi(*leaders.begin()) < world);
}

namespace {
// Polls (bounded) until `key`'s presence is `present`; the server drops a
// closed connection's leases on its own thread, a moment after the close.
bool becomes(store_client& c, const std::string& key, bool present) {
  for (int i = 0; i < 1000; ++i) {
    if (c.check(std::span<const std::string>(&key, 1)) == present) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}
}  // namespace

TEST_CASE("store: a leased key lives as long as its client's connection, however that ends") {
  store_server server("127.0.0.1", 0, quick);
  store_client watcher("127.0.0.1", server.port(), quick);
  {
    store_client holder("127.0.0.1", server.port(), quick);
    holder.lease("alive/0", "agent 0");
    CHECK(watcher.get("alive/0") == "agent 0");
    holder.lease("alive/0", "agent 0, again");  // the same key: leased once, its value changed
    CHECK(watcher.get("alive/0") == "agent 0, again");
    CHECK(holder.add("plain", 1) == 1);
  }
  CHECK(becomes(watcher, "alive/0", false));
  CHECK(watcher.get("plain") == "1");  // a key set the ordinary way stays

  // A process killed with SIGKILL: its kernel closes the connection.
  dtrain_test::child peer = dtrain_test::spawn(
      {dtrain_test::store_peer(), "lease", std::to_string(server.port()), "alive/1"}, true);
  REQUIRE(peer.read_line() == "leased");
  CHECK(watcher.get("alive/1") == "held");
  ::kill(peer.pid, SIGKILL);
  CHECK(peer.wait() == 128 + SIGKILL);
  CHECK(becomes(watcher, "alive/1", false));

  // A key another client set to its own value since is not the lease's any more.
  {
    store_client holder("127.0.0.1", server.port(), quick);
    holder.lease("alive/2", "old agent");
    watcher.set("alive/2", "new agent");
  }
  store_client probe("127.0.0.1", server.port(), quick);  // a connection after the close
  probe.ping();
  std::this_thread::sleep_for(100ms);
  CHECK(watcher.get("alive/2") == "new agent");
}

TEST_CASE("store: a connection holds a bounded number of small leases, and the refusal says so") {
  store_server server("127.0.0.1", 0, quick);
  store_client c("127.0.0.1", server.port(), quick);
  for (std::size_t i = 0; i < dtrain::detail::wire::max_leases_per_connection; ++i) {
    c.lease("lease/" + std::to_string(i), "x");
  }
  try {
    c.lease("one/too/many", "x");
    FAIL("a lease beyond the bound succeeded");
  } catch (const dtrain::rendezvous_error& e) {
    CHECK_CONTAINS(e.what(), "lease(\"one/too/many\"): this connection holds 4 leased keys");
  }
  CHECK_FALSE(c.check(std::vector<std::string>{"one/too/many"}));
  try {
    c.lease("lease/0", std::string(dtrain::detail::wire::max_lease_value + 1, 'x'));
    FAIL("a lease of a large value succeeded");
  } catch (const dtrain::rendezvous_error& e) {
    CHECK_CONTAINS(e.what(), "a leased key holds at most 4096");
  }
  c.lease("lease/0", "y");  // one it holds: still allowed
  CHECK(c.get("lease/0") == "y");
}

TEST_CASE("store: a connection the server closed as idle is reopened with its leases") {
  store_server server("127.0.0.1", 0, {.timeout = 20s, .idle_timeout = 200ms});
  store_client watcher("127.0.0.1", server.port(), quick);
  store_client holder("127.0.0.1", server.port(), {.timeout = 20s});
  holder.lease("alive/0", "agent 0");
  CHECK(becomes(watcher, "alive/0", false));  // idle: closed, and the lease with it
  holder.ping();                              // reopens, leasing again
  CHECK(watcher.get("alive/0") == "agent 0");

  // A key another client took while the connection was closed is not taken
  // back (a node agent that replaced a frozen one), nor erased when the first
  // client ends. (The server closes idle connections after 200 ms: each step
  // below is quicker.)
  const std::vector<std::string> alive1{"alive/1"};
  std::optional<store_client> frozen(std::in_place, "127.0.0.1", server.port(),
                                     store_options{.timeout = 20s});
  frozen->lease("alive/1", "old agent");
  CHECK(becomes(watcher, "alive/1", false));  // idle: closed
  store_client replacement("127.0.0.1", server.port(), quick);
  replacement.lease("alive/1", "new agent");
  frozen->ping();  // reopens: alive/1 is not its lease any more
  CHECK(watcher.get("alive/1") == "new agent");
  frozen.reset();
  std::this_thread::sleep_for(50ms);  // the server has seen the close
  CHECK(watcher.check(alive1));
  CHECK(watcher.get("alive/1") == "new agent");
}

TEST_CASE("prefix_store: namespaces nest and do not see each other") {
  store_server server("127.0.0.1", 0, quick);
  store_client c("127.0.0.1", server.port(), quick);
  dtrain::prefix_store job(c, "job7");
  dtrain::prefix_store round(job, "restart2");
  round.set("id", "abc");
  CHECK(c.get("job7/restart2/id") == "abc");
  CHECK(job.get("restart2/id") == "abc");
  CHECK_FALSE(c.check(std::vector<std::string>{"id"}));
  CHECK(round.check(std::vector<std::string>{"id"}));
  CHECK(round.add("n", 2) == 2);
  CHECK(round.compare_set("id", "abc", "def") == "def");
  round.barrier("b", 1);
  CHECK(c.check(std::vector<std::string>{"job7/restart2/b/arrived"}));
  CHECK(round.erase("id"));
  CHECK(round.prefix() == "restart2/");
}

TEST_CASE("store options: defaults, and the environment wins with clear errors") {
  store_options defaults;
  CHECK(defaults.timeout == dtrain::default_store_timeout);
  CHECK(dtrain::default_store_timeout == 300s);
  auto tuned = defaults.with_env({{"DTRAIN_STORE_TIMEOUT", "2.5"},
                                  {"DTRAIN_STORE_IO_TIMEOUT", "7"},
                                  {"DTRAIN_STORE_TOKEN", "s3cret"}});
  CHECK(tuned.timeout == 2500ms);
  CHECK(tuned.io_timeout == 7000ms);
  CHECK(tuned.token == "s3cret");
  CHECK(config_error_text([] {
          (void)store_options{}.with_env({{"DTRAIN_STORE_TIMEOUT", "soon"}});
        }) == "DTRAIN_STORE_TIMEOUT=soon is not a positive number of seconds");
  CHECK(config_error_text([] {
          (void)store_options{}.with_env({{"DTRAIN_STORE_TIMEOUT", "-1"}});
        }) == "DTRAIN_STORE_TIMEOUT=-1 is not a positive number of seconds");
  CHECK_CONTAINS(config_error_text([] {
                   (void)store_options{}.with_env({{"DTRAIN_STORE_TOKEN", std::string(2000, 'x')}});
                 }),
                 "is 2000 bytes; the limit is 1024");
}

TEST_CASE("store server: a port in use is an error naming the address and port") {
  store_server first("127.0.0.1", 0, quick);
  try {
    store_server second("127.0.0.1", first.port(), quick);
    FAIL("two servers listened on one port");
  } catch (const dtrain::rendezvous_error& e) {
    CHECK_CONTAINS(e.what(), "cannot listen on 127.0.0.1:" + std::to_string(first.port()));
    CHECK_CONTAINS(e.what(), "Address already in use");
  }
  CHECK_THROWS_AS(store_server("no-such-host.invalid", 0, quick), dtrain::rendezvous_error);
}
