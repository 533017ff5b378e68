#include "support.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

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
  auto timeline_setting = [](const dtrain::environment& env, const std::string& option) {
    return dtrain::detail::read_setting(env, dtrain::timeline_variable, option);
  };
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

namespace {

// A device whose clock the test sets: each event's device time and whether
// it was reached are the test's (device_spans' seam, ddp/device_spans.hpp).
struct scripted_device {
  using stream_type = dtrain::stream_handle;
  class device_timer {
   public:
    struct stamp {
      double device_ns = 0;
      bool reached = false;
    };
    using event = std::shared_ptr<stamp>;
    // Events recorded at start-up (calibration) are reached at device time 0.
    static inline bool calibrating = true;
    static inline std::vector<event> recorded;
    explicit device_timer(int /*device*/) {}
    [[nodiscard]] stream_type stream() const noexcept { return nullptr; }
    [[nodiscard]] event record(stream_type) {
      auto e = std::make_shared<stamp>();
      e->reached = calibrating;
      if (!calibrating) recorded.push_back(e);
      return e;
    }
    [[nodiscard]] bool reached(const event& e) const noexcept { return e->reached; }
    [[nodiscard]] double elapsed_ns(const event& from, const event& to) const noexcept {
      return to->device_ns - from->device_ns;
    }
    void release(const event&) noexcept {}
  };
};

// A collective that any stream can wait for.
struct waitable final : dtrain::detail::work_state {
  waitable() : work_state("test collective", std::chrono::milliseconds(1000)) {}
  bool poll() override { return true; }
  bool stream_wait(dtrain::stream_handle) override { return true; }
};

// A timeline (in a directory of its own) with device spans on the scripted
// device, started: its clock tied to the host's.
struct scripted_timeline {
  std::filesystem::path dir;
  timeline t;
  dtrain::detail::device_spans<scripted_device> spans;  // after t: it writes there
  dtrain::work collective{std::make_shared<waitable>()};
  explicit scripted_timeline(const char* name)
      : dir(fresh_dir(name)), t((dir / "trace.json").string(), 0, 2, {"w"}) {
    scripted_device::device_timer::calibrating = true;
    scripted_device::device_timer::recorded.clear();
    spans.start(0, 0, t);
    scripted_device::device_timer::calibrating = false;
  }
  scripted_timeline(const scripted_timeline&) = delete;
  scripted_timeline& operator=(const scripted_timeline&) = delete;
  ~scripted_timeline() {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  /// The file, written now and parsed.
  json::value written() {
    t.write();
    return json::parse(read_all(std::string(t.file())), "trace");
  }
};

}  // namespace

TEST_CASE("timeline: device spans stay between the host's record and the host's sight") {
  // The device's clock drifts against the host's: a span mapped before the
  // host recorded its event, or after the host saw it reached, is held to
  // those bounds (and the tie moves), never drawn where it cannot have been.
  scripted_timeline s("dtrain_device_spans");
  REQUIRE(s.spans.on());
  timeline& t = s.t;
  auto& spans = s.spans;
  using timer = scripted_device::device_timer;
  struct bounds {
    std::int64_t before_begin, after_end, before_poll, after_poll;
  };
  auto step = [&](std::size_t bucket, double device_begin, double device_end) {
    bounds b{};
    b.before_begin = timeline::now();
    const std::uint64_t id = t.bucket_launched(bucket, 10);
    spans.begin(bucket, nullptr);
    REQUIRE(spans.end(bucket, id, s.collective));
    b.after_end = timeline::now();
    REQUIRE(timer::recorded.size() >= 2);
    auto& begin = *timer::recorded[timer::recorded.size() - 2];
    auto& end = *timer::recorded.back();
    spans.poll();  // not reached yet: nothing resolves, nothing blocks
    begin.device_ns = device_begin;
    end.device_ns = device_end;
    begin.reached = end.reached = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    b.before_poll = timeline::now();
    spans.poll();
    b.after_poll = timeline::now();
    return b;
  };
  // A device clock 1000 s behind the host's: mapped before the host recorded them.
  const bounds slow = step(0, -1e12, -1e12 + 1e6);
  // Then 1000 s ahead: mapped after the host saw them.
  const bounds fast = step(1, 2e12, 2e12 + 1e6);
  const auto trace = s.written();
  std::vector<std::pair<double, double>> device;  // us
  for (const auto& e : trace.find("traceEvents")->items) {
    if (const auto* cat = e.find("cat"); cat && cat->text == "device") {
      const double ts = std::stod(e.find("ts")->text);
      device.emplace_back(ts, ts + std::stod(e.find("dur")->text));
    }
  }
  REQUIRE(device.size() == 2);
  CHECK(trace.find("otherData")->find("device_clock_uncertainty_us") != nullptr);
  auto us = [](std::int64_t ns) { return static_cast<double>(ns) / 1e3; };
  for (const auto& [span, b] : {std::pair{device[0], slow}, std::pair{device[1], fast}}) {
    CHECK(span.first >= us(b.before_begin) - 0.002);  // not before its event was recorded
    CHECK(span.second <= us(b.after_poll) + 0.002);   // not after the host saw it reached
    CHECK(span.first <= span.second);
  }
}

TEST_CASE("timeline: a device that never reaches its events delays the write a second at most") {
  // A hung device: flush() (flush_timeline(), the destructor) waits one
  // second, then the buckets' spans end at the host's time, said on stderr.
  scripted_timeline s("dtrain_device_spans_hung");
  REQUIRE(s.spans.on());
  const std::uint64_t id = s.t.bucket_launched(0, 10);
  s.spans.begin(0, nullptr);
  REQUIRE(s.spans.end(0, id, s.collective));
  const auto before = std::chrono::steady_clock::now();
  s.spans.flush();
  const auto waited = std::chrono::steady_clock::now() - before;
  // It waited its second for the device (a hang would meet the test's timeout).
  CHECK(waited >= dtrain::detail::device_spans<scripted_device>::flush_wait);
  const auto trace = s.written();
  int device = 0, ended = 0;
  for (const auto& e : trace.find("traceEvents")->items) {
    const auto* cat = e.find("cat");
    if (cat && cat->text == "device") ++device;
    if (cat && cat->text == "bucket" && e.find("ph")->text == "e") ++ended;
  }
  CHECK(device == 0);  // never reached: no device time is made up
  CHECK(ended == 1);   // the bucket's span is closed, at the host's time
}
