// The store's state on its own (rendezvous/kv_state.hpp): what each operation
// means, the stored-bytes cap and the waiters, with no socket and no server.
#include "support.hpp"

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

using dtrain::detail::kv_state;
using dtrain::detail::kv_waiter;
using dtrain::detail::store_refusal;

namespace {

/// The message of the store_refusal that `f` throws.
template <class F>
std::string refusal_text(F&& f) {
  try {
    f();
  } catch (const store_refusal& e) {
    return e.what();
  }
  FAIL("expected a store_refusal, but nothing was thrown");
  return {};
}

std::vector<std::string_view> keys(std::initializer_list<std::string_view> k) { return k; }

}  // namespace

TEST_CASE("kv_state: set, find, erase, and what they hold") {
  kv_state s(1 << 20);
  CHECK(s.find("a") == nullptr);
  s.set("a", "1");
  REQUIRE(s.find("a") != nullptr);
  CHECK(*s.find("a") == "1");
  s.set("a", std::string("bin\0ary", 7));
  CHECK(*s.find("a") == std::string("bin\0ary", 7));
  s.set("empty", "");
  REQUIRE(s.find("empty") != nullptr);
  CHECK(s.find("empty")->empty());
  CHECK(s.size() == 2);
  CHECK(s.stored_bytes() == 1 + 7 + 5);

  CHECK(s.check(keys({"a", "empty"})));
  CHECK_FALSE(s.check(keys({"a", "nope"})));
  CHECK(s.check(keys({})));
  CHECK(s.missing(keys({"x", "a", "y"})) == std::vector<std::string>{"x", "y"});

  CHECK(s.erase("a"));
  CHECK_FALSE(s.erase("a"));
  CHECK(s.find("a") == nullptr);
  CHECK(s.size() == 1);
  CHECK(s.stored_bytes() == 5);
}

TEST_CASE("kv_state: add counts in decimal text and refuses what is not a counter") {
  kv_state s(1 << 20);
  CHECK(s.add("counter", 5) == 5);
  CHECK(s.add("counter", -7) == -2);
  CHECK(*s.find("counter") == "-2");
  CHECK(s.add("counter", 0) == -2);

  s.set("text", "not a number");
  CHECK(refusal_text([&] { s.add("text", 1); }) ==
        "add(\"text\"): the key holds a value that is not an integer");
  s.set("partly", "12abc");
  CHECK(refusal_text([&] { s.add("partly", 1); }) ==
        "add(\"partly\"): the key holds a value that is not an integer");
  s.set("big", "9223372036854775807");
  CHECK(refusal_text([&] { s.add("big", 1); }) == "add(\"big\"): the counter would overflow");
  CHECK(*s.find("big") == "9223372036854775807");  // a refusal changes nothing
  CHECK(*s.find("text") == "not a number");
}

TEST_CASE("kv_state: compare_set, where a missing key matches an empty expected value") {
  kv_state s(1 << 20);
  CHECK(s.compare_set("cas", "x", "y").empty());
  CHECK(s.find("cas") == nullptr);
  CHECK(s.compare_set("cas", "", "first") == "first");
  CHECK(s.compare_set("cas", "wrong", "second") == "first");
  CHECK(s.compare_set("cas", "first", "second") == "second");
  CHECK(s.compare_set("cas", "", "third") == "second");  // empty matches only a missing key
  CHECK(s.compare_set("blank", "", "") == "");
  CHECK(s.find("blank") != nullptr);  // set to the empty value
}

TEST_CASE("kv_state: the stored-bytes cap refuses with the message the server sends") {
  kv_state s(1000);
  s.set("a", std::string(600, 'x'));
  CHECK(refusal_text([&] { s.set("b", std::string(600, 'y')); }) ==
        "set(\"b\") of 600 bytes: the store holds 601 bytes and its cap is 1000 "
        "(store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
  CHECK(s.find("b") == nullptr);
  CHECK(s.stored_bytes() == 601);

  // Replacing a value counts the difference: growing "a" past the cap is refused too.
  CHECK(refusal_text([&] { s.set("a", std::string(1000, 'x')); }) ==
        "set(\"a\") of 1000 bytes: the store holds 601 bytes and its cap is 1000 "
        "(store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
  CHECK(s.find("a")->size() == 600);
  s.set("a", std::string(999, 'x'));  // exactly at the cap: allowed
  CHECK(s.stored_bytes() == 1000);

  CHECK(refusal_text([&] { s.add("n", 1); }) ==
        "add(\"n\") of 20 bytes: the store holds 1000 bytes and its cap is 1000 "
        "(store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
  CHECK(refusal_text([&] { (void)s.compare_set("c", "", "v"); }) ==
        "compare_set(\"c\") of 1 bytes: the store holds 1000 bytes and its cap is 1000 "
        "(store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
  CHECK(s.compare_set("c", "other", "v").empty());  // no match, nothing stored: no refusal
  CHECK(s.size() == 1);

  s.set("a", "small");  // shrinking is always allowed
  s.set("b", std::string(600, 'y'));
  CHECK(s.erase("a"));
  CHECK(s.stored_bytes() == 601);

  // A long key is cut to 200 bytes in the message.
  kv_state tiny(10);
  const std::string long_key(5000, 'k');
  const std::string text = refusal_text([&] { tiny.set(long_key, "v"); });
  CHECK(text == "set(\"" + std::string(200, 'k') +
                    "\") of 1 bytes: the store holds 0 bytes and its cap is 10 "
                    "(store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
}

TEST_CASE("kv_state: a set wakes the waiters of its key, once") {
  kv_state s(1 << 20);
  int woken_a = 0;
  int woken_b = 0;
  const kv_waiter a = [&] { ++woken_a; };
  const kv_waiter b = [&] { ++woken_b; };
  {
    const kv_state::watch wa(s, a, {"k", "other"});
    const kv_state::watch wb(s, b, {"k"});
    CHECK(s.watched_keys() == 2);
    s.set("unrelated", "v");
    CHECK(woken_a == 0);
    s.set("k", "v");
    CHECK(woken_a == 1);
    CHECK(woken_b == 1);
    s.set("k", "again");  // the registration for "k" was used up
    CHECK(woken_a == 1);
    CHECK(woken_b == 1);
    CHECK(s.watched_keys() == 1);   // "other" is still watched by a
    CHECK(s.add("other", 1) == 1);  // add and compare_set wake too
    CHECK(woken_a == 2);
  }
  CHECK(s.watched_keys() == 0);
  const kv_state::watch wc(s, a, {"cas"});
  (void)s.compare_set("cas", "", "v");
  CHECK(woken_a == 3);
}

TEST_CASE("kv_state: a waiter that goes away is never woken, and erase wakes nobody") {
  kv_state s(1 << 20);
  int woken = 0;
  int stays = 0;
  std::optional<kv_waiter> gone = kv_waiter([&] { ++woken; });
  const kv_waiter waiting = [&] { ++stays; };
  s.set("k", "v");
  const kv_state::watch w(s, waiting, {"k2"});
  {
    const kv_state::watch disconnected(s, *gone, {"k2", "k3"});
  }  // its client disconnected: the registration ends with it
  gone.reset();
  CHECK(s.watched_keys() == 1);
  CHECK(s.erase("k"));
  CHECK(s.erase("k2") == false);
  CHECK(stays == 0);  // erasing wakes nobody: the keys are still missing
  s.set("k3", "v");
  s.set("k2", "v");
  CHECK(woken == 0);
  CHECK(stays == 1);
  CHECK(s.watched_keys() == 0);
}
