// The store under bad input, dead peers, early workers and many connections.
#include "store_support.hpp"

#include <atomic>
#include <optional>

#include <sys/resource.h>

using dtrain::store_client;
using dtrain::store_options;
using dtrain::store_server;
using dtrain_test::hello;
using dtrain_test::raw_socket;
using namespace std::chrono_literals;
namespace wire = dtrain::detail::wire;

namespace {

std::string request(wire::op o, const std::function<void(wire::writer&)>& fields = {}) {
  std::string body(1, static_cast<char>(o));
  wire::writer w(body);
  if (fields) fields(w);
  return wire::frame(body);
}

/// After each bad client, a well-behaved one is still served.
void still_serves(int port, const store_options& options) {
  store_client good("127.0.0.1", port, options);
  good.set("alive", "yes");
  CHECK(good.get("alive") == "yes");
}

}  // namespace

TEST_CASE("store faults: bad clients are cut off with a logged reason, others are still served") {
  dtrain_test::log_capture logs;
  store_options options{.timeout = 20s, .io_timeout = 300ms, .token = "s3cret", .log = logs.sink()};
  store_server server("127.0.0.1", 0, options);
  const int port = server.port();

  SUBCASE("wrong token: the client is told, the server logs it") {
    try {
      store_client intruder("127.0.0.1", port, {.timeout = 5s, .token = "guess"});
      FAIL("a client with the wrong token was served");
    } catch (const dtrain::rendezvous_error& e) {
      CHECK_CONTAINS(e.what(), "rejected this client's token");
    }
    CHECK_CONTAINS(logs.wait_for("wrong token"), "closed connection from 127.0.0.1:");
    raw_socket no_token(port);
    no_token.send(hello(""));
    auto reply = no_token.receive(3);
    REQUIRE(reply.size() == 3);
    CHECK(reply[0] == static_cast<char>(wire::status::bad_token));
    CHECK(no_token.closed_by_server());
  }
  SUBCASE("wrong magic: an HTTP request gets nothing") {
    raw_socket http(port);
    http.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(http.closed_by_server());
    CHECK_CONTAINS(logs.wait_for("bad magic"), "not a dtrain store client");
  }
  SUBCASE("another protocol version") {
    raw_socket old(port);
    old.send(hello("s3cret", 99));
    auto reply = old.receive(3);
    REQUIRE(reply.size() == 3);
    CHECK(reply[0] == static_cast<char>(wire::status::bad_version));
    CHECK(old.closed_by_server());
    CHECK_CONTAINS(logs.wait_for("protocol version 99"),
                   "this server " + std::to_string(wire::version));
  }
  SUBCASE("garbage after the handshake: an unknown operation") {
    raw_socket garbage(port);
    garbage.handshake("s3cret");
    garbage.send(wire::frame(std::string("\xff\x01\x02\x03", 4)));
    CHECK(garbage.closed_by_server());
    CHECK(!logs.wait_for("unknown operation 255").empty());
  }
  SUBCASE("a frame declaring 4 GiB is refused before anything is buffered") {
    raw_socket huge(port);
    huge.handshake("s3cret");
    huge.send(std::string("\xff\xff\xff\xff", 4));
    CHECK(huge.closed_by_server());
    CHECK(!logs.wait_for("request frame of 4294967295 bytes exceeds the limit").empty());
  }
  SUBCASE("a value declaring 4 GiB inside a small frame") {
    raw_socket liar(port);
    liar.handshake("s3cret");
    liar.send(request(wire::op::set, [](wire::writer& w) { w.bytes32("k").u32(0xffffffffu); }));
    CHECK(liar.closed_by_server());
    CHECK(!logs.wait_for("value of 4294967295 bytes exceeds the limit").empty());
  }
  SUBCASE("a truncated request, then the client hangs up") {
    raw_socket cut(port);
    cut.handshake("s3cret");
    cut.send(
        std::string("\x64\x00\x00\x00"
                    "0123456789",
                    14));  // declares 100 bytes, sends 10
    cut.close();
    CHECK(!logs.wait_for("request body cut short").empty());
  }
  SUBCASE("a connection that never speaks is closed after the io timeout") {
    raw_socket silent(port);
    CHECK(silent.closed_by_server());
    CHECK(!logs.wait_for("handshake not complete within 300 ms").empty());
  }
  SUBCASE("a request that stalls halfway is closed after the io timeout") {
    raw_socket stall(port);
    stall.handshake("s3cret");
    stall.send(std::string("\x10\x00", 2));
    CHECK(stall.closed_by_server());
    CHECK(!logs.wait_for("request length not complete").empty());
  }
  still_serves(port, {.timeout = 20s, .token = "s3cret"});
  CHECK(server.stats().closed_for_cause >= 1);
}

TEST_CASE("store faults: a client that disconnects while waiting is cleaned up") {
  dtrain_test::log_capture logs;
  store_server server("127.0.0.1", 0, {.timeout = 20s, .log = logs.sink()});
  raw_socket waiter(server.port());
  waiter.handshake();
  waiter.send(request(wire::op::get, [](wire::writer& w) { w.bytes32("never").u64(60'000); }));
  REQUIRE(dtrain_test::eventually([&] { return server.stats().waiting == 1; }));
  SUBCASE("it closes its end (a rank that exits while its diagnostics wait): quietly") {
    waiter.close();
    CHECK(dtrain_test::eventually(
        [&] { return server.stats().waiting == 0 && server.stats().connections == 0; }));
    CHECK(logs.all().find("disconnected") == std::string::npos);
  }
  SUBCASE("its connection breaks (a reset): the log says who and what it waited for") {
    waiter.reset();
    CHECK(dtrain_test::eventually(
        [&] { return server.stats().waiting == 0 && server.stats().connections == 0; }));
    CHECK_CONTAINS(logs.wait_for("disconnected while waiting"), "\"never\"");
    CHECK_CONTAINS(logs.all(), "client 127.0.0.1:");
  }
  store_client c("127.0.0.1", server.port(), {.timeout = 20s});
  c.set("never", "now");  // nobody left to wake: must not touch the dead waiter
  CHECK(c.get("never") == "now");
}

TEST_CASE("store faults: stop() wakes every waiter with an error") {
  store_server server("127.0.0.1", 0, {.timeout = 20s, .log = [](std::string_view) {}});
  std::vector<std::thread> waiters;
  std::atomic<int> told{0};
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      store_client c("127.0.0.1", server.port(), {.timeout = 20s});
      try {
        (void)c.get("never");
      } catch (const dtrain::rendezvous_error& e) {
        if (std::string(e.what()).find("shutting down") != std::string::npos) ++told;
      }
    });
  }
  REQUIRE(dtrain_test::eventually([&] { return server.stats().waiting == 3; }));
  server.stop();
  for (auto& t : waiters) t.join();
  CHECK(told == 3);
  CHECK_THROWS_AS(store_client("127.0.0.1", server.port(), {.timeout = 200ms}),
                  dtrain::timeout_error);
}

TEST_CASE("store faults: the server process killed mid-wait makes the client fail, not hang") {
  auto server = dtrain_test::spawn({dtrain_test::store_peer(), "serve"}, true);
  int port = std::stoi(server.read_line());
  store_client c("127.0.0.1", port, {.timeout = 60s});
  c.set("k", "v");
  std::string error;
  std::thread waiter([&] {
    try {
      (void)c.get("never");  // would wait 60 s
    } catch (const dtrain::timeout_error& e) {
      error = std::string("timeout_error: ") + e.what();
    } catch (const dtrain::rendezvous_error& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  ::kill(server.pid, SIGKILL);
  CHECK(server.wait() == 128 + SIGKILL);
  waiter.join();
  CHECK_CONTAINS(error, "get(\"never\"): lost the connection to the store at 127.0.0.1:" +
                            std::to_string(port));
  CHECK_THROWS_WITH_AS(c.ping(), doctest::Contains("was lost earlier"), dtrain::rendezvous_error);
}

TEST_CASE(
    "store faults: a client whose server ended fails at once, and never joins its successor") {
  // A closed connection is reopened only where the same server still
  // listens (it closed the connection as idle): io_timeout is long, so a
  // client that knocked again until then would show in the message.
  const store_options options{.timeout = 20s, .io_timeout = 60s, .log = [](std::string_view) {}};
  std::optional<store_server> server(std::in_place, "127.0.0.1", 0, options);
  const int port = server->port();
  store_client c("127.0.0.1", port, options);
  c.set("k", "v");
  const std::uint64_t first = c.instance();
  CHECK(first != 0);
  SUBCASE("nothing listens any more") {
    server.reset();
    std::string error;
    try {
      c.ping();
    } catch (const dtrain::rendezvous_error& e) {
      error = e.what();
    }
    CHECK_CONTAINS(error, "nothing listens at 127.0.0.1:" + std::to_string(port) + " any more");
  }
  SUBCASE("a new server at the same address: another instance, without the old keys") {
    server.reset();
    server.emplace("127.0.0.1", port, options);
    store_client fresh("127.0.0.1", port, options);
    CHECK(fresh.instance() != first);
    CHECK_FALSE(fresh.check(std::vector<std::string>{"k"}));
    CHECK_THROWS_WITH_AS(c.ping(),
                         doctest::Contains("is no longer the one this client joined: its server "
                                           "was restarted"),
                         dtrain::rendezvous_error);
    CHECK_THROWS_WITH_AS(c.ping(), doctest::Contains("was lost earlier"), dtrain::rendezvous_error);
  }
}

TEST_CASE("store faults: workers started before the server connect once it appears") {
  int port = 0;
  {
    store_server probe("127.0.0.1", 0);  // find a free port, then free it
    port = probe.port();
  }
  std::vector<std::thread> workers;
  std::atomic<int> done{0};
  for (int i = 0; i < 3; ++i) {
    workers.emplace_back([&] {
      store_client c("127.0.0.1", port, {.timeout = 30s});
      c.barrier("early", 3);
      ++done;
    });
  }
  std::this_thread::sleep_for(300ms);
  store_server server("127.0.0.1", port, {.timeout = 30s});
  for (auto& t : workers) t.join();
  CHECK(done == 3);
  CHECK_THROWS_WITH_AS(
      store_client("127.0.0.1", port + (port == 65535 ? -1 : 1), {.timeout = 100ms}),
      doctest::Contains("could not reach the store at 127.0.0.1:"), dtrain::timeout_error);
}

TEST_CASE("store: a barrier of 1,000+ concurrent connections") {
  rlimit files{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &files) == 0);
  rlimit raised = files;
  raised.rlim_cur = std::min<rlim_t>(files.rlim_max, 8192);
  ::setrlimit(RLIMIT_NOFILE, &raised);
  ::getrlimit(RLIMIT_NOFILE, &raised);
  // Each client needs two descriptors here (its socket and the server's end).
  int clients = static_cast<int>(std::min<rlim_t>(1024, (raised.rlim_cur - 64) / 2));
  if (clients < 1000) MESSAGE("the descriptor limit allows only " << clients << " clients");
  store_server server("127.0.0.1", 0, {.timeout = 60s});
  std::vector<std::thread> threads;
  std::atomic<int> passed{0};
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&] {
      store_client c("127.0.0.1", server.port(), {.timeout = 60s});
      c.barrier("crowd", clients);
      ++passed;
    });
  }
  for (auto& t : threads) t.join();
  CHECK(passed == clients);
  CHECK(clients >= 1000);
  ::setrlimit(RLIMIT_NOFILE, &files);
}
