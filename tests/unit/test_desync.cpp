// Desync analysis (diagnostics/desync.hpp): from the rings of every rank, who is
// behind, what it never started, what the others wait in, which sequence
// numbers were called with different arguments, who did not answer.
#include <dtrain/dtrain.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

using dtrain::dtype;
using dtrain::detail::call_record;
using dtrain::detail::call_state;
using dtrain::detail::rank_ring;

call_record call(std::int64_t seq, std::size_t count, call_state state, std::string label = {},
                 dtype type = dtype::float32, std::string kind = "allreduce") {
  return {.seq = seq,
          .kind = std::move(kind),
          .type = type,
          .count = count,
          .op = 1,
          .label = std::move(label),
          .state = state};
}

// Four ranks that all completed #40 and #41; then `tail` per rank.
std::vector<rank_ring> four_ranks(const std::vector<std::vector<call_record>>& tail) {
  std::vector<rank_ring> rings;
  for (int r = 0; r < 4; ++r) {
    rank_ring ring{r,
                   true,
                   {call(40, 1024, call_state::completed, "bucket 2"),
                    call(41, 262144, call_state::completed, "bucket 3")}};
    for (const auto& c : tail[static_cast<std::size_t>(r)]) ring.calls.push_back(c);
    rings.push_back(std::move(ring));
  }
  return rings;
}

bool contains(const std::vector<std::string>& lines, const std::string& part) {
  for (const auto& l : lines) {
    if (l.find(part) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE(
    "desync: the rank that never started the next collective is named, with what the others wait "
    "in") {
  const auto waiting = call(42, 65536, call_state::issued, "bucket 4");
  auto rings = four_ranks({{waiting}, {waiting}, {}, {waiting}});
  const auto report = dtrain::detail::analyse(rings);
  CHECK(report.summary ==
        "rank 2 is at #41 allreduce(float32 \u00d7 262144, bucket 3); ranks 0, 1, 3 wait in #42 "
        "allreduce(float32 "
        "\u00d7 65536, bucket 4): rank 2 never started #42");
  CHECK(
      contains(report.details, "rank 2: #41 allreduce(float32 \u00d7 262144, bucket 3) completed"));
  CHECK(contains(report.details, "rank 0: #42 allreduce(float32 \u00d7 65536, bucket 4) waiting"));
}

TEST_CASE(
    "desync: a different size for the same sequence number names the odd rank and both calls") {
  const auto right = call(42, 65536, call_state::timed_out);
  auto rings = four_ranks({{right}, {right}, {call(42, 100, call_state::issued)}, {right}});
  const auto report = dtrain::detail::analyse(rings);
  CHECK(report.summary ==
        "rank 2 is in #42 allreduce(float32 \u00d7 100); ranks 0, 1, 3 are in #42 "
        "allreduce(float32 \u00d7 65536): "
        "the sizes differ for the same collective");
  CHECK(contains(report.details, "mismatch: rank 2 is in #42"));
}

TEST_CASE("desync: a different type, op or collective is named as such") {
  const auto right = call(42, 8, call_state::issued);
  SUBCASE("type") {
    auto rings = four_ranks(
        {{right}, {call(42, 8, call_state::issued, {}, dtype::float64)}, {right}, {right}});
    CHECK(dtrain::detail::analyse(rings).summary.find("rank 1 is in #42 allreduce(float64") == 0);
    CHECK(dtrain::detail::analyse(rings).summary.ends_with(
        "the types differ for the same collective"));
  }
  SUBCASE("op: shown only when it differs") {
    auto other = right;
    other.op = 0;
    auto rings = four_ranks({{right}, {right}, {right}, {other}});
    CHECK(dtrain::detail::analyse(rings).summary ==
          "rank 3 is in #42 allreduce(sum, float32 \u00d7 8); ranks 0, 1, 2 are in #42 "
          "allreduce(avg, float32 \u00d7 "
          "8): the reduce ops differ for the same collective");
  }
  SUBCASE("collective") {
    auto rings = four_ranks({{right},
                             {right},
                             {call(42, 8, call_state::issued, {}, dtype::float32, "broadcast")},
                             {right}});
    CHECK(dtrain::detail::analyse(rings).summary.ends_with(
        "the collectives differ for the same collective"));
  }
}

TEST_CASE("desync: a rank that did not answer is named, with what the others wait in") {
  const auto waiting = call(42, 65536, call_state::timed_out, "bucket 4");
  auto rings = four_ranks({{waiting}, {waiting}, {}, {waiting}});
  rings[2] = rank_ring{2, false, {}};
  const auto report = dtrain::detail::analyse(rings);
  CHECK(report.summary ==
        "rank 2 did not answer (process gone, or frozen); ranks 0, 1, 3 wait in #42 "
        "allreduce(float32 \u00d7 65536, "
        "bucket 4)");
  CHECK(contains(report.details, "rank 2: no answer"));
}

TEST_CASE("desync: a rank behind and a silent rank are both reported") {
  const auto waiting = call(42, 65536, call_state::issued);
  auto rings = four_ranks({{waiting}, {}, {waiting}, {waiting}});
  rings[3] = rank_ring{3, false, {}};
  const auto report = dtrain::detail::analyse(rings);
  CHECK(report.summary.find("rank 1 is at #41") == 0);
  CHECK(contains(report.details, "also: rank 3 did not answer"));
}

TEST_CASE("desync: ranks that agree are said to agree, and no collective at all is said so") {
  auto rings = four_ranks({{}, {}, {}, {}});
  CHECK(dtrain::detail::analyse(rings).summary.find("every rank is at #41") == 0);
  std::vector<rank_ring> empty{{0, true, {}}, {1, true, {}}};
  CHECK(dtrain::detail::analyse(empty).summary == "no rank has issued a collective yet");
  CHECK(dtrain::detail::analyse(std::vector<rank_ring>{}).summary ==
        "no rank has issued a collective yet");
}

TEST_CASE("desync: a rank with no collective yet is behind the others") {
  std::vector<rank_ring> rings{{0, true, {call(1, 4, call_state::issued)}}, {1, true, {}}};
  CHECK(dtrain::detail::analyse(rings).summary ==
        "rank 1 is at no collective yet; rank 0 waits in #1 allreduce(float32 \u00d7 4): rank 1 "
        "never started #1");
}

TEST_CASE("desync: rings travel through the store and come back the same") {
  std::vector<call_record> calls{call(7, 3, call_state::completed, "bucket 12", dtype::bfloat16),
                                 call(8, 0, call_state::timed_out, {}, dtype::int64, "barrier")};
  calls[1].root = 2;
  const dtrain::detail::named_rings rings{{"world", calls}, {"world/split 1 (color 0)", {}}};
  const auto back = dtrain::detail::decode_rings(dtrain::detail::encode_rings(rings));
  REQUIRE(back);
  REQUIRE(back->size() == 2);
  CHECK((*back)[1].first == "world/split 1 (color 0)");
  CHECK((*back)[1].second.empty());
  REQUIRE((*back)[0].second.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    const call_record& got = (*back)[0].second[i];
    CHECK(got.same_call(calls[i]));
    CHECK(got.seq == calls[i].seq);
    CHECK(got.label == calls[i].label);
    CHECK(got.state == calls[i].state);
  }
  const std::string value = dtrain::detail::encode_rings(rings);
  CHECK_FALSE(dtrain::detail::decode_rings("not a ring"));
  CHECK_FALSE(dtrain::detail::decode_rings(value.substr(0, value.size() - 1)));  // cut short
  CHECK_FALSE(dtrain::detail::decode_rings(value + "x"));                        // trailing bytes
  std::string bad_version = value;
  bad_version[0] = 2;
  CHECK_FALSE(dtrain::detail::decode_rings(bad_version));
  // world's first call: version, ring count, name, call count, seq, kind; then its type byte.
  std::string bad_type = value;
  bad_type[1 + 4 + 4 + 5 + 4 + 8 + 4 + 9] = 99;
  CHECK_FALSE(dtrain::detail::decode_rings(bad_type));
}

TEST_CASE("desync: the job's analysis picks the communicator that explains the stall") {
  using dtrain::detail::rank_publication;
  const std::vector<call_record> world{
      call(1, 10, call_state::completed, {}, dtype::float32, "broadcast")};
  const auto waiting = call(42, 65536, call_state::issued, "bucket 4");
  auto rings = four_ranks({{waiting}, {waiting}, {}, {waiting}});
  std::vector<rank_publication> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back({r,
                     true,
                     {{"world", world},
                      {"world/split 1 (color 0)", rings[static_cast<std::size_t>(r)].calls}}});
  }
  SUBCASE("a rank behind on the split") {
    const auto report = dtrain::detail::analyse_job(ranks);
    CHECK(report.summary.starts_with("rank 2 is at #41"));
    CHECK(report.summary.ends_with("(on communicator world/split 1 (color 0))"));
    CHECK(contains(report.details, "communicator world:"));
  }
  SUBCASE("a silent rank counts on the split every other rank has") {
    ranks[1] = {1, false, {}};
    ranks[2].rings[1].second.push_back(waiting);
    const auto report = dtrain::detail::analyse_job(ranks);
    CHECK(report.summary.starts_with(
        "rank 1 did not answer (process gone, or frozen); ranks 0, 2, 3 wait in #42"));
  }
  SUBCASE("a split only some ranks have is analysed over them") {
    for (int r : {2, 3})
      ranks[static_cast<std::size_t>(r)].rings[1].first = "world/split 1 (color 1)";
    const auto report = dtrain::detail::analyse_job(ranks);
    CHECK(report.summary.starts_with("rank 2 is at #41"));
    CHECK(report.summary.ends_with("(on communicator world/split 1 (color 1))"));
  }
}

TEST_CASE("collective_ring: keeps the last collectives with their labels and how far each got") {
  dtrain::detail::collective_ring ring;
  for (int i = 0; i < 100; ++i) {
    dtrain::detail::label_scope label("bucket", i);
    const auto seq = ring.issue("allreduce", dtype::float32, 10, 0, -1);
    if (i < 99) ring.settle(seq, call_state::completed);
  }
  const auto calls = ring.snapshot();
  REQUIRE(calls.size() == dtrain::detail::collective_ring::capacity);
  CHECK(calls.front().seq == 100 - static_cast<std::int64_t>(calls.size()) + 1);
  CHECK(calls.back().seq == 100);
  CHECK(calls.back().label == "bucket 99");
  CHECK(calls.back().state == call_state::issued);
  CHECK(calls[calls.size() - 2].state == call_state::completed);
  CHECK(dtrain::detail::current_call_label().what == nullptr);  // the scopes restored it
  ring.settle(1, call_state::failed);                           // long gone: ignored
  CHECK(ring.snapshot().front().seq == calls.front().seq);
}

TEST_CASE(
    "rank_diagnostics: a round gathers every rank's rings through the store, and SIGUSR1 opens "
    "one") {
  using namespace std::chrono_literals;
  using dtrain::detail::collective_ring;
  const dtrain::store_options quick{.timeout = 20s};
  dtrain::store_server server("127.0.0.1", 0, quick);
  // Ranks 0, 1 and 3 wait in #2; rank 2 completed #1 only; rank 3 has no diagnostics (its process
  // is gone).
  std::vector<std::shared_ptr<collective_ring>> rings;
  for (int r = 0; r < 4; ++r) {
    auto ring = std::make_shared<collective_ring>();
    ring->settle(ring->issue("allreduce", dtype::float32, 262144, 1, -1), call_state::completed);
    if (r != 2) ring->issue("allreduce", dtype::float32, 65536, 1, -1);
    rings.push_back(std::move(ring));
  }
  // Each rank also writes its flight record in `dir`.
  const auto dir =
      std::filesystem::temp_directory_path() / ("dtrain_flight_test." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<dtrain::detail::rank_diagnostics>> ranks;
  auto note = std::make_shared<dtrain::detail::flight_note>();  // DDP's line, on every rank
  note->set("straggler watch at step 7: nothing late");
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(std::make_unique<dtrain::detail::rank_diagnostics>(
        "127.0.0.1", server.port(), quick, "job/diag", r, 4, rings[static_cast<std::size_t>(r)],
        "test", dtrain::diagnostics_options{.wait = 2s, .poll = 20ms, .dir = dir.string()},
        "node-" + std::to_string(r), note));
  }
  const std::string summary = ranks[1]->explain("a test on rank 1");
  CHECK(summary ==
        "rank 2 is at #1 allreduce(float32 \u00d7 262144); ranks 0, 1 wait in #2 allreduce(float32 "
        "\u00d7 65536): "
        "rank 2 never started #2");

  // Read after the job: the same summary, rank 3 (no record) as not answering.
  // Ranks 0 and 2 wrote theirs when their threads saw the round: wait for them.
  for (int i = 0;
       i < 200 && !(std::filesystem::exists(dtrain::detail::flight_record_file(dir, 0)) &&
                    std::filesystem::exists(dtrain::detail::flight_record_file(dir, 2)));
       ++i)
    std::this_thread::sleep_for(20ms);
  const dtrain::detail::flight_reading read = dtrain::detail::read_flight_records(dir);
  CHECK(read.summary == summary);
  CHECK(read.problems.empty());
  INFO(read.table);
  CHECK(read.table.find(
            "dtrain: collective diagnostics from the flight records in " + dir.string() +
            ", after a test on rank 1 (test, 4 ranks; records of ranks 0, 1, 2, written ") == 0);
  CHECK(read.table.find("rank 3") != std::string::npos);
  CHECK(read.table.find("'s note: straggler watch at step 7: nothing late\n") != std::string::npos);
  {
    // A damaged record is named and not used; the rest are still read.
    const auto file = dtrain::detail::flight_record_file(dir, 2);
    std::filesystem::resize_file(file, std::filesystem::file_size(file) - 3);
    std::ofstream(dir / "notes.txt") << "not a record";
    const dtrain::detail::flight_reading damaged = dtrain::detail::read_flight_records(dir);
    REQUIRE(damaged.problems.size() == 1);
    CHECK(damaged.problems[0].find(file.string() + " is not a whole dtrain flight record (") == 0);
    CHECK(damaged.summary != summary);  // rank 2 now did not answer
  }
  CHECK_THROWS_WITH_AS(dtrain::detail::read_flight_records(dir / "missing"),
                       doctest::Contains("flight records: cannot list"), dtrain::error);
  const std::string not_a_directory =
      "DTRAIN_DIAGNOSTICS_DIR (or diagnostics_options::dir) = " + (dir / "missing").string() +
      " on rank 5: not a directory";
  CHECK_THROWS_WITH_AS(
      dtrain::detail::rank_diagnostics(
          "127.0.0.1", server.port(), quick, "job/diag", 5, 6, rings[0], "test",
          dtrain::diagnostics_options{.dir = (dir / "missing").string()}, "node-5"),
      doctest::Contains(not_a_directory.c_str()), dtrain::config_error);

  dtrain::store_client client("127.0.0.1", server.port(), quick);
  dtrain::prefix_store<dtrain::store_client> diag(client, "job/diag");
  CHECK(dtrain::detail::wire::decode_text("1/reason", diag.get("1/reason"), "a reason") ==
        "a test on rank 1");
  CHECK(diag.check(std::vector<std::string>{"1/ring/0", "1/ring/1", "1/ring/2", "1/closed"}));
  CHECK_FALSE(diag.check(std::vector<std::string>{"1/ring/3"}));

  // SIGUSR1 wakes the newest instance's thread, which opens round 2.
  std::raise(SIGUSR1);
  const std::vector<std::string> closed{"2/closed"};
  diag.wait(closed, 20s);
  CHECK(dtrain::detail::wire::decode_text("2/reason", diag.get("2/reason"), "a reason") ==
        "SIGUSR1 on rank 2");
  while (!ranks.empty())
    ranks.pop_back();  // newest first: each gives SIGUSR1 back to the one before
  std::filesystem::remove_all(dir);
}

TEST_CASE("rank_diagnostics: a rank whose store is gone still writes its flight record") {
  using namespace std::chrono_literals;
  const dtrain::store_options quick{.timeout = 2s};
  auto server = std::make_unique<dtrain::store_server>("127.0.0.1", 0, quick);
  const auto dir =
      std::filesystem::temp_directory_path() / ("dtrain_flight_gone." + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto ring = std::make_shared<dtrain::detail::collective_ring>();
  ring->issue("allreduce", dtype::float32, 1024, 1, -1);
  {
    dtrain::detail::rank_diagnostics rank(
        "127.0.0.1", server->port(), quick, "job/diag", 1, 2, ring, "test",
        dtrain::diagnostics_options{.wait = 500ms, .poll = 20ms, .dir = dir.string()}, "node-1");
    server.reset();
    CHECK(rank.explain("a timeout on rank 1").starts_with("no diagnostics: "));
  }
  const dtrain::detail::flight_reading read = dtrain::detail::read_flight_records(dir);
  CHECK(read.problems.empty());
  INFO(read.table);
  CHECK(read.table.find("after a timeout on rank 1 (test, 2 ranks; records of rank 1, written") !=
        std::string::npos);
  CHECK(read.summary.find("rank 0") != std::string::npos);  // silent: no record
  std::filesystem::remove_all(dir);
}

TEST_CASE("check mode: every engine names a mismatched call as the ring does") {
  using dtrain::detail::collective_info;
  using dtrain::detail::signature;
  const collective_info mine{"allreduce", "mpi", 0, 2, 4, static_cast<std::uint8_t>(dtype::float32),
                             0,           -1};
  const collective_info theirs{
      "broadcast", "mpi", 1, 2, 4, static_cast<std::uint8_t>(dtype::float32), -1, 1};
  const signature a = dtrain::detail::signature_of(7, mine);
  CHECK(dtrain::detail::describe_collective(a) ==
        "collective #7: allreduce(sum, float32 \u00d7 4)");
  CHECK(dtrain::detail::describe_collective(dtrain::detail::signature_of(7, theirs)) ==
        "collective #7: broadcast(float32 \u00d7 4, root 1)");
  // A fake allgather: rank 1 passed `theirs` as its 7th collective.
  auto gather = [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    const signature b = dtrain::detail::signature_of(7, theirs);
    const std::int64_t other[] = {b.seq, b.kind, b.count, b.type, b.op, b.root};
    std::copy(in.begin(), in.end(), out.begin());
    std::copy(std::begin(other), std::end(other),
              out.begin() + static_cast<std::ptrdiff_t>(in.size()));
  };
  CHECK_THROWS_WITH_AS(
      dtrain::detail::compare_signatures(a, 0, 2, "allreduce(...)", gather),
      "allreduce(...): rank 1 called collective #7: broadcast(float32 \u00d7 4, root 1), "
      "rank 0 called collective #7: allreduce(sum, float32 \u00d7 4)",
      dtrain::backend_error);
  CHECK_NOTHROW(dtrain::detail::compare_signatures(
      a, 0, 1, "x", [](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
        std::copy(in.begin(), in.end(), out.begin());
      }));
}
