// The store's token and where it listens (rendezvous/security.hpp).
#include "store_support.hpp"

#include <optional>
#include <set>
#include <string>
#include <thread>

using dtrain::environment;
using namespace std::chrono_literals;

TEST_CASE("store security: a token is 128 random bits, fresh each time") {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    auto t = dtrain::detail::new_store_token();
    CHECK(t.size() == 32);
    CHECK(t.find_first_not_of("0123456789abcdef") == std::string::npos);
    seen.insert(t);
  }
  CHECK(seen.size() == 100);
}

TEST_CASE("store security: the store listens where MASTER_ADDR points, not everywhere") {
  const environment none;
  CHECK(dtrain::detail::store_bind_address(none, "127.0.0.1", false) == "127.0.0.1");
  CHECK(dtrain::detail::store_bind_address(none, "localhost", false).rfind("127.", 0) == 0);
  // A name that resolves to loopback here but names a host of a multi-node job
  // (Debian's 127.0.1.1 for the host's own name): every interface, or the others cannot come.
  CHECK(dtrain::detail::store_bind_address(none, "127.0.1.1", true) == "0.0.0.0");
  // An address that is not this host's: every interface (NAT, a load balancer).
  CHECK(dtrain::detail::store_bind_address(none, "192.0.2.7", true) == "0.0.0.0");
  // Asked for explicitly.
  const environment asked{{"DTRAIN_STORE_BIND", "0.0.0.0"}};
  CHECK(dtrain::detail::store_bind_address(asked, "127.0.0.1", false) == "0.0.0.0");
  CHECK(dtrain::detail::local_store_address("0.0.0.0") == "127.0.0.1");
  CHECK(dtrain::detail::local_store_address("10.1.2.3") == "10.1.2.3");
  // A store bound to loopback cannot be reached on another interface.
  for (const auto& a : dtrain::detail::interface_addresses()) {
    if (a.ipv6 || dtrain::detail::is_loopback_address(a.address)) continue;
    dtrain::store_server server(dtrain::detail::store_bind_address(none, "127.0.0.1", false), 0,
                                {.token = "t"});
    try {
      dtrain::store_client outside(a.address, server.port(),
                                   {.timeout = std::chrono::milliseconds(300), .token = "t"});
      FAIL("a store bound to loopback answered on " << a.address);
    } catch (const dtrain::error&) {
    }
    break;
  }
}

TEST_CASE("store security: a token shared through a private file") {
  char dir_template[] = "/tmp/dtrain-token-test.XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string runtime = dir_template;
  const environment env{{"XDG_RUNTIME_DIR", runtime}};
  {
    dtrain::detail::token_file writer(env, 4242);
    CHECK(writer.path() == runtime + "/dtrain/store-4242.token");
    const dtrain::detail::token_file reader(env, 4242);
    CHECK(!reader.read());
    writer.publish("first");
    CHECK(reader.read() == "first");
    writer.publish("second");  // a stale file is replaced
    CHECK(reader.read() == "second");
    struct stat st {};
    REQUIRE(::stat((runtime + "/dtrain").c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    REQUIRE(::stat(writer.path().c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
  }
  CHECK(::access((runtime + "/dtrain/store-4242.token").c_str(), F_OK) !=
        0);                                      // removed with its writer
  ::chmod((runtime + "/dtrain").c_str(), 0755);  // others could read it: refuse
  dtrain::detail::token_file open_dir(env, 1);
  CHECK_THROWS_WITH_AS(open_dir.publish("x"), doctest::Contains("only this user can open"),
                       dtrain::config_error);
  ::rmdir((runtime + "/dtrain").c_str());
  ::rmdir(runtime.c_str());
}

TEST_CASE("store security: a refused token is a token_error, and the token file is read again") {
  dtrain::store_server server("127.0.0.1", 0,
                              {.timeout = 20s, .token = "fresh", .log = [](std::string_view) {}});
  CHECK_THROWS_WITH_AS(
      dtrain::store_client("127.0.0.1", server.port(), {.timeout = 20s, .token = "stale"}),
      doctest::Contains("rejected this client's token"), dtrain::token_error);

  // A file left by an earlier job on the same port holds a stale token until
  // rank 0 replaces it: the reader knocks again on token_error only.
  char dir_template[] = "/tmp/dtrain-token-retry.XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string runtime = dir_template;
  const environment env{{"XDG_RUNTIME_DIR", runtime}};
  {
    dtrain::detail::token_file rank0(env, server.port());
    rank0.publish("stale");
    const dtrain::detail::token_file file(env, server.port());
    std::optional<dtrain::store_client> client;
    dtrain::store_options options{.timeout = 20s};
    std::string failure;
    const auto refused_before = server.stats().closed_for_cause;
    std::thread rank1([&] {
      try {
        dtrain::detail::connect_with_token_file(client, file, "127.0.0.1", server.port(), options,
                                                1);
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
    // Replace the file once the reader has been refused at least once.
    CHECK(
        dtrain_test::eventually([&] { return server.stats().closed_for_cause > refused_before; }));
    rank0.publish("fresh");
    rank1.join();
    CHECK(failure.empty());
    CHECK(options.token == "fresh");
    REQUIRE(client.has_value());
    client->set("k", "v");
  }
  ::rmdir((runtime + "/dtrain").c_str());
  ::rmdir(runtime.c_str());
}
