#include "support.hpp"

namespace d = dtrain::detail;
using dtrain_test::config_error_text;

TEST_CASE("parse: counts are strict non-negative decimal integers") {
  CHECK(d::parse_non_negative("RANK=0", "0") == 0);
  CHECK(d::parse_non_negative("RANK=17", "17") == 17);
  CHECK(d::parse_non_negative("RANK=007", "007") == 7);
  CHECK(d::parse_non_negative("X", "2147483647") == 2147483647);
  auto err = [](std::string_view text) {
    return config_error_text(
        [&] { (void)d::parse_non_negative(d::assignment("RANK", text), text); });
  };
  CHECK(err("abc") == "RANK=abc is not a non-negative integer");
  CHECK(err("-1") == "RANK=-1 is negative: ranks, sizes and indices count from 0");
  CHECK(err("1.5") == "RANK=1.5 is not a non-negative integer");
  CHECK(err("+3") == "RANK=+3 is not a non-negative integer");
  CHECK(err(" 3") == "RANK=\" 3\" is not a non-negative integer");
  CHECK(err("0x10") == "RANK=0x10 is not a non-negative integer");
  CHECK_CONTAINS(err("2147483648"), "RANK=2147483648 is too large");
}

TEST_CASE("parse: variables that are set but empty are errors, unset ones are not") {
  dtrain::environment env{{"RANK", ""}, {"MASTER_ADDR", ""}, {"HOST", "a b"}};
  CHECK(config_error_text([&] { (void)d::read_int(env, "RANK"); }) == "RANK is set but empty");
  CHECK(config_error_text([&] { (void)d::read_text(env, "MASTER_ADDR"); }) ==
        "MASTER_ADDR is set but empty");
  CHECK(config_error_text([&] { (void)d::read_text(env, "HOST"); }) ==
        "HOST=\"a b\" contains blanks");
  CHECK_FALSE(d::read_int(env, "WORLD_SIZE").has_value());
}

TEST_CASE("parse: ports are 1-65535") {
  dtrain::environment env{{"MASTER_PORT", "70000"}, {"P0", "0"}, {"OK", "65535"}};
  CHECK(config_error_text([&] { (void)d::read_port(env, "MASTER_PORT"); }) ==
        "MASTER_PORT=70000 is outside the port range 1-65535");
  CHECK_CONTAINS(config_error_text([&] { (void)d::read_port(env, "P0"); }), "P0=0 is outside");
  CHECK(d::read_port(env, "OK")->value == 65535);
}

TEST_CASE("parse: host:port, [v6]:port, a bare host and a bare IPv6 address") {
  auto hp = d::split_host_port("X", "10.0.0.4:6105");
  CHECK(hp.host == "10.0.0.4");
  CHECK(hp.port == 6105);
  hp = d::split_host_port("X", "[fe80::1]:29500");
  CHECK(hp.host == "fe80::1");
  CHECK(hp.port == 29500);
  hp = d::split_host_port("X", "node-7");
  CHECK(hp.host == "node-7");
  CHECK_FALSE(hp.port.has_value());
  hp = d::split_host_port("X", "fe80::1");
  CHECK(hp.host == "fe80::1");
  CHECK_FALSE(hp.port.has_value());
  CHECK_CONTAINS(config_error_text([] { (void)d::split_host_port("AZ=h:x", "h:x"); }),
                 "AZ=h:x (port 'x')");
  CHECK_CONTAINS(config_error_text([] { (void)d::split_host_port("AZ=:1", ":1"); }), "empty host");
  CHECK_CONTAINS(config_error_text([] { (void)d::split_host_port("AZ=[::1", "[::1"); }),
                 "unbalanced");
  CHECK_CONTAINS(config_error_text([] { (void)d::split_host_port("AZ=h:0", "h:0"); }),
                 "outside the port range");
}
