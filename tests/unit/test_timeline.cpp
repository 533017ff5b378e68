#include "support.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

namespace json = dtrain::detail::json;
using dtrain::detail::timeline;

namespace {
std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::filesystem::path fresh_dir(const char* name) {
  auto dir = std::filesystem::temp_directory_path() /
             (std::string(name) + "." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}
}  // namespace

TEST_CASE("timeline: the rank goes before the file name's extension") {
  using dtrain::detail::timeline_file;
  CHECK(timeline_file("trace.json", 3) == "trace.rank3.json");
  CHECK(timeline_file("/tmp/run.1/trace.json", 0) == "/tmp/run.1/trace.rank0.json");
  CHECK(timeline_file("/tmp/run.1/trace", 12) == "/tmp/run.1/trace.rank12.json");
  CHECK(timeline_file("trace", 1) == "trace.rank1.json");
  CHECK(timeline_file("./.hidden", 2) == "./.hidden.rank2.json");
}

TEST_CASE("timeline: DTRAIN_TIMELINE wins over the option, empty turns it off") {
  using dtrain::detail::timeline_setting;
  CHECK(timeline_setting(dtrain::environment{}, "opt.json") == "opt.json");
  CHECK(timeline_setting(dtrain::environment{{"DTRAIN_TIMELINE", "env.json"}}, "opt.json") ==
        "env.json");
  CHECK(timeline_setting(dtrain::environment{{"DTRAIN_TIMELINE", ""}}, "opt.json").empty());
}

TEST_CASE("json: write_string escapes what the reader must read back") {
  const std::string text = "a \"quoted\" \\ name\n\t\x01 end";
  std::string out;
  json::write_string(out, text);
  CHECK(json::parse(out, "test").text == text);
}

TEST_CASE("timeline: off records nothing and writes nothing") {
  timeline off;
  CHECK_FALSE(off.on());
  CHECK(off.file().empty());
  { const auto span = off.mark_ready(0, 0); }
  CHECK(off.bucket_launched(0, 10) == 0);
  CHECK_NOTHROW(off.write());
}

TEST_CASE("timeline: spans of both tracks in one parsable file") {
  const auto dir = fresh_dir("dtrain_timeline_unit");
  timeline t((dir / "trace.json").string(), 1, 2, {"w\"eird", "b"});
  CHECK(t.file() == (dir / "trace.rank1.json").string());
  {
    const auto sync = t.synchronize(0);
    { const auto mark = t.mark_ready(0, 0); }
    const std::uint64_t id = t.bucket_launched(0, 7);
    CHECK(id != 0);
    t.bucket_done(0, id, timeline::now(), true);
    { const auto wait = t.wait(1); }
  }
  t.write();
  const json::value doc = json::parse(read_all(t.file().data()), "trace");
  const json::value* events = doc.find("traceEvents");
  REQUIRE(events != nullptr);
  std::vector<std::string> names;
  for (const json::value& e : events->items) names.push_back(e.find("name")->text);
  for (const char* expected : {"process_name", "thread_name", "w\"eird", "bucket 0",
                               "allreduce bucket 0", "wait for buckets", "synchronize", "step 0"}) {
    CHECK_MESSAGE(std::find(names.begin(), names.end(), expected) != names.end(), expected);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("timeline: a file that cannot be written names the file and the rank") {
  const std::string missing = "/nonexistent-dtrain-dir/trace.json";
  const std::string at_start =
      dtrain_test::config_error_text([&] { timeline t(missing, 5, 8, {}); });
  CHECK_CONTAINS(at_start, "DTRAIN_TIMELINE=" + missing);
  CHECK_CONTAINS(at_start, "rank 5 cannot write /nonexistent-dtrain-dir/trace.rank5.json");

  // The directory goes away during the run: the final write fails, and says so.
  const auto dir = fresh_dir("dtrain_timeline_gone");
  timeline t((dir / "trace.json").string(), 2, 4, {});
  std::filesystem::remove_all(dir);
  try {
    t.write();
    FAIL("write() into a removed directory did not throw");
  } catch (const dtrain::error& e) {
    CHECK_CONTAINS(std::string(e.what()),
                   "rank 2 could not write its timeline to " + (dir / "trace.rank2.json").string());
  }
  CHECK_NOTHROW(t.write_at_exit());
}
