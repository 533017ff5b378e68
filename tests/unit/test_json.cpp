#include "support.hpp"

namespace json = dtrain::detail::json;
using dtrain_test::config_error_text;

namespace {
std::string parse_error(std::string_view text) {
  return config_error_text([&] { (void)json::parse(text, "TF_CONFIG"); });
}
}  // namespace

TEST_CASE("json: objects, arrays, nesting and whitespace in any key order") {
  auto v = json::parse(
      " {\n\t\"task\" : {\"index\": 3, \"type\":\"worker\"},\r\n \"cluster\": {\"worker\": "
      "[\"a:1\", \"b:2\"], \"ps\": []} } ",
      "TF_CONFIG");
  REQUIRE(v.is(json::value::kind::object));
  REQUIRE(v.members.size() == 2);
  CHECK(v.members[0].key == "task");
  const auto* task = v.find("task");
  REQUIRE(task != nullptr);
  CHECK(task->find("index")->text == "3");
  CHECK(task->find("type")->text == "worker");
  const auto* workers = v.find("cluster")->find("worker");
  REQUIRE(workers->items.size() == 2);
  CHECK(workers->items[1].text == "b:2");
  CHECK(v.find("cluster")->find("ps")->items.empty());
  CHECK(v.find("missing") == nullptr);
}

TEST_CASE("json: literals and numbers keep their form") {
  auto v = json::parse(R"([true, false, null, 0, -12, 3.25, 1e9, -0.5E-3])", "x");
  REQUIRE(v.items.size() == 8);
  CHECK(v.items[0].boolean);
  CHECK_FALSE(v.items[1].boolean);
  CHECK(v.items[2].is(json::value::kind::null));
  CHECK(v.items[4].text == "-12");
  CHECK(v.items[5].text == "3.25");
  CHECK(v.items[7].text == "-0.5E-3");
}

TEST_CASE("json: string escapes, including \\u and surrogate pairs, become UTF-8") {
  auto v = json::parse(R"("a\"b\\c\/d\b\f\n\r\t\u0041\u00e9\u20ac\ud83d\ude00")", "x");
  CHECK(v.text == "a\"b\\c/d\b\f\n\r\tA\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
}

TEST_CASE("json: malformed input is an error that quotes the input's name and position") {
  auto e = parse_error(R"({"task": {"type": "worker" "index": 1}})");
  CHECK_CONTAINS(e, "TF_CONFIG is not valid JSON");
  CHECK_CONTAINS(e, "expected ',' or '}'");
  CHECK_CONTAINS(e, "offset 27");
  CHECK_CONTAINS(e, "line 1, column 28");

  auto multi = parse_error("{\n  \"a\": 1,\n  \"b\": tru\n}");
  CHECK_CONTAINS(multi, "expected 'true'");
  CHECK_CONTAINS(multi, "line 3, column 8");

  CHECK_CONTAINS(parse_error(""), "expected a value");
  CHECK_CONTAINS(parse_error("{\"a\":1} x"), "unexpected text after the JSON value");
  CHECK_CONTAINS(parse_error("{\"a\":1,}"), "expected a string key");
  CHECK_CONTAINS(parse_error("[1,]"), "expected a value");
  CHECK_CONTAINS(parse_error("{'a':1}"), "expected a string key");
  CHECK_CONTAINS(parse_error("\"abc"), "unterminated string");
  CHECK_CONTAINS(parse_error("\"a\nb\""), "unescaped control character");
  CHECK_CONTAINS(parse_error(R"("\x")"), "invalid escape '\\x'");
  CHECK_CONTAINS(parse_error(R"("\u12")"), "four hex digits");
  CHECK_CONTAINS(parse_error(R"("\ud83d")"), "high surrogate");
  CHECK_CONTAINS(parse_error(R"("\ude00")"), "low surrogate");
  CHECK_CONTAINS(parse_error("012"), "leading zeros");
  CHECK_CONTAINS(parse_error("1."), "digit after '.'");
  CHECK_CONTAINS(parse_error("-"), "expected a digit");
  CHECK_CONTAINS(parse_error("1e"), "exponent");
  CHECK_CONTAINS(parse_error(R"({"a":1,"a":2})"), "duplicate key \"a\"");
  CHECK_CONTAINS(parse_error("{\"a\" 1}"), "expected ':'");
  CHECK_CONTAINS(parse_error("[1 2]"), "expected ',' or ']'");
}

TEST_CASE("json: nesting is bounded instead of overflowing the stack") {
  std::string deep(100000, '[');
  CHECK_CONTAINS(parse_error(deep), "nesting deeper than 64");
  std::string ok = std::string(60, '[') + std::string(60, ']');
  CHECK_NOTHROW((void)json::parse(ok, "x"));
}
