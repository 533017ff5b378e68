// The straggler watch's judgement (ddp/straggler.hpp), on step records made
// up here: what it names, when, and what it leaves alone; and the metrics
// file's text (diagnostics/metrics.hpp).
#include "store_support.hpp"
#include "support.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

using dtrain::detail::straggler_setting;
using dtrain::detail::straggler_watch;

namespace {

constexpr std::int64_t ms = 1'000'000;  // ns

/// A job of `size` ranks on two nodes ("node-a" the first half), judged by
/// one watch (every rank judges the same numbers alike). Each step: every
/// rank's arrival (its last gradients ready) and the step's length, which
/// waits for the last arrival and then the collectives.
struct judged_job {
  int size;
  straggler_watch watch;
  std::uint64_t step = 1;
  std::mt19937 noise{7};
  std::int64_t exchange_cost = 0;  // what each rank says its last exchange took

  explicit judged_job(int n, dtrain::straggler_options options = {}, std::size_t every = 1)
      : size(n), watch(straggler_setting{true, every}, options, 0, n, "node-a") {
    static_cast<void>(watch.step_done(step));  // the first step: no record
  }

  /// One step; the lines rank 0 would print (empty unless an exchange was due).
  std::vector<std::string> run(std::int64_t compute, std::int64_t late_rank_extra, int late_rank,
                               std::int64_t collectives) {
    std::vector<std::int64_t> arrival(static_cast<std::size_t>(size));
    std::uniform_int_distribution<std::int64_t> jitter(-ms / 2, ms / 2);  // +-5 % of a step
    std::int64_t last = 0;
    for (int r = 0; r < size; ++r) {
      arrival[static_cast<std::size_t>(r)] =
          compute + jitter(noise) + (r == late_rank ? late_rank_extra : 0);
      last = std::max(last, arrival[static_cast<std::size_t>(r)]);
    }
    return run_exact(arrival, last + collectives);
  }

  /// One step of exactly these arrivals and length.
  std::vector<std::string> run_exact(const std::vector<std::int64_t>& arrival,
                                     std::int64_t length) {
    ++step;
    records.push_back(arrival);
    lengths.push_back(length);
    if (!watch.step_done(step)) return {};
    return exchange();
  }

  std::vector<std::string> exchange() {
    const bool first = watch.figures().exchanges == 0;
    std::vector<std::int64_t> all;
    for (int r = 0; r < size; ++r) {
      all.push_back(exchange_cost);
      if (first) {
        std::string name = r < size / 2 ? "node-a" : "node-b";
        name.resize(straggler_watch::name_words * 8, '\0');
        for (std::size_t w = 0; w < straggler_watch::name_words; ++w) {
          std::int64_t word = 0;
          std::memcpy(&word, name.data() + 8 * w, 8);
          all.push_back(word);
        }
      }
      for (std::size_t i = 0; i < records.size(); ++i) {
        all.push_back(records[i][static_cast<std::size_t>(r)]);
        all.push_back(lengths[i]);
      }
    }
    records.clear();
    lengths.clear();
    return watch.absorb(all, exchange_cost);
  }

  std::vector<std::vector<std::int64_t>> records;
  std::vector<std::int64_t> lengths;
};

int count_with(const std::vector<std::string>& lines, const std::string& text) {
  int n = 0;
  for (const std::string& l : lines) n += l.find(text) != std::string::npos ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("straggler watch: a rank 20 % late is named within 5 steps, once, and its recovery") {
  judged_job job(8);
  std::vector<std::string> all;
  std::uint64_t named_at = 0;
  std::uint64_t recovered_at = 0;
  for (int s = 0; s < 300; ++s) {
    const bool late = s >= 100 && s < 150;  // steps 102..151
    for (const std::string& line : job.run(8 * ms, late ? 2 * ms : 0, 5, 2 * ms)) {
      all.push_back(line);
      if (line.find("is slow") != std::string::npos) named_at = job.step;
      if (line.find("keeps pace") != std::string::npos) recovered_at = job.step;
    }
  }
  REQUIRE(all.size() == 2);
  CHECK(all[0].find("rank 5 (node-b, local rank 1) is slow since step 102") == 0);
  INFO(all[0]);
  CHECK(
      all[0].find(
          "ms after the other ranks' (the median of the last 5 steps), which costs the job about ") !=
      std::string::npos);
  CHECK(all[1].find("rank 5 (node-b, local rank 1) keeps pace again at step") == 0);
  CHECK(named_at >= 102);
  CHECK(named_at <= 102 + 5);
  CHECK(recovered_at > 151);
  CHECK(recovered_at <= 151 + 5);
  const dtrain::straggler_figures f = job.watch.figures();
  REQUIRE(f.ranks.size() == 8);
  CHECK_FALSE(f.ranks[5].slow);
  CHECK(f.ranks[5].node == "node-b");
  CHECK(f.ranks[3].local_rank == 3);
  CHECK(f.ranks[4].local_rank == 0);
  CHECK(f.step_seconds == doctest::Approx(0.0105).epsilon(0.05));
}

TEST_CASE("straggler watch: noise of +-5 % names no one in 1,000 steps") {
  for (int size : {2, 4, 8}) {
    judged_job job(size);
    int lines = 0;
    for (int s = 0; s < 1000; ++s) lines += static_cast<int>(job.run(8 * ms, 0, -1, 2 * ms).size());
    CHECK_MESSAGE(lines == 0, size << " ranks");
    for (const dtrain::rank_pace& p : job.watch.figures().ranks) CHECK(p.share < 0.1);
  }
}

TEST_CASE("straggler watch: a busy host's bursts (a rank late 3 steps in a row) name no one") {
  // What 8 ranks on 2 cores beside a build look like: every 10 steps one rank
  // (each in turn) loses its core for 3 steps in a row, and most steps some
  // other rank is late once. The median of 5 steps alone named the burst's rank.
  judged_job job(8);
  std::mt19937 draw{11};
  std::uniform_int_distribution<int> any_rank(0, 7);
  std::uniform_int_distribution<std::int64_t> how_late(2 * ms, 6 * ms);
  std::bernoulli_distribution once(0.3);
  std::vector<std::string> all;
  for (int s = 0; s < 1000; ++s) {
    std::vector<std::int64_t> arrival(8, 8 * ms);
    const int burst = (s / 10) % 8;
    if (s % 10 < 3) arrival[static_cast<std::size_t>(burst)] += 4 * ms;
    const int other = any_rank(draw);
    if (once(draw) && other != burst) arrival[static_cast<std::size_t>(other)] += how_late(draw);
    const std::int64_t last = *std::max_element(arrival.begin(), arrival.end());
    for (const std::string& line : job.run_exact(arrival, last + 2 * ms)) all.push_back(line);
  }
  CHECK_MESSAGE(count_with(all, " is slow") == 0, (all.empty() ? "" : all[0]));
}

TEST_CASE("straggler watch: a rank late in 4 steps of 5 is named within 15 steps") {
  judged_job job(8);
  std::uint64_t named_at = 0;
  for (int s = 0; s < 200; ++s) {
    const bool late = s >= 100 && s < 150 && s % 5 != 4;  // steps 102..151, on time every 5th
    for (const std::string& line : job.run(8 * ms, late ? 2 * ms : 0, 5, 2 * ms))
      if (line.find("rank 5 (node-b, local rank 1) is slow since step") == 0) named_at = job.step;
  }
  CHECK(named_at >= 102);
  CHECK(named_at <= 102 + 15);  // late in most of the last 15 steps, not in every one of 5
}

TEST_CASE("straggler watch: late collectives after timely arrivals are the link's, not a rank's") {
  judged_job job(4);
  std::vector<std::string> all;
  for (int s = 0; s < 200; ++s) {
    const bool slow = s >= 60 && s < 110;
    for (const std::string& line : job.run(8 * ms, 0, -1, slow ? 5 * ms : 2 * ms))
      all.push_back(line);
  }
  REQUIRE(all.size() == 2);
  CHECK(all[0].find("the collectives are slow since step 62, with every rank's gradients on "
                    "time") == 0);
  CHECK(all[0].find("a slow link or a busy network") != std::string::npos);
  CHECK(all[1].find("the collectives keep pace again at step") == 0);
  CHECK(count_with(all, "rank ") == 0);
}

TEST_CASE("straggler watch: two late ranks of 8 are both named") {
  judged_job job(8);
  std::vector<std::string> all;
  for (int s = 0; s < 60; ++s) {
    std::vector<std::int64_t> arrival(8, 8 * ms);
    if (s >= 20) arrival[2] = arrival[6] = 11 * ms;
    for (const std::string& line : job.run_exact(arrival, (s >= 20 ? 11 : 8) * ms + 2 * ms))
      all.push_back(line);
  }
  CHECK(count_with(all, "rank 2 (node-a, local rank 2) is slow") == 1);
  CHECK(count_with(all, "rank 6 (node-b, local rank 2) is slow") == 1);
  CHECK(all.size() == 2);
  // The window a flight record keeps: the latest ranks first.
  const std::string window = job.watch.window();
  INFO(window);
  CHECK(
      window.starts_with("straggler watch at step 61 (exchanged every 1 steps): step 13.0 ms, "
                         "collectives 2.0 ms after the last rank (best 2.0 ms); latest: rank 2 "
                         "(node-a, local rank 2) 3.0 ms (23 %, slow since step 22), rank 6 "
                         "(node-b, local rank 2) 3.0 ms (23 %, slow since step 22), rank 0 "));
}

TEST_CASE("straggler watch: exchanges every few steps, chosen alike from their cost") {
  // Automatic: an exchange of 1 ms on 10.5 ms steps is under 0.5 % every 20 steps.
  judged_job job(4, {}, 0);
  job.exchange_cost = 1 * ms;
  int exchanges = 0;
  for (int s = 0; s < 200; ++s) {
    const auto before = job.watch.figures().exchanges;
    static_cast<void>(job.run(8 * ms, 0, -1, 2 * ms));
    exchanges += job.watch.figures().exchanges != before ? 1 : 0;
  }
  CHECK(job.watch.figures().every == 20);
  CHECK(exchanges >= 8);
  CHECK(exchanges <= 14);  // 4 steps first, then 20 at a time

  // A fixed period; a late rank is still named, at the exchange after its third late step.
  judged_job fixed(4, {}, 4);
  std::vector<std::string> lines;
  for (int s = 0; s < 40; ++s) {
    for (const std::string& l : fixed.run(8 * ms, s >= 10 ? 3 * ms : 0, 1, 2 * ms))
      lines.push_back(l);
  }
  CHECK(fixed.watch.figures().every == 4);
  CHECK(count_with(lines, "rank 1 (node-a, local rank 1) is slow since step 12") == 1);
}

TEST_CASE("straggler watch: DTRAIN_STRAGGLERS and the options, refused by name") {
  auto with = [](const char* value) {
    if (!value) return dtrain::environment{};
    return dtrain::environment{{"DTRAIN_STRAGGLERS", value}};
  };
  const dtrain::straggler_options defaults;
  CHECK(straggler_setting::of(with(nullptr), defaults, 0).on);
  CHECK(straggler_setting::of(with(nullptr), defaults, 0).every == 0);
  CHECK_FALSE(straggler_setting::of(with("off"), defaults, 0).on);
  CHECK(straggler_setting::of(with("auto"), {.every = 9}, 0).every == 0);
  CHECK(straggler_setting::of(with("7"), {.enabled = false}, 0).every == 7);
  CHECK(straggler_setting::of(with("7"), {.enabled = false}, 0).on);
  CHECK(straggler_setting::of(with(nullptr), {.every = 3}, 0).describe() ==
        "stragglers exchanged every 3 steps");
  for (const char* bad : {"0", "x", "-1", "3 steps", ""}) {
    const std::string expected =
        "DTRAIN_STRAGGLERS=" + std::string(bad) + " on rank 3: expected off, auto";
    CHECK_THROWS_WITH_AS(static_cast<void>(straggler_setting::of(with(bad), defaults, 3)),
                         doctest::Contains(expected.c_str()), dtrain::config_error);
  }
  CHECK_THROWS_WITH_AS(static_cast<void>(straggler_setting::of(with(nullptr), {.threshold = 0}, 1)),
                       doctest::Contains("ddp_options::stragglers.threshold = 0.000000 on rank 1"),
                       dtrain::config_error);
  CHECK_THROWS_WITH_AS(static_cast<void>(straggler_setting::of(with(nullptr), {.steps = 2}, 1)),
                       doctest::Contains("ddp_options::stragglers.steps = 2 on rank 1"),
                       dtrain::config_error);
  // One rank: no one to wait for.
  CHECK_FALSE(straggler_watch(straggler_setting{true, 1}, defaults, 0, 1, "n").on());
}

TEST_CASE("straggler watch: delays under min_delay are the scheduler's, not reported") {
  // Steps of 0.3 ms, one rank 30 % late: under the 1 ms floor.
  judged_job tiny(4);
  std::vector<std::int64_t> arrival(4, 200'000);
  arrival[3] += 90'000;
  int lines = 0;
  for (int s = 0; s < 100; ++s) lines += static_cast<int>(tiny.run_exact(arrival, 300'000).size());
  CHECK(lines == 0);
  CHECK(tiny.watch.figures().ranks[3].share > 0.2);  // the figures still tell
  // With the floor at 50 us it is named.
  judged_job fine(4, {.min_delay = std::chrono::microseconds(50)});
  std::vector<std::string> named;
  for (int s = 0; s < 20; ++s)
    for (const std::string& l : fine.run_exact(arrival, 300'000)) named.push_back(l);
  CHECK(count_with(named, "rank 3 (node-b, local rank 1) is slow") == 1);
  CHECK_THROWS_WITH_AS(static_cast<void>(straggler_setting::of(
                           dtrain::environment{}, {.min_delay = std::chrono::microseconds(-1)}, 2)),
                       doctest::Contains("ddp_options::stragglers.min_delay = -1 us on rank 2"),
                       dtrain::config_error);
}

TEST_CASE("metrics file: Prometheus text, label values escaped, written whole or not at all") {
  using dtrain::detail::metrics_text;
  CHECK(metrics_text::quoted("a\"b\\c\nd") == "\"a\\\"b\\\\c\\nd\"");
  metrics_text m("rank=\"1\",node=" + metrics_text::quoted("n1"));
  m.add("dtrain_step", "gauge", "The last step.", 40);
  m.add("dtrain_gradient_bytes_total", "counter", "Bytes.", 1310720);
  CHECK(m.str() ==
        "# HELP dtrain_step The last step.\n# TYPE dtrain_step gauge\n"
        "dtrain_step{rank=\"1\",node=\"n1\"} 40\n"
        "# HELP dtrain_gradient_bytes_total Bytes.\n# TYPE dtrain_gradient_bytes_total counter\n"
        "dtrain_gradient_bytes_total{rank=\"1\",node=\"n1\"} 1310720\n");
  const auto dir = std::filesystem::temp_directory_path() /
                   ("dtrain_metrics_test." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  dtrain::detail::write_metrics(dir / "dtrain_rank1.prom", m.str(), 1);
  CHECK(std::filesystem::file_size(dir / "dtrain_rank1.prom") == m.str().size());
  CHECK_FALSE(std::filesystem::exists(dir / "dtrain_rank1.prom.tmp"));
  CHECK_THROWS_WITH_AS(
      dtrain::detail::write_metrics(dir / "missing" / "f.prom", m.str(), 3),
      doctest::Contains("DTRAIN_METRICS_DIR (or ddp_options::metrics_dir): rank 3 cannot create"),
      dtrain::error);
  std::filesystem::remove_all(dir);
}

namespace {
/// One HTTP exchange with 127.0.0.1:`port`: sends `request`, returns all it answers.
std::string http_exchange(int port, const std::string& request) {
  raw_socket client(port);
  client.send(request);  // stops early when the endpoint answered (431) and closed
  return client.receive(std::numeric_limits<std::size_t>::max());
}
}  // namespace

TEST_CASE(
    "metrics endpoint: the node's files merged, one family each, behind a token off loopback") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("dtrain_endpoint_test." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  for (int rank = 0; rank < 2; ++rank) {
    dtrain::detail::metrics_text m("rank=\"" + std::to_string(rank) + "\",node=\"n1\"");
    m.add("dtrain_step", "gauge", "The last step.", 40 + rank);
    m.add("dtrain_gradient_bytes_total", "counter", "Bytes.", 1000);
    dtrain::detail::write_metrics(dir / ("dtrain_rank" + std::to_string(rank) + ".prom"), m.str(),
                                  rank);
  }
  std::ofstream(dir / "dtrain_rank2.prom.tmp") << "dtrain_step{rank=\"2\"} 1\n";  // half written
  const std::string merged = dtrain::detail::merge_metric_files(dir);
  CHECK(merged ==
        "# HELP dtrain_step The last step.\n# TYPE dtrain_step gauge\n"
        "dtrain_step{rank=\"0\",node=\"n1\"} 40\ndtrain_step{rank=\"1\",node=\"n1\"} 41\n"
        "# HELP dtrain_gradient_bytes_total Bytes.\n# TYPE dtrain_gradient_bytes_total counter\n"
        "dtrain_gradient_bytes_total{rank=\"0\",node=\"n1\"} 1000\n"
        "dtrain_gradient_bytes_total{rank=\"1\",node=\"n1\"} 1000\n");
  {
    dtrain::detail::metrics_endpoint open("127.0.0.1", 0, dir, "");
    const std::string ok = http_exchange(open.port(), "GET /metrics HTTP/1.1\r\nHost: n1\r\n\r\n");
    CHECK(ok.starts_with("HTTP/1.1 200 OK\r\n"));
    CHECK(ok.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
    CHECK(ok.ends_with("\r\n\r\n" + merged));
    CHECK(http_exchange(open.port(), "GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
    CHECK(
        http_exchange(open.port(), "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
    CHECK(http_exchange(open.port(), "hello\r\n\r\n").starts_with("HTTP/1.1 400 "));
    CHECK(http_exchange(open.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'x'))
              .starts_with("HTTP/1.1 431 "));
  }
  {
    dtrain::detail::metrics_endpoint guarded("127.0.0.1", 0, dir, "s3cret");
    const int port = guarded.port();
    CHECK(http_exchange(port, "GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 401 "));
    CHECK(http_exchange(port, "GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cre\r\n\r\n")
              .starts_with("HTTP/1.1 401 "));
    CHECK(http_exchange(port, "GET /nothing HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 401 "));
    CHECK(http_exchange(port, "GET /metrics HTTP/1.1\r\nauthorization: bearer s3cret\r\n\r\n")
              .ends_with("\r\n\r\n" + merged));
  }
  // Off loopback only with a token.
  CHECK_THROWS_WITH_AS(dtrain::detail::metrics_endpoint("0.0.0.0", 0, dir, ""),
                       doctest::Contains("DTRAIN_METRICS_BIND=0.0.0.0: the metrics endpoint "
                                         "listens on another address than loopback only with a "
                                         "token"),
                       dtrain::config_error);
  std::filesystem::remove_all(dir);
}
