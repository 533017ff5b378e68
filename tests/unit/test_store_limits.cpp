// The store's resource caps: connections, stored bytes, bytes in flight,
// idle connections, and a log that summarises floods.
#include "store_support.hpp"

#include <atomic>
#include <memory>
#include <vector>

using dtrain::store_client;
using dtrain::store_options;
using dtrain::store_server;
using dtrain_test::raw_socket;
using namespace std::chrono_literals;
namespace wire = dtrain::detail::wire;

namespace {

std::string set_request(std::string_view key, std::string_view value) {
  std::string body(1, static_cast<char>(wire::op::set));
  wire::writer(body).bytes32(key).bytes32(value);
  return wire::frame(body);
}

std::string get_request(std::string_view key) {
  std::string body(1, static_cast<char>(wire::op::get));
  wire::writer(body).bytes32(key).u64(60'000);
  return wire::frame(body);
}

}  // namespace

TEST_CASE("store limits: an idle connection is closed, and its client reopens it by itself") {
  dtrain_test::log_capture logs;
  store_options options{.timeout = 20s, .idle_timeout = 300ms, .token = "t", .log = logs.sink()};
  store_server server("127.0.0.1", 0, options);
  store_client client("127.0.0.1", server.port(), options);
  client.set("k", "1");
  REQUIRE(dtrain_test::eventually([&] { return server.stats().closed_idle == 1; }));
  CHECK(server.stats().connections == 0);
  CHECK(client.add("k", 1) == 2);  // reopened: the request is not lost, nor run twice
  CHECK(client.get("k") == "2");
  CHECK(logs.all().find("idle") == std::string::npos);  // routine: not logged line by line
}

TEST_CASE("store limits: a wait the client asked for is not idle") {
  store_options options{.timeout = 20s, .idle_timeout = 200ms, .token = "t"};
  store_server server("127.0.0.1", 0, options);
  store_client waiter("127.0.0.1", server.port(), options);
  std::thread setter([&] {
    std::this_thread::sleep_for(800ms);
    store_client("127.0.0.1", server.port(), options).set("late", "v");
  });
  CHECK(waiter.get("late", 10s) == "v");  // the server closing it as idle would lose the wait
  setter.join();
}

TEST_CASE(
    "store limits: over the connection cap, strangers make room and the job's clients get in") {
  dtrain_test::log_capture logs;
  store_options options{.timeout = 20s, .token = "t", .log = logs.sink()};
  options.limits.max_connections = 8;
  store_server server("127.0.0.1", 0, options);
  const int port = server.port();

  std::vector<std::unique_ptr<raw_socket>> strangers;  // connected, no handshake
  for (int i = 0; i < 8; ++i) strangers.push_back(std::make_unique<raw_socket>(port));
  REQUIRE(dtrain_test::eventually([&] { return server.stats().connections == 8; }));
  store_client good("127.0.0.1", port, options);  // evicts the oldest stranger
  good.set("in", "yes");
  CHECK(strangers.front()->closed_by_server());
  CHECK(server.stats().connections <= 8);

  // Every slot held by a client that proved its token: newcomers are refused and told so.
  strangers.clear();
  REQUIRE(dtrain_test::eventually([&] { return server.stats().connections == 1; }));
  std::vector<std::unique_ptr<raw_socket>> members;
  for (int i = 0; i < 7; ++i) {
    members.push_back(std::make_unique<raw_socket>(port));
    members.back()->handshake("t");
  }
  raw_socket late(port);
  CHECK(late.closed_by_server());
  CHECK_CONTAINS(logs.wait_for("refused a connection from"), "DTRAIN_STORE_MAX_CONNECTIONS");
  CHECK(server.stats().refused >= 1);
  try {
    store_client patient("127.0.0.1", port, {.timeout = 1s, .token = "t"});
    FAIL("a client got in over the cap");
  } catch (const dtrain::timeout_error& e) {
    CHECK_CONTAINS(e.what(), "could not reach the store");
  }
  members.pop_back();  // a slot frees: the next client is served
  store_client next("127.0.0.1", port, options);
  CHECK(next.get("in") == "yes");
}

TEST_CASE(
    "store limits: stored bytes are capped, a set past the cap is refused and changes nothing") {
  store_options options{.timeout = 20s, .token = "t"};
  options.limits.max_stored_bytes = 1000;
  store_server server("127.0.0.1", 0, options);
  store_client client("127.0.0.1", server.port(), options);
  client.set("a", std::string(600, 'x'));
  try {
    client.set("b", std::string(600, 'y'));
    FAIL("the store took more than its cap");
  } catch (const dtrain::rendezvous_error& e) {
    CHECK_CONTAINS(e.what(), "DTRAIN_STORE_MAX_BYTES");
    CHECK_CONTAINS(e.what(), "set(\"b\") of 600 bytes");
  }
  std::string keys[] = {"b"};
  CHECK(!client.check(keys));
  client.set("a", "small");  // shrinking is always allowed
  client.set("b", std::string(600, 'y'));
  CHECK(client.erase("a"));
  CHECK(server.stats().stored_bytes == 601);
}

TEST_CASE("store limits: bytes in flight are capped across connections") {
  dtrain_test::log_capture logs;
  store_options options{.timeout = 20s, .io_timeout = 10s, .token = "t", .log = logs.sink()};
  options.limits.max_buffered_bytes = 1 << 20;
  store_server server("127.0.0.1", 0, options);
  const int port = server.port();

  SUBCASE("a frame larger than the whole budget is refused before it is read") {
    raw_socket big(port);
    big.handshake("t");
    big.send(std::string("\x00\x00\x20\x00", 4));  // 2 MiB
    CHECK(big.closed_by_server());
    CHECK_CONTAINS(logs.wait_for("buffer cap"), "max_buffered_bytes");
  }
  SUBCASE("a stalled frame holds its share; others wait for it, then go on") {
    raw_socket hog(port);
    hog.handshake("t");
    const std::string frame = set_request("hog", std::string(900'000, 'h'));
    hog.send(std::string_view(frame).substr(0, frame.size() / 2));  // all but half: it stalls
    REQUIRE(dtrain_test::eventually([&] { return server.stats().buffered_bytes > 900'000; }));
    store_client other("127.0.0.1", port, options);
    std::atomic<bool> done{false};
    std::thread setter([&] {
      other.set("other", std::string(500'000, 'o'));  // must wait for the hog's bytes
      done = true;
    });
    std::this_thread::sleep_for(300ms);
    CHECK(!done);
    CHECK(server.stats().buffered_bytes <= (1u << 20));
    hog.close();  // its half frame is dropped and its share given back
    setter.join();
    CHECK(other.get("other").size() == 500'000);
    CHECK(!logs.wait_for("request body cut short").empty());
  }
}

TEST_CASE("store limits: a flood of bad connections is logged as a summary, not line by line") {
  dtrain_test::log_capture logs;
  store_server server("127.0.0.1", 0, {.timeout = 20s, .token = "t", .log = logs.sink()});
  for (int i = 0; i < 40; ++i) {
    raw_socket http(server.port());
    http.send("GET / HTTP/1.1\r\n\r\n");
    CHECK(http.closed_by_server());
  }
  REQUIRE(dtrain_test::eventually([&] { return server.stats().closed_for_cause == 40; }));
  std::size_t lines = 0;
  for (std::size_t at = 0; (at = logs.all().find("bad magic", at)) != std::string::npos; ++at)
    ++lines;
  CHECK(lines == dtrain::detail::rejection_log::detailed_per_period);

  dtrain::detail::rejection_log log;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) (void)log.note(dtrain::detail::rejection::handshake);
  for (int i = 0; i < 20; ++i) (void)log.note(dtrain::detail::rejection::over_connection_cap);
  CHECK(!log.summary(start));  // not before the period is over
  auto line = log.summary(start + 11s);
  REQUIRE(line);
  CHECK_CONTAINS(*line, "refused or closed 1020 connections");
  CHECK_CONTAINS(*line, "20 over the connection cap, 1000 failed handshake");
  CHECK(!log.summary(start + 22s));  // a quiet period says nothing
}

TEST_CASE("store limits: connections that break while waiting are logged a few in full, not each") {
  dtrain_test::log_capture logs;
  store_server server("127.0.0.1", 0, {.timeout = 20s, .token = "t", .log = logs.sink()});
  for (int i = 0; i < 12; ++i) {
    raw_socket waiter(server.port());
    waiter.handshake("t");
    waiter.send(get_request("never"));
    REQUIRE(dtrain_test::eventually([&] { return server.stats().waiting == 1; }));
    waiter.reset();
    REQUIRE(dtrain_test::eventually([&] { return server.stats().connections == 0; }));
  }
  std::size_t lines = 0;
  const std::string all = logs.all();
  for (std::size_t at = 0; (at = all.find("disconnected while waiting", at)) != std::string::npos;
       ++at)
    ++lines;
  CHECK(lines == dtrain::detail::rejection_log::detailed_per_period);
  CHECK(server.stats().closed_for_cause == 0);  // the client broke it: not the server's verdict
}
