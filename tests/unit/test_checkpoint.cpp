// dtrain::checkpoint (issue 33): the file format and its checks, the sampler's
// position, and save/restore among ranks played by threads over a store.
#include "support.hpp"

#include <dtrain/dtrain.hpp>
// The single header has dtrain::checkpoint; with include/ it is a header of its own.
#if __has_include(<dtrain/checkpoint.hpp>)
#include <dtrain/checkpoint.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace ckpt = dtrain::detail::ckpt;

namespace {

/// A fresh directory under the temp dir, removed at the end.
struct scratch_dir {
  fs::path path;
  scratch_dir() {
    path = fs::temp_directory_path() /
           ("dtrain-ckpt-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

/// Runs `body(plane, rank)` on `size` ranks, each a thread with its own store
/// client; returns each rank's exception text ("" when none).
std::vector<std::string> on_ranks(int size,
                                  const std::function<void(dtrain::control_plane, int)>& body) {
  const dtrain::store_options options{.timeout = 20s, .log = [](std::string_view) {}};
  dtrain::store_server server("127.0.0.1", 0, options);
  std::vector<std::string> failures(static_cast<std::size_t>(size));
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      try {
        dtrain::store_client client("127.0.0.1", server.port(), options);
        dtrain::store_channel channel(client, r, size, "test-checkpoint");
        body(dtrain::control_plane(channel), r);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  return failures;
}

void flip_byte(const fs::path& file, std::uintmax_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

/// A model-like state: two parameters, a per-step counter of its own, an optimizer's bytes.
struct toy_state {
  std::vector<float> weight = std::vector<float>(64);
  std::vector<double> bias = std::vector<double>(8);
  std::string optimizer = "adam:0";
  void fill(float base) {
    for (std::size_t i = 0; i < weight.size(); ++i) weight[i] = base + static_cast<float>(i);
    for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = -base - static_cast<double>(i);
    optimizer = "adam:" + std::to_string(static_cast<int>(base));
  }
  void add_to(dtrain::checkpoint& c) {
    c.add("weight", weight).add("bias", bias);
    c.add(
        "optimizer", [this] { return optimizer; },
        [this](std::string_view bytes) { optimizer = std::string(bytes); });
  }
};

/// The slice of the replicated part a memory copy's manifest lists
/// ("replicated.1-of-2": its file's name without the id), or "" for none.
std::string slice_in(const fs::path& copy) {
  for (const auto& f : dtrain::detail::ckpt::verify_step(copy).files) {
    if (f.name.starts_with("replicated.") && f.name != dtrain::detail::ckpt::replicated_name)
      return f.name.substr(0, f.name.find('.', std::string_view("replicated.").size()));
  }
  return "";
}

}  // namespace

TEST_CASE("checkpoint: remove_tree removes a tree as rm -rf does, links not followed") {
  scratch_dir outside;  // a link's target: it must survive
  std::ofstream(outside.path / "kept") << "kept";
  scratch_dir dir;
  fs::create_directories(dir.path / "step-2/sub");
  std::ofstream(dir.path / "step-2/sub/rank-0.dtck") << "x";
  std::ofstream(dir.path / "step-2/MANIFEST") << "y";
  fs::create_directory_symlink(outside.path, dir.path / "step-2/link");
  CHECK(dtrain::detail::remove_tree((dir.path / "step-2").c_str()) == 0);
  CHECK_FALSE(fs::exists(dir.path / "step-2"));
  CHECK(fs::exists(outside.path / "kept"));
  CHECK(dtrain::detail::remove_tree((dir.path / "no-such-step").c_str()) == 0);
  std::ofstream(dir.path / "plain-file") << "z";  // a file alone goes too
  CHECK(dtrain::detail::remove_tree((dir.path / "plain-file").c_str()) == 0);
  CHECK_FALSE(fs::exists(dir.path / "plain-file"));
}

TEST_CASE(
    "checkpoint retention: what a directory keeps, for the disk's names and a rank's copies") {
  scratch_dir dir;
  for (const char* name :
       {"step-1", "step-2", "step-3", "step-4", "step-9", "step-5.partial", "step-2.partial",
        "step-6.removing", "step-7.partial.removing", "step-8.replaced", "other", "step-x",
        "step-1.rank-0", "step-2.rank-0", "step-3.rank-0", "step-3.rank-0.partial", "step-4.rank-1",
        "step-1.rank-10"})
    fs::create_directories(dir.path / name);
  std::ofstream(dir.path / "step-10") << "a file, not a step";

  auto names = [&](const std::vector<fs::path>& paths) {
    std::set<std::string> out;
    for (const fs::path& p : paths) out.insert(p.filename().string());
    return out;
  };
  // The disk's names: step-<N>, newest first; the rank copies are not steps.
  std::vector<std::uint64_t> committed;
  for (const auto& [step, path] : ckpt::committed_steps(dir.path)) committed.push_back(step);
  CHECK(committed == std::vector<std::uint64_t>{9, 4, 3, 2, 1});
  // Newest 4, keep 2: steps 1 and 2 beyond it, 9 after it, the save of 2 that
  // died (not 5's: it may be in flight), and what removals left.
  CHECK(names(ckpt::stale_steps(dir.path, 4, 2)) ==
        std::set<std::string>{"step-1", "step-2", "step-9", "step-2.partial", "step-6.removing",
                              "step-7.partial.removing", "step-8.replaced"});
  // Rank 0's memory copies: only its own, by the same rules.
  committed.clear();
  for (const auto& [step, path] : ckpt::committed_steps(dir.path, ".rank-0"))
    committed.push_back(step);
  CHECK(committed == std::vector<std::uint64_t>{3, 2, 1});
  CHECK(names(ckpt::stale_steps(dir.path, 3, 2, ".rank-0")) ==
        std::set<std::string>{"step-1.rank-0", "step-3.rank-0.partial"});
  CHECK(names(ckpt::stale_steps(dir.path, 2, 2, ".rank-0")) ==
        std::set<std::string>{"step-3.rank-0"});
  CHECK(ckpt::committed_steps(dir.path / "none").empty());
  CHECK(ckpt::stale_steps(dir.path / "none", 3, 1).empty());
}

TEST_CASE("checkpoint format: the checksum is the same however the stream is cut") {
  std::vector<unsigned char> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 3);
  const std::uint64_t whole = ckpt::checksum64::of(data.data(), data.size());
  for (std::size_t cut : {0u, 1u, 31u, 32u, 33u, 100u, 999u}) {
    ckpt::checksum64 c;
    c.update(data.data(), cut);
    c.update(data.data() + cut, data.size() - cut);
    CHECK(c.value() == whole);
  }
  data[500] ^= 1;
  CHECK(ckpt::checksum64::of(data.data(), data.size()) != whole);
  CHECK(ckpt::checksum64::of(data.data(), 999) != ckpt::checksum64::of(data.data(), 1000));
}

TEST_CASE("checkpoint format: a part file reads back, and a truncated one says so") {
  scratch_dir dir;
  const fs::path file = dir.path / "part.dtck";
  const std::vector<float> values{1.5f, 2.5f, 3.5f};
  ckpt::file_record record;
  {
    ckpt::atomic_file out(file);
    ckpt::write_part_header(out, 2);
    const std::uint64_t shape[] = {3};
    ckpt::write_entry(out, "w", ckpt::entry_kind::values, dtrain::dtype::float32, shape,
                      values.data(), 12);
    ckpt::write_entry(out, "blob", ckpt::entry_kind::bytes, dtrain::dtype::uint8, {}, "xyz", 3);
    record = out.finish();
  }
  CHECK_FALSE(fs::exists(file.string() + ".part"));
  const ckpt::part_contents got = ckpt::read_part(file);
  CHECK(got.bytes == record.bytes);
  CHECK(got.bytes == fs::file_size(file));
  CHECK(got.checksum == record.checksum);
  REQUIRE(got.entries.size() == 2);
  CHECK(got.entries[0].name == "w");
  CHECK(got.entries[0].shape == std::vector<std::uint64_t>{3});
  CHECK(got.entries[1].kind == ckpt::entry_kind::bytes);

  fs::resize_file(file, record.bytes - 2);
  CHECK_THROWS_WITH_AS(ckpt::read_part(file), doctest::Contains("is truncated"),
                       dtrain::checkpoint_error);
  // An atomic file given up before finish() leaves nothing behind.
  { ckpt::atomic_file abandoned(dir.path / "gone.dtck"); }
  CHECK_FALSE(fs::exists(dir.path / "gone.dtck.part"));
  CHECK_FALSE(fs::exists(dir.path / "gone.dtck"));
}

TEST_CASE("checkpoint format: the manifest round-trips, and a torn one is refused") {
  const ckpt::manifest m{42, 4, {{"replicated.dtck", 100, 0xabcdef}, {"rank-3.dtck", 7, 1}}};
  const std::string text = ckpt::render(m);
  const ckpt::manifest back = ckpt::parse_manifest(text, "M");
  CHECK(back.step == 42);
  CHECK(back.world_size == 4);
  REQUIRE(back.files.size() == 2);
  CHECK(back.files[0].checksum == 0xabcdef);
  CHECK(back.files[1].name == "rank-3.dtck");
  CHECK_THROWS_WITH_AS(ckpt::parse_manifest(text.substr(0, text.size() - 5), "M"),
                       doctest::Contains("torn"), dtrain::checkpoint_error);
  std::string edited = text;
  edited[edited.find("42")] = '9';
  CHECK_THROWS_WITH_AS(ckpt::parse_manifest(edited, "M"), doctest::Contains("checksum"),
                       dtrain::checkpoint_error);
  CHECK(ckpt::step_of("step-120") == 120u);
  CHECK_FALSE(ckpt::step_of("step-12.partial").has_value());
  CHECK_FALSE(ckpt::step_of("step-").has_value());
}

TEST_CASE(
    "sampler: a position continues the same indices, and another world size the same global "
    "order") {
  constexpr std::size_t n = 96;
  auto take_all = [](dtrain::distributed_sampler& s, std::size_t batch) {
    std::vector<std::size_t> out;
    for (auto b = s.next_batch(batch); !b.empty(); b = s.next_batch(batch))
      out.insert(out.end(), b.begin(), b.end());
    return out;
  };
  for (int rank = 0; rank < 4; ++rank) {
    dtrain::distributed_sampler whole(n, rank, 4, {.seed = 7});
    whole.set_epoch(3);
    const std::vector<std::size_t> expected = take_all(whole, 5);
    CHECK(whole.position().offset == n);

    dtrain::distributed_sampler first(n, rank, 4, {.seed = 7});
    first.set_epoch(3);
    std::vector<std::size_t> seen;
    for (int i = 0; i < 2; ++i) {
      const auto b = first.next_batch(5);
      seen.insert(seen.end(), b.begin(), b.end());
    }
    const dtrain::sampler_position at = first.position();
    CHECK(at.epoch == 3);
    CHECK(at.offset == 40);  // 2 batches of 5 on each of 4 ranks
    dtrain::distributed_sampler resumed(n, rank, 4, {.seed = 7});
    resumed.set_position(at);
    const std::vector<std::size_t> rest = take_all(resumed, 5);
    seen.insert(seen.end(), rest.begin(), rest.end());
    CHECK(seen == expected);
  }
  // 4 ranks take 40 samples, then 3 ranks (one node lost) the rest: each sample once.
  std::multiset<std::size_t> counted;
  for (int rank = 0; rank < 4; ++rank) {
    dtrain::distributed_sampler s(n, rank, 4, {.seed = 7});
    s.set_epoch(1);
    for (int i = 0; i < 2; ++i)
      for (std::size_t idx : s.next_batch(5)) counted.insert(idx);
  }
  for (int rank = 0; rank < 3; ++rank) {
    dtrain::distributed_sampler s(n, rank, 3, {.seed = 7});
    s.set_position({.epoch = 1, .offset = 40});
    CHECK(s.size() == 56 / 3 + 1);  // 56 left, padded to 57
    for (std::size_t idx : take_all(s, 4)) counted.insert(idx);
  }
  std::size_t repeated = 0;
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(counted.count(i) >= 1);
    repeated += counted.count(i) - 1;
  }
  CHECK(repeated == 1);  // the one padding sample
}

TEST_CASE(
    "checkpoint: each commit is in its metrics file, and a metrics directory that cannot take it "
    "stops every rank, named") {
  scratch_dir dir;
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    {
      std::int64_t own = rank;
      dtrain::checkpoint c(
          plane,
          {.dir = dir.path / "ckpt", .every = 1, .quiet = true, .metrics_dir = dir.path.string()});
      c.add("own", own, dtrain::checkpoint_scope::per_rank);
      CHECK(c.step());
      CHECK(c.step());
    }
    const fs::path file = dir.path / ("dtrain_checkpoint_rank" + std::to_string(rank) + ".prom");
    std::ifstream in(file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // Rank 0 commits the job's checkpoint on disk: its file says so; no memory tier here.
    CHECK((text.find("dtrain_checkpoint_disk_step{rank=\"0\",node=") != std::string::npos) ==
          (rank == 0));
    if (rank == 0)
      CHECK(text.find("\"} 2\n# HELP dtrain_checkpoint_disk_timestamp") != std::string::npos);
    CHECK(text.find("memory") == std::string::npos);
    // Rank 1's directory is missing: both ranks stop at construction, naming it.
    const std::string metrics = rank == 0 ? dir.path.string() : (dir.path / "missing").string();
    CHECK_THROWS_WITH_AS(
        dtrain::checkpoint(plane,
                           {.dir = dir.path / "ckpt", .quiet = true, .metrics_dir = metrics}),
        doctest::Contains("DTRAIN_METRICS_DIR (or checkpoint_options::metrics_dir): rank 1 cannot "
                          "create"),
        dtrain::config_error);
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("checkpoint: 3 ranks save and restore, keep prunes, and the step counts on") {
  scratch_dir dir;
  const auto failures = on_ranks(3, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    std::int64_t own = 0;
    dtrain::checkpoint c(plane, {.dir = dir.path, .every = 2, .keep = 2, .quiet = true});
    state.add_to(c);
    c.add("own", own, dtrain::checkpoint_scope::per_rank);
    CHECK_FALSE(c.restore().has_value());
    for (int step = 1; step <= 6; ++step) {
      state.fill(static_cast<float>(step));
      own = rank * 100 + step;
      CHECK(c.step() == (step % 2 == 0));
    }
    // Another run of the same program: everything back as of step 6.
    toy_state again;
    std::int64_t own_again = -1;
    dtrain::checkpoint d(plane, {.dir = dir.path, .every = 2, .quiet = true});
    again.add_to(d);
    d.add("own", own_again, dtrain::checkpoint_scope::per_rank);
    CHECK(d.restore() == 6u);
    CHECK(d.steps() == 6u);
    CHECK(again.weight == state.weight);
    CHECK(again.bias == state.bias);
    CHECK(again.optimizer == "adam:6");
    CHECK(own_again == rank * 100 + 6);
  });
  for (const auto& f : failures) CHECK(f == "");
  CHECK(fs::exists(dir.path / "step-6" / "MANIFEST"));
  CHECK(fs::exists(dir.path / "step-6" / "rank-2.dtck"));
  CHECK(fs::exists(dir.path / "step-4"));
  CHECK_FALSE(fs::exists(dir.path / "step-2"));  // keep = 2
  std::vector<std::string> skipped;
  const auto found = dtrain::latest_checkpoint(dir.path, &skipped);
  REQUIRE(found.has_value());
  CHECK(found->step == 6u);
  CHECK(found->world_size == 3);
  CHECK(skipped.empty());
}

TEST_CASE(
    "checkpoint: hooks copy state in before each save and out after a restore, "
    "and a hook that throws fails the save on every rank") {
  scratch_dir dir;
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    // State that lives outside registered memory (as on a GPU): `outside`,
    // copied into `staged` before a save and back after a restore.
    std::vector<float> outside(5, 0.0f), staged(5, -1.0f);
    int saves = 0, restores = 0;
    bool fail_next = false;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    c.add("staged", staged, dtrain::checkpoint_scope::per_rank);
    c.add_hooks(
        [&] {
          ++saves;
          if (fail_next && rank == 1) throw std::runtime_error("the device is gone");
          staged = outside;
        },
        [&] {
          ++restores;
          outside = staged;
        });
    std::fill(outside.begin(), outside.end(), static_cast<float>(rank + 1));
    c.step();
    c.save();
    CHECK(saves == 1);
    CHECK(staged == outside);
    std::fill(outside.begin(), outside.end(), 42.0f);
    std::fill(staged.begin(), staged.end(), 0.0f);
    CHECK(c.restore() == 1u);
    CHECK(restores == 1);
    CHECK(outside == std::vector<float>(5, static_cast<float>(rank + 1)));
    // A hook that throws on rank 1: the save fails on both ranks, naming why.
    fail_next = true;
    c.step();
    try {
      c.save();
      CHECK(false);
    } catch (const dtrain::checkpoint_error& e) {
      const std::string what = e.what();
      CHECK(what.find(rank == 1 ? "the device is gone" : "rank(s) 1") != std::string::npos);
    }
    CHECK(dtrain::latest_checkpoint(dir.path)->step == 1u);  // step 2 was not committed
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("checkpoint format: a copy cut among threads is the same bytes, across jobs") {
  // Jobs of uneven sizes (one empty), 3.5 MiB in all: ranges cross jobs.
  std::vector<std::vector<unsigned char>> from, to;
  for (const std::size_t bytes : {std::size_t{1} << 20, std::size_t{0}, std::size_t{1234567},
                                  std::size_t{3} << 19, std::size_t{17}}) {
    std::vector<unsigned char> v(bytes);
    for (std::size_t i = 0; i < bytes; ++i)
      v[i] = static_cast<unsigned char>((i * 131 + bytes) % 251);
    from.push_back(std::move(v));
  }
  for (const int threads : {1, 2, 3, 8}) {
    to.assign(from.size(), {});
    std::vector<ckpt::copy_job> jobs;
    for (std::size_t j = 0; j < from.size(); ++j) {
      to[j].assign(from[j].size(), 0);
      jobs.push_back({to[j].data(), from[j].data(), from[j].size()});
    }
    ckpt::copy_parallel(jobs, threads);
    CAPTURE(threads);
    CHECK(to == from);
  }
  ckpt::staging staged;
  void* first = staged.reserve(100);
  CHECK(staged.reserve(50) == first);  // kept for a smaller or equal copy
  CHECK(staged.reserve(100) == first);
  CHECK(staged.reserve(101) != nullptr);
}

TEST_CASE("checkpoint: an asynchronous save holds the state of its step and commits later") {
  scratch_dir dir;
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    std::int64_t own = 0;
    // Its copy on 3 threads: 3 MiB, cut in 3 ranges (rank 0's is checked below).
    std::vector<float> big(std::size_t{3} << 18);
    {
      dtrain::checkpoint c(
          plane,
          {.dir = dir.path, .every = 2, .quiet = true, .asynchronous = true, .copy_threads = 3});
      state.add_to(c);
      c.add("own", own, dtrain::checkpoint_scope::per_rank);
      c.add("big", big, dtrain::checkpoint_scope::per_rank);
      for (int step = 1; step <= 4; ++step) {
        state.fill(static_cast<float>(step));
        own = rank + 10 * step;
        for (std::size_t i = 0; i < big.size(); ++i)
          big[i] = static_cast<float>(i % 1000) + static_cast<float>(step * rank);
        c.step();
      }
      CHECK(c.timings().saves == 2u);
      CHECK(c.timings().blocked_seconds >= c.timings().copy_seconds);
      CHECK(c.timings().copy_seconds > 0.0);
      std::fill(big.begin(), big.end(), -1.0f);
      // Training goes on while step 4 is written: what changes now is not in it.
      state.fill(99);
      own = -1;
      if (rank == 0) CHECK(dtrain::latest_checkpoint(dir.path)->step == 2u);  // 4 is in flight
    }                                                                         // committed here
    toy_state back;
    std::int64_t own_back = 0;
    std::vector<float> big_back(big.size());
    dtrain::checkpoint d(plane, {.dir = dir.path, .quiet = true});
    back.add_to(d);
    d.add("own", own_back, dtrain::checkpoint_scope::per_rank);
    d.add("big", big_back, dtrain::checkpoint_scope::per_rank);
    CHECK(d.restore() == 4u);
    CHECK(back.optimizer == "adam:4");
    CHECK(back.weight[1] == 5.0f);
    CHECK(own_back == rank + 40);
    bool same = true;
    for (std::size_t i = 0; i < big_back.size(); ++i)
      same = same && big_back[i] == static_cast<float>(i % 1000) + static_cast<float>(4 * rank);
    CHECK(same);
  });
  for (const auto& f : failures) CHECK(f == "");
}

namespace {
/// Rank `rank` of `size`'s cut of a whole of `total` elements: two ranges
/// each (its block's two halves, stored the second half first, after `skip`
/// unused elements), so that cuts of different world sizes overlap unevenly.
std::vector<dtrain::shard_range> cut(int rank, int size, std::uint64_t total, std::uint64_t skip) {
  const auto r = static_cast<std::uint64_t>(rank), n = static_cast<std::uint64_t>(size);
  const std::uint64_t lo = total * r / n, hi = total * (r + 1) / n, mid = (lo + hi) / 2;
  return {{.global = mid, .local = skip, .count = hi - mid},
          {.global = lo, .local = skip + (hi - mid), .count = mid - lo}};
}
float whole_value(std::uint64_t g) { return 0.5f * static_cast<float>(g) + 3.0f; }
}  // namespace

TEST_CASE("checkpoint: a sharded entry is re-cut for another world size, by every rank's part") {
  scratch_dir dir;
  constexpr std::uint64_t total = 1001;
  // Saved by 3 ranks, each also with a replicated entry; restored by 3, 2 and 4.
  auto failures = on_ranks(3, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> mine(5 + total / 3 + 1, -1.0f);
    const auto ranges = cut(rank, 3, total, 5);
    for (const auto& r : ranges) {
      for (std::uint64_t k = 0; k < r.count; ++k) mine[r.local + k] = whole_value(r.global + k);
    }
    std::int64_t counter = 42;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), ranges, total);
    c.add("counter", counter);
    c.save();
  });
  for (const auto& f : failures) CHECK(f == "");
  for (const int size : {3, 2, 4}) {
    CAPTURE(size);
    failures = on_ranks(size, [&](dtrain::control_plane plane, int rank) {
      const auto ranges = cut(rank, size, total, 2);
      std::vector<float> mine(2 + total / static_cast<std::uint64_t>(size) + 1, -7.0f);
      std::int64_t counter = 0;
      dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
      c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), ranges, total);
      c.add("counter", counter);
      CHECK(c.restore() == 0u);
      CHECK(counter == 42);
      bool same = true;
      for (const auto& r : ranges) {
        for (std::uint64_t k = 0; k < r.count; ++k)
          same = same && mine[r.local + k] == whole_value(r.global + k);
      }
      CHECK(same);
      CHECK(mine[0] == -7.0f);  // what no range names stays as it was
    });
    for (const auto& f : failures) CHECK(f == "");
  }
  // Saved by 2 ranks that each held the whole (overlapping ranges), restored by 3: each
  // element counts once.
  scratch_dir whole;
  failures = on_ranks(2, [&](dtrain::control_plane plane, int) {
    std::vector<float> all(total);
    for (std::uint64_t g = 0; g < total; ++g) all[g] = whole_value(g);
    dtrain::checkpoint c(plane, {.dir = whole.path, .quiet = true});
    c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(all)),
                  {{.global = 0, .local = 0, .count = total}}, total);
    c.save();
  });
  for (const auto& f : failures) CHECK(f == "");
  failures = on_ranks(3, [&](dtrain::control_plane plane, int rank) {
    const auto ranges = cut(rank, 3, total, 0);
    std::vector<float> mine(total / 3 + 1);
    dtrain::checkpoint c(plane, {.dir = whole.path, .quiet = true});
    c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), ranges, total);
    CHECK(c.restore() == 0u);
    bool same = true;
    for (const auto& r : ranges) {
      for (std::uint64_t k = 0; k < r.count; ++k)
        same = same && mine[r.local + k] == whole_value(r.global + k);
    }
    CHECK(same);
  });
  for (const auto& f : failures) CHECK(f == "");
  // A whole of another size, and ranges the checkpoint's ranks did not hold, are refused by name.
  failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> mine(total);
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), cut(rank, 2, total + 1, 0),
                  total + 1);
    std::int64_t counter = 0;
    c.add("counter", counter);
    CHECK_THROWS_WITH_AS(c.restore(), doctest::Contains("adam.m"), dtrain::checkpoint_error);
  });
  for (const auto& f : failures) CHECK(f == "");
  on_ranks(1, [&](dtrain::control_plane plane, int) {
    std::vector<float> mine(4);
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    CHECK_THROWS_WITH_AS(c.add_sharded("x", dtrain::host_buffer(std::span<float>(mine)),
                                       {{.global = 0, .local = 2, .count = 3}}, 10),
                         doctest::Contains("does not fit"), dtrain::config_error);
  });
}

TEST_CASE(
    "checkpoint: a re-cut reads only the old ranks' parts that hold this rank's elements, and "
    "each rank checks the files it loads") {
  namespace ckpt = dtrain::detail::ckpt;
  scratch_dir dir;
  constexpr std::uint64_t total = 1000;
  // Saved by 4 ranks at steps 1 and 2 (old rank r holds [250 r, 250 (r + 1))).
  auto failures = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> mine(total / 4);
    const auto ranges = cut(rank, 4, total, 0);
    std::int64_t counter = 0;
    dtrain::checkpoint c(plane, {.dir = dir.path, .every = 1, .keep = 2, .quiet = true});
    c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), ranges, total);
    c.add("counter", counter);
    for (int step = 1; step <= 2; ++step) {
      counter = step;
      for (const auto& r : ranges) {
        for (std::uint64_t k = 0; k < r.count; ++k)
          mine[r.local + k] = whole_value(r.global + k) + static_cast<float>(step);
      }
      c.step();
    }
  });
  for (const auto& f : failures) CHECK(f == "");
  // Step 2's part of old rank 3 is damaged in its values.
  const fs::path step2 = dir.path / "step-2";
  const fs::path damaged = step2 / ckpt::rank_part_name(3);
  flip_byte(damaged, fs::file_size(damaged) - 5);
  // Rank 0 of 2 ([0, 500)) reads the parts of old ranks 0 and 1 only, and
  // finds nothing wrong: it neither checks nor reads the damaged one. Rank 1
  // of 2 needs it, and says it is damaged.
  const ckpt::manifest m = ckpt::read_manifest(step2);
  const auto path_of = [&](const std::string& name) { return step2 / name; };
  for (const int rank : {0, 1}) {
    CAPTURE(rank);
    std::vector<float> mine(total / 2);
    std::int64_t counter = 0, steps = 0;
    ckpt::registry entries(rank, 1);  // as dtrain::checkpoint registers them
    entries.add_values("dtrain.step", {&steps, 1, dtrain::dtype::int64, dtrain::memory::host},
                       dtrain::checkpoint_scope::replicated, {});
    entries.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)),
                        cut(rank, 2, total, 0), total);
    entries.add_values("counter",
                       {&counter, sizeof counter, dtrain::dtype::uint8, dtrain::memory::host},
                       dtrain::checkpoint_scope::replicated, {});
    CHECK(entries.needs(step2 / ckpt::rank_part_name(2 * rank)));
    CHECK(entries.needs(step2 / ckpt::rank_part_name(2 * rank + 1)));
    CHECK_FALSE(entries.needs(step2 / ckpt::rank_part_name(2 * (1 - rank))));
    if (rank == 0) {
      const std::vector<fs::path> files = entries.check(m, path_of, step2, 2);
      CHECK(files == std::vector<fs::path>{step2 / ckpt::replicated_name,
                                           step2 / ckpt::rank_part_name(0),
                                           step2 / ckpt::rank_part_name(1)});
    } else {
      CHECK_THROWS_WITH_AS(static_cast<void>(entries.check(m, path_of, step2, 2)),
                           doctest::Contains((damaged.string() + " has checksum").c_str()),
                           ckpt::damaged_part);
    }
  }
  // A job of 2 skips step 2 for step 1 on every rank (rank 1 found it damaged);
  // so does a job of 4, whose rank 3 alone reads that part.
  for (const int size : {2, 4}) {
    CAPTURE(size);
    failures = on_ranks(size, [&](dtrain::control_plane plane, int rank) {
      const auto ranges = cut(rank, size, total, 0);
      std::vector<float> mine(total / static_cast<std::uint64_t>(size));
      std::int64_t counter = 0;
      dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
      c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), ranges, total);
      c.add("counter", counter);
      CHECK(c.restore() == 1u);
      CHECK(counter == 1);
      bool same = true;
      for (const auto& r : ranges) {
        for (std::uint64_t k = 0; k < r.count; ++k)
          same = same && mine[r.local + k] == whole_value(r.global + k) + 1.0f;
      }
      CHECK(same);
    });
    for (const auto& f : failures) CHECK(f == "");
  }
  // Every step damaged: none is loaded, nothing changed, and the restore
  // fails on every rank rather than start afresh (whose first save would
  // remove them), saying so.
  const fs::path step1_part = dir.path / "step-1" / ckpt::rank_part_name(0);
  flip_byte(step1_part, fs::file_size(step1_part) - 5);
  failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> mine(total / 2, -3.0f);
    std::int64_t counter = -3;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), cut(rank, 2, total, 0),
                  total);
    c.add("counter", counter);
    CHECK_THROWS_WITH_AS(static_cast<void>(c.restore()),
                         doctest::Contains("could be loaded (the newest is step-2"),
                         dtrain::checkpoint_error);
    CHECK(counter == -3);
    CHECK(std::ranges::count(mine, -3.0f) == static_cast<std::ptrdiff_t>(mine.size()));
  });
  for (const auto& f : failures) CHECK(f == "");
  CHECK(fs::exists(dir.path / "step-1"));
  CHECK(fs::exists(dir.path / "step-2"));
}

TEST_CASE(
    "ddp agreement: rank 0's values reach every rank through windows smaller than a parameter") {
  // (Here for its ranks over a store: DDP's construction broadcasts so, 64 MiB at a time.)
  const auto failures = on_ranks(3, [&](dtrain::control_plane plane, int rank) {
    std::vector<std::vector<float>> values = {std::vector<float>(5), std::vector<float>(1),
                                              std::vector<float>(13)};
    std::vector<double> buffer(3);
    auto fill = [&](int who) {
      float x = static_cast<float>(who) * 100.0f;
      for (auto& v : values) {
        for (float& f : v) f = x++;
      }
      for (double& d : buffer) d = x++;
    };
    fill(rank);
    std::vector<dtrain::parameter> params, buffers;
    for (std::size_t p = 0; p < values.size(); ++p) {
      std::string name = "p";  // (not "p" + to_string: GCC 12's -Wrestrict misfires at -O2)
      name += std::to_string(p);
      params.push_back(dtrain::param(name, values[p]));
    }
    buffers.push_back(dtrain::param("b", buffer));
    for (const std::size_t window : {std::size_t{7}, std::size_t{1}, std::size_t{1000}}) {
      fill(rank);
      dtrain::detail::broadcast_values(
          plane, params, buffers, [](const dtrain::buffer&) {}, window);
      const auto got_values = values;
      const auto got_buffer = buffer;
      fill(0);
      CHECK(got_values == values);
      CHECK(got_buffer == buffer);
    }
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("checkpoint: a damaged newest checkpoint is skipped, by name, for the one before") {
  for (const bool truncate : {true, false}) {
    scratch_dir dir;
    const auto failures = on_ranks(1, [&](dtrain::control_plane plane, int) {
      toy_state state;
      dtrain::checkpoint c(plane, {.dir = dir.path, .every = 1, .quiet = true});
      state.add_to(c);
      state.fill(1);
      c.step();
      state.fill(2);
      c.step();
    });
    REQUIRE(failures[0] == "");
    const fs::path newest = dir.path / "step-2" / "replicated.dtck";
    if (truncate) {
      fs::resize_file(newest, fs::file_size(newest) - 1);
    } else {
      flip_byte(newest, fs::file_size(newest) - 3);
    }
    std::vector<std::string> skipped;
    const auto found = dtrain::latest_checkpoint(dir.path, &skipped);
    REQUIRE(found.has_value());
    CHECK(found->step == 1u);
    REQUIRE(skipped.size() == 1);
    CHECK(skipped[0].find(newest.string()) != std::string::npos);
    CHECK(skipped[0].find(truncate ? "truncated" : "corrupt") != std::string::npos);
    on_ranks(1, [&](dtrain::control_plane plane, int) {
      toy_state state;
      dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
      state.add_to(c);
      CHECK(c.restore() == 1u);
      CHECK(state.optimizer == "adam:1");
      // Saving step 2 again replaces the damaged one.
      state.fill(5);
      c.step();
      c.save();
    });
    CHECK(dtrain::latest_checkpoint(dir.path)->step == 2u);
  }
}

TEST_CASE("checkpoint: another model is refused by name, on every rank, and nothing changes") {
  scratch_dir dir;
  on_ranks(2, [&](dtrain::control_plane plane, int) {
    toy_state state;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    state.add_to(c);
    state.fill(3);
    c.save();
  });
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    state.weight.resize(65);  // another model
    state.fill(9);
    const toy_state before = state;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    state.add_to(c);
    std::vector<float> extra(2);
    if (rank == 1) c.add("extra", extra);  // and rank 1 registers more
    try {
      c.restore();
    } catch (...) {
      CHECK(state.weight == before.weight);
      CHECK(state.optimizer == before.optimizer);
      throw;
    }
  });
  CHECK(failures[0].find("'weight' is 64 float32 in the checkpoint and 65 float32 here") !=
        std::string::npos);
  CHECK(failures[1].find("'extra' is registered here and not in the checkpoint") !=
        std::string::npos);
}

TEST_CASE(
    "checkpoint: per-rank state from another world size is refused, and replicated state loads") {
  scratch_dir dir;
  on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    std::int64_t own = rank;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    state.add_to(c);
    c.add("own", own, dtrain::checkpoint_scope::per_rank);
    state.fill(4);
    c.save();
  });
  auto failures = on_ranks(3, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    std::int64_t own = rank;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    state.add_to(c);
    c.add("own", own, dtrain::checkpoint_scope::per_rank);
    c.restore();
  });
  for (const auto& f : failures) {
    CHECK(f.find("written by 2 ranks and this job has 3") != std::string::npos);
    CHECK(f.find("'own'") != std::string::npos);
  }
  failures = on_ranks(3, [&](dtrain::control_plane plane, int) {
    toy_state state;
    dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
    state.add_to(c);
    CHECK(c.restore() == 0u);
    CHECK(state.optimizer == "adam:4");
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE(
    "checkpoint: a directory that cannot be written is an error naming it, and earlier ones stay") {
  scratch_dir dir;
  { std::ofstream(dir.path / "a-file") << "x"; }
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int) {
    toy_state state;
    dtrain::checkpoint c(plane, {.dir = dir.path / "a-file" / "ckpt", .quiet = true});
    state.add_to(c);
    c.save();
  });
  CHECK(failures[0].find((dir.path / "a-file" / "ckpt").string()) != std::string::npos);
  CHECK(failures[1].find((dir.path / "a-file" / "ckpt").string()) != std::string::npos);

  // A rank whose part cannot be written: nothing is committed, the older step stays.
  on_ranks(2, [&](dtrain::control_plane plane, int) {
    toy_state state;
    dtrain::checkpoint c(plane, {.dir = dir.path / "ok", .quiet = true});
    state.add_to(c);
    c.save();
  });
  const auto partly = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    dtrain::checkpoint c(plane, {.dir = dir.path / "ok", .quiet = true});
    state.add_to(c);
    // Rank 1's own state cannot be serialised: its part is not written.
    c.add(
        "own",
        [rank]() -> std::string {
          if (rank == 1) throw dtrain::checkpoint_error("rank 1's loader state is broken");
          return "fine";
        },
        [](std::string_view) {}, dtrain::checkpoint_scope::per_rank);
    c.step();
    c.save();
  });
  CHECK(partly[0].find("rank(s) 1 could not write their part") != std::string::npos);
  CHECK(partly[1].find("loader state is broken") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.path / "ok" / "step-1"));
  CHECK_FALSE(fs::exists(dir.path / "ok" / "step-1.partial"));
  CHECK(dtrain::latest_checkpoint(dir.path / "ok")->step == 0u);
}

TEST_CASE("checkpoint: bad options are config errors") {
  on_ranks(1, [&](dtrain::control_plane plane, int) {
    CHECK_THROWS_AS(dtrain::checkpoint(plane, {}), dtrain::config_error);
    CHECK_THROWS_WITH_AS(dtrain::checkpoint(plane, {.dir = "x", .keep = 0}),
                         doctest::Contains("keep is 0"), dtrain::config_error);
    CHECK_THROWS_WITH_AS(dtrain::checkpoint(plane, {.dir = "x", .copy_threads = -1}),
                         doctest::Contains("copy_threads is -1"), dtrain::config_error);
    dtrain::checkpoint c(plane, {.dir = "x"});
    std::vector<float> v(3);
    c.add("v", v);
    CHECK_THROWS_WITH_AS(c.add("v", v), doctest::Contains("'v' is added twice"),
                         dtrain::config_error);
  });
}

TEST_CASE(
    "checkpoint: a loss scaler's state is saved and restored, and a bad one is refused by name") {
  scratch_dir dir;
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int) {
    dtrain::loss_scaler scaler({.init_scale = 3.0 / 7.0, .growth_interval = 7});
    // Two updates: one skipped step, one clean (the state a fp16 job carries).
    struct stand_in {
      bool inf = true;
      std::vector<dtrain::parameter> none;
      std::vector<dtrain::shard_piece> pieces;
      int rank() const { return 0; }
      double gradient_norm() const { return inf ? std::numeric_limits<double>::infinity() : 1.0; }
      bool any_rank(bool mine) const { return mine; }
      const std::vector<dtrain::parameter>& parameters() const { return none; }
      const std::vector<dtrain::shard_piece>& shard() const { return pieces; }
    } ddp;
    CHECK_FALSE(scaler.unscale(ddp));
    scaler.update();
    ddp.inf = false;
    CHECK(scaler.unscale(ddp));
    scaler.update();
    {
      dtrain::checkpoint c(plane, {.dir = dir.path, .quiet = true});
      c.add(scaler);
      c.step();
      c.save();
    }
    dtrain::loss_scaler again;
    dtrain::checkpoint d(plane, {.dir = dir.path, .quiet = true});
    d.add(again);
    CHECK(d.restore() == 1u);
    CHECK(again.state() == scaler.state());
    CHECK(again.scale() == scaler.scale());
    CHECK(again.skipped_steps() == 1u);
    CHECK(again.growth_tracker() == 1u);
  });
  for (const auto& f : failures) CHECK(f == "");

  // A checkpoint whose "loss_scaler" entry is not a scaler's state.
  scratch_dir bad;
  const auto refused = on_ranks(2, [&](dtrain::control_plane plane, int) {
    {
      dtrain::checkpoint c(plane, {.dir = bad.path, .quiet = true});
      c.add(
          "loss_scaler", [] { return std::string("dtrain.loss_scaler 1 scale nan"); },
          [](std::string_view) {});
      c.step();
      c.save();
    }
    dtrain::loss_scaler scaler;
    const std::string before = scaler.state();
    dtrain::checkpoint d(plane, {.dir = bad.path, .quiet = true});
    d.add(scaler);
    try {
      static_cast<void>(d.restore());
      CHECK(false);
    } catch (const dtrain::error& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find("entry 'loss_scaler'") != std::string::npos);
      CHECK(what.find("is not a loss scaler's") != std::string::npos);
    }
    CHECK(scaler.state() == before);
  });
  for (const auto& f : refused) CHECK(f == "");
}

namespace {
/// 4 ranks on 2 "nodes" (a memory directory each, as two node agents would
/// make), a memory copy every step and a disk checkpoint every 4: trains
/// `steps` steps, then restores in a new checkpoint object; returns what each
/// rank's restore() gave (-1: none) and checks the state matches that step.
/// `buddy(rank)`: the rank's checkpoint_options::memory_buddy.
std::vector<std::int64_t> memory_tier_run(const fs::path& disk, const fs::path& memory, int steps,
                                          const std::function<void()>& between = {},
                                          bool asynchronous = false,
                                          const std::function<std::string(int)>& buddy = {}) {
  std::vector<std::int64_t> restored(4, -2);
  auto failures = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    std::int64_t own = 0;
    const fs::path node = memory / ("node" + std::to_string(rank / 2));
    dtrain::checkpoint c(plane, {.dir = disk,
                                 .every = 4,
                                 .quiet = true,
                                 .asynchronous = asynchronous,
                                 .memory_every = 1,
                                 .memory_dir = node,
                                 .memory_buddy = buddy ? buddy(rank) : std::string()});
    state.add_to(c);
    c.add("own", own, dtrain::checkpoint_scope::per_rank);
    for (int step = 1; step <= steps; ++step) {
      state.fill(static_cast<float>(step));
      own = rank * 100 + step;
      c.step();
    }
  });
  for (const auto& f : failures) CHECK(f == "");
  if (between) between();
  failures = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
    toy_state again;
    std::int64_t own = -1;
    const fs::path node = memory / ("node" + std::to_string(rank / 2));
    dtrain::checkpoint d(plane, {.dir = disk,
                                 .every = 4,
                                 .quiet = true,
                                 .memory_every = 1,
                                 .memory_dir = node,
                                 .memory_buddy = buddy ? buddy(rank) : std::string()});
    again.add_to(d);
    d.add("own", own, dtrain::checkpoint_scope::per_rank);
    const auto step = d.restore();
    restored[static_cast<std::size_t>(rank)] = step ? static_cast<std::int64_t>(*step) : -1;
    if (step) {
      CHECK(again.optimizer == "adam:" + std::to_string(*step));
      CHECK(own == rank * 100 + static_cast<std::int64_t>(*step));
    }
  });
  for (const auto& f : failures) CHECK(f == "");
  return restored;
}
}  // namespace

namespace {
/// 4 ranks on 2 "nodes" (memory.path/node0, node1) train 6 steps of a toy
/// state, all of it replicated: a memory copy every step, the disk every 4.
void train_replicated_on_two_nodes(const fs::path& disk, const fs::path& memory) {
  const auto trained = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
    toy_state state;
    dtrain::checkpoint c(plane, {.dir = disk,
                                 .every = 4,
                                 .quiet = true,
                                 .memory_every = 1,
                                 .memory_dir = memory / ("node" + std::to_string(rank / 2))});
    state.add_to(c);
    for (int step = 1; step <= 6; ++step) {
      state.fill(static_cast<float>(step));
      c.step();
    }
  });
  for (const auto& f : trained) CHECK(f == "");
}
}  // namespace

TEST_CASE("checkpoint: the memory tier resumes from each node's copy, and reads nothing on disk") {
  scratch_dir disk, memory;
  // Step 6 is in memory, step 4 the newest on disk: the disk's files are
  // damaged, so a restore that read them would fail.
  const auto restored = memory_tier_run(disk.path, memory.path, 6, [&] {
    for (const auto& file : fs::directory_iterator(disk.path / "step-4")) {
      fs::resize_file(file.path(), 1);
    }
  });
  CHECK(restored == std::vector<std::int64_t>(4, 6));
  // Each rank keeps its own copies, the 2 newest (each with its slice of the
  // replicated part, its node's k-th rank slice k), each with its manifest,
  // in its node's directory.
  CHECK(fs::exists(memory.path / "node0" / "step-6.rank-1" / "rank-1.dtck"));
  CHECK(slice_in(memory.path / "node0" / "step-6.rank-0") == "replicated.0-of-2");
  CHECK(slice_in(memory.path / "node0" / "step-6.rank-1") == "replicated.1-of-2");
  CHECK_FALSE(fs::exists(memory.path / "node0" / "step-6.rank-0" / "replicated.dtck"));
  CHECK(fs::exists(memory.path / "node1" / "step-6.rank-3" / "MANIFEST"));
  CHECK(slice_in(memory.path / "node1" / "step-6.rank-2") == "replicated.0-of-2");
  CHECK(fs::exists(memory.path / "node1" / "step-5.rank-3" / "MANIFEST"));
  CHECK_FALSE(fs::exists(memory.path / "node1" / "step-4.rank-3"));
  CHECK_FALSE(fs::exists(memory.path / "node0" / "step-6.rank-2"));
}

TEST_CASE("checkpoint: asynchronous memory copies are written beside the steps, whole") {
  scratch_dir disk, memory;
  CHECK(memory_tier_run(disk.path, memory.path, 7, {}, true) == std::vector<std::int64_t>(4, 7));
  CHECK(slice_in(memory.path / "node1" / "step-7.rank-2") == "replicated.0-of-2");
}

namespace {
/// The memory copy rank `rank` commits of `step` (each rank its own "node" here).
fs::path memory_copy(const fs::path& memory, int rank, int step) {
  return memory / ("node" + std::to_string(rank)) /
         ("step-" + std::to_string(step) + ".rank-" + std::to_string(rank));
}

/// Restores 2 ranks from `disk` and `memory` (node<rank>) with a state of
/// `large` floats and a counter; returns each rank's step, weight[0] and counter.
std::vector<std::array<double, 3>> restore_beside(const fs::path& disk, const fs::path& memory,
                                                  std::size_t large, int ranks) {
  std::vector<std::array<double, 3>> got(static_cast<std::size_t>(ranks));
  const auto failures = on_ranks(ranks, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> weight(large, -1.0f);
    std::int64_t counter = -1;
    dtrain::checkpoint c(plane, {.dir = disk,
                                 .quiet = true,
                                 .memory_every = 1,
                                 .memory_dir = memory / ("node" + std::to_string(rank))});
    c.add("weight", weight).add("counter", counter, dtrain::checkpoint_scope::per_rank);
    const auto step = c.restore();
    const bool same = std::ranges::all_of(weight, [&](float w) { return w == weight.front(); });
    CHECK(same);
    got[static_cast<std::size_t>(rank)] = {step ? static_cast<double>(*step) : -1.0, weight.front(),
                                           static_cast<double>(counter)};
  });
  for (const auto& f : failures) CHECK(f == "");
  return got;
}

/// A checkpoint's options with a memory copy every step, in node<rank> of
/// `memory`, read beside the step.
dtrain::checkpoint_options beside_options(const fs::path& disk, const fs::path& memory, int rank) {
  return {.dir = disk,
          .quiet = true,
          .memory_every = 1,
          .memory_beside_step = true,
          .memory_dir = memory / ("node" + std::to_string(rank))};
}
}  // namespace

TEST_CASE("checkpoint: a memory copy read beside the step holds the state step() saw") {
  scratch_dir disk, memory;
  constexpr std::size_t large = 32768;  // 128 KiB of floats: read where it lives, beside the step
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> weight(large);
    std::int64_t counter = 0;  // 8 bytes: copied in step()
    dtrain::checkpoint c(plane, beside_options(disk.path, memory.path, rank));
    c.add("weight", weight).add("counter", counter, dtrain::checkpoint_scope::per_rank);
    for (int step = 1; step <= 4; ++step) {
      std::ranges::fill(weight, static_cast<float>(step));  // the optimizer's step
      counter = step;
      c.step();
      // The next step's forward changes the small state at once: its copy was taken.
      counter = -step;
      // Nothing is sealed before the word: the copy's reader may still be reading.
      std::this_thread::sleep_for(20ms);
      CHECK_FALSE(fs::exists(memory_copy(memory.path, rank, step) / "MANIFEST"));
      if (step > 1) CHECK(fs::exists(memory_copy(memory.path, rank, step - 1) / "MANIFEST"));
      c.before_update();  // then the state may change
    }
    c.wait();
    CHECK(fs::exists(memory_copy(memory.path, rank, 4) / "MANIFEST"));
    CHECK(c.memory_failures() == 0);
  });
  for (const auto& f : failures) CHECK(f == "");
  const auto got = restore_beside(disk.path, memory.path, large, 2);
  for (const auto& g : got) CHECK(g == std::array<double, 3>{4, 4, 4});
}

TEST_CASE(
    "checkpoint: a step saved to disk writes its memory copy within step(), not beside the next "
    "step") {
  scratch_dir disk, memory;
  constexpr std::size_t large = 32768;  // read where it lives, beside the step, at other steps
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    std::vector<float> weight(large);
    std::int64_t counter = 0;
    dtrain::checkpoint_options o = beside_options(disk.path, memory.path, rank);
    o.every = 2;
    dtrain::checkpoint c(plane, o);
    c.add("weight", weight).add("counter", counter, dtrain::checkpoint_scope::per_rank);
    for (int step = 1; step <= 3; ++step) {
      std::ranges::fill(weight, static_cast<float>(step));
      counter = step;
      const bool to_disk = c.step();
      CHECK(to_disk == (step == 2));
      // Step 2's copy is committed as step() returns (a rank killed in the
      // disk's save or the next step resumes from it); the others' wait for
      // before_update().
      std::this_thread::sleep_for(20ms);
      CHECK(fs::exists(memory_copy(memory.path, rank, step) / "MANIFEST") == to_disk);
      c.before_update();  // due at every step all the same
    }
    c.wait();
    CHECK(c.memory_failures() == 0);
  });
  for (const auto& f : failures) CHECK(f == "");
  const auto got = restore_beside(disk.path, memory.path, large, 2);
  for (const auto& g : got) CHECK(g == std::array<double, 3>{3, 3, 3});
  // With every step saved to disk, no copy is read beside a step, and a
  // missing before_update() is refused all the same.
  scratch_dir disk2, memory2;
  const auto refused = on_ranks(1, [&](dtrain::control_plane plane, int) {
    std::vector<float> weight(large);
    dtrain::checkpoint_options o = beside_options(disk2.path, memory2.path, 0);
    o.every = 1;
    dtrain::checkpoint c(plane, o);
    c.add("weight", weight);
    c.step();
    CHECK(fs::exists(memory_copy(memory2.path, 0, 1) / "MANIFEST"));
    CHECK_THROWS_WITH_AS(c.step(), doctest::Contains("no before_update() came before this step()"),
                         dtrain::config_error);
  });
  CHECK(refused == std::vector<std::string>{""});
}

TEST_CASE("checkpoint: a memory copy read beside the step with no before_update() is refused") {
  scratch_dir disk, memory;
  constexpr std::size_t large = 32768;
  const auto failures = on_ranks(1, [&](dtrain::control_plane plane, int) {
    std::vector<float> weight(large);
    std::int64_t counter = 0;
    dtrain::checkpoint c(plane, beside_options(disk.path, memory.path, 0));
    c.add("weight", weight).add("counter", counter, dtrain::checkpoint_scope::per_rank);
    for (int step = 1; step <= 3; ++step) {
      std::ranges::fill(weight, static_cast<float>(step));
      counter = step;
      c.step();
      if (step < 3) c.before_update();
    }
    // Step 3's copy had no word: the state changes under its reader.
    std::ranges::fill(weight, 99.0f);
    CHECK_THROWS_WITH_AS(c.step(),
                         doctest::Contains("no before_update() came before this step(): call "
                                           "ckpt.before_update() before the state changes"),
                         dtrain::config_error);
    CHECK(c.memory_failures() == 1);
    CHECK(c.steps() == 3);
    CHECK_FALSE(fs::exists(memory_copy(memory.path, 0, 3)));
    // The same for a save into memory called by hand.
    c.save_to_memory();
    CHECK_THROWS_WITH_AS(c.save_to_memory(), doctest::Contains("before this save_to_memory()"),
                         dtrain::config_error);
  });
  CHECK(failures == std::vector<std::string>{""});
  // Step 2's copy is the newest: step 3's was not used.
  const auto got = restore_beside(disk.path, memory.path, large, 1);
  CHECK(got.front() == std::array<double, 3>{2, 2, 2});
  // The option needs a memory copy to read.
  const auto refused = on_ranks(1, [&](dtrain::control_plane plane, int) {
    dtrain::checkpoint c(plane, {.dir = disk.path, .memory_beside_step = true});
  });
  CHECK(refused.front().find("memory_beside_step is set and memory_every is 0") !=
        std::string::npos);
}

TEST_CASE(
    "checkpoint: a small state's memory copy beside the step commits without waiting, and the "
    "missing before_update() is refused all the same") {
  scratch_dir disk, memory;
  const auto failures = on_ranks(1, [&](dtrain::control_plane plane, int) {
    std::vector<float> weight(16);  // every entry under 64 KiB: copied at step()
    std::int64_t counter = 0;
    dtrain::checkpoint c(plane, beside_options(disk.path, memory.path, 0));
    c.add("weight", weight).add("counter", counter, dtrain::checkpoint_scope::per_rank);
    std::ranges::fill(weight, 1.0f);
    counter = 1;
    c.step();
    // Nothing is read where it lives: the copy commits with no word from the
    // training (within 10 s; a copy that waited for before_update() never would).
    const fs::path manifest = memory_copy(memory.path, 0, 1) / "MANIFEST";
    for (int i = 0; i < 1000 && !fs::exists(manifest); ++i) std::this_thread::sleep_for(10ms);
    CHECK(fs::exists(manifest));
    std::ranges::fill(weight, 99.0f);
    counter = 99;
    // The program that forgot before_update() is told now, not once its state grows.
    std::string said;
    try {
      c.step();
    } catch (const dtrain::config_error& e) {
      said = e.what();
    }
    CHECK(said.find("no before_update() came before this step()") != std::string::npos);
    CHECK(said.find("not used") == std::string::npos);  // the copy read nothing that changed
    CHECK(c.memory_failures() == 0);
    CHECK(c.steps() == 1);
    // Said once: with the call, the steps go on.
    c.before_update();
    c.step();
    c.before_update();
    c.step();
    c.wait();
    CHECK(c.steps() == 3);
  });
  CHECK(failures == std::vector<std::string>{""});
  // Step 3's copy holds what step() saw.
  const auto got = restore_beside(disk.path, memory.path, 16, 1);
  CHECK(got.front() == std::array<double, 3>{3, 99, 99});
}

TEST_CASE("checkpoint: a memory copy is written over the one set aside, whole at its new length") {
  scratch_dir disk, memory;
  // A per-rank entry of bytes whose length changes from step to step: long
  // at odd steps, short at even ones.
  auto text_of = [](int step) {
    return std::string(step % 2 == 1 ? 5000 : 50, static_cast<char>('a' + step));
  };
  auto inode = [](const fs::path& file) {
    struct ::stat st {};
    REQUIRE(::stat(file.c_str(), &st) == 0);
    return st.st_ino;
  };
  // body(checkpoint, its entry) on rank 0 of a 1-rank job; true when it threw nothing.
  auto on_rank = [&](const std::function<void(dtrain::checkpoint&, std::string&)>& body) {
    return on_ranks(1, [&](dtrain::control_plane plane, int) {
             std::string text;
             dtrain::checkpoint c(
                 plane,
                 {.dir = disk.path, .quiet = true, .memory_every = 1, .memory_dir = memory.path});
             c.add(
                 "text", [&] { return text; }, [&](std::string_view b) { text = b; },
                 dtrain::checkpoint_scope::per_rank);
             body(c, text);
           }).front() == "";
  };
  const fs::path spare = memory.path / "spare.rank-0";
  CHECK(on_rank([&](dtrain::checkpoint& c, std::string& text) {
    for (int step = 1; step <= 3; ++step) {
      text = text_of(step);
      c.step();
    }
    // Steps 3 and 2 kept; step 1's copy set aside, without being read as one.
    CHECK(fs::exists(memory.path / "step-3.rank-0" / "MANIFEST"));
    CHECK(fs::exists(memory.path / "step-2.rank-0" / "MANIFEST"));
    CHECK_FALSE(fs::exists(memory.path / "step-1.rank-0"));
    REQUIRE(fs::exists(spare / "rank-0.dtck"));
    const auto pages = inode(spare / "rank-0.dtck");
    const auto long_size = fs::file_size(spare / "rank-0.dtck");
    text = text_of(4);
    c.step();
    // Step 4 went into step 1's file, cut to its own (shorter) length, and
    // step 2's copy is the one set aside now.
    const fs::path written = memory.path / "step-4.rank-0" / "rank-0.dtck";
    CHECK(inode(written) == pages);
    CHECK(fs::file_size(written) < long_size);
    CHECK(fs::exists(spare / "rank-0.dtck"));
    CHECK_FALSE(fs::exists(memory.path / "step-2.rank-0"));
    for (int step = 5; step <= 6; ++step) {
      text = text_of(step);
      c.step();
    }
  }));
  // Each copy written over another loads whole, at its own length.
  for (const int drop : {0, 6}) {
    if (drop > 0) fs::remove_all(memory.path / ("step-" + std::to_string(drop) + ".rank-0"));
    CHECK(on_rank([&](dtrain::checkpoint& d, std::string& text) {
      const auto step = d.restore();
      REQUIRE(step);
      CHECK(*step == static_cast<std::uint64_t>(drop > 0 ? 5 : 6));
      CHECK(text == text_of(static_cast<int>(*step)));
    }));
  }
  // The copy set aside is never read as one: with the two copies gone, there is none.
  fs::remove_all(memory.path / "step-5.rank-0");
  REQUIRE(fs::exists(spare / "MANIFEST"));
  CHECK(on_rank([&](dtrain::checkpoint& d, std::string&) { CHECK_FALSE(d.restore()); }));
}

TEST_CASE("checkpoint: a rank whose newest memory copy is torn resumes all at the step before") {
  scratch_dir disk, memory;
  const auto restored = memory_tier_run(disk.path, memory.path, 6, [&] {
    fs::resize_file(memory.path / "node0" / "step-6.rank-1" / "rank-1.dtck", 10);
  });
  CHECK(restored == std::vector<std::int64_t>(4, 5));
}

TEST_CASE("checkpoint: a memory copy lost, torn or older than the disk's is not used") {
  SUBCASE("a node lost its copies: the disk's") {
    scratch_dir disk, memory;
    const auto restored =
        memory_tier_run(disk.path, memory.path, 6, [&] { fs::remove_all(memory.path / "node1"); });
    CHECK(restored == std::vector<std::int64_t>(4, 4));
  }
  SUBCASE("every node lost its copies: the disk's") {
    scratch_dir disk, memory;
    const auto restored = memory_tier_run(disk.path, memory.path, 6, [&] {
      fs::remove_all(memory.path / "node0");
      fs::remove_all(memory.path / "node1");
    });
    CHECK(restored == std::vector<std::int64_t>(4, 4));
  }
  SUBCASE("both copies of a rank torn: the disk's") {
    scratch_dir disk, memory;
    const auto restored = memory_tier_run(disk.path, memory.path, 6, [&] {
      fs::resize_file(memory.path / "node1" / "step-6.rank-3" / "rank-3.dtck", 10);
      fs::remove(memory.path / "node1" / "step-5.rank-3" / "MANIFEST");
    });
    CHECK(restored == std::vector<std::int64_t>(4, 4));
  }
  SUBCASE("older than the disk's: the disk's") {
    scratch_dir disk, memory;
    // A copy every 3 steps, the disk every 4: after 8 steps, memory holds 6, the disk 8.
    std::vector<std::int64_t> restored;
    on_ranks(2, [&](dtrain::control_plane plane, int) {
      toy_state state;
      dtrain::checkpoint c(plane, {.dir = disk.path,
                                   .every = 4,
                                   .quiet = true,
                                   .memory_every = 3,
                                   .memory_dir = memory.path});
      state.add_to(c);
      for (int step = 1; step <= 8; ++step) {
        state.fill(static_cast<float>(step));
        c.step();
      }
    });
    const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int) {
      toy_state again;
      dtrain::checkpoint d(
          plane, {.dir = disk.path, .quiet = true, .memory_every = 3, .memory_dir = memory.path});
      again.add_to(d);
      CHECK(d.restore() == 8u);
      CHECK(again.optimizer == "adam:8");
    });
    for (const auto& f : failures) CHECK(f == "");
    CHECK(fs::exists(memory.path / "step-6.rank-1" / "MANIFEST"));
  }
}

TEST_CASE("checkpoint: a replaced node's ranks take their per-rank copies from their buddy") {
  // As dtrun's agents do: each node's agent serves a store that holds the
  // copies of the node before it (2 nodes: each the other's buddy).
  const dtrain::store_options options{.timeout = 20s, .log = [](std::string_view) {}};
  std::optional<dtrain::store_server> holds_node0, holds_node1;
  holds_node0.emplace("127.0.0.1", 0, options);  // node 1's agent's
  holds_node1.emplace("127.0.0.1", 0, options);  // node 0's agent's
  auto buddy = [&](int rank) {
    return "127.0.0.1:" + std::to_string((rank / 2 == 0 ? holds_node0 : holds_node1)->port());
  };
  auto held = [&](std::optional<dtrain::store_server>& server, const std::string& key) {
    dtrain::store_client client("127.0.0.1", server->port(), options);
    return client.check(std::span<const std::string>(&key, 1));
  };
  auto damage_disk = [](const fs::path& disk) {
    for (const auto& file : fs::directory_iterator(disk / "step-4"))
      fs::resize_file(file.path(), 1);  // a restore that read the disk would fail
  };
  scratch_dir disk, memory;
  SUBCASE("node 1 lost and replaced: its ranks resume from their buddy's copies") {
    const auto restored = memory_tier_run(
        disk.path, memory.path, 6,
        [&] {
          // Each rank's 2 newest copies are held, the ones before dropped.
          CHECK(held(holds_node1, "dtrain/memory/rank-3/round-0/step-6/MANIFEST"));
          CHECK(held(holds_node1, "dtrain/memory/rank-3/round-0/step-5/MANIFEST"));
          CHECK(held(holds_node0, "dtrain/memory/rank-0/round-0/step-6/rank-0.dtck/0"));
          CHECK_FALSE(held(holds_node1, "dtrain/memory/rank-3/round-0/step-4/MANIFEST"));
          CHECK_FALSE(held(holds_node1, "dtrain/memory/rank-0/steps"));
          fs::remove_all(memory.path / "node1");
          damage_disk(disk.path);
        },
        true, buddy);
    CHECK(restored == std::vector<std::int64_t>(4, 6));
    // Each committed what it took as its own copy, whole (with its slice of
    // the replicated part, joined at the restore).
    CHECK(slice_in(memory.path / "node1" / "step-6.rank-2") == "replicated.0-of-2");
    CHECK(ckpt::verify_step(memory.path / "node1" / "step-6.node").find(ckpt::replicated_name) !=
          nullptr);
    CHECK(ckpt::verify_step(memory.path / "node1" / "step-6.rank-3").find("rank-3.dtck") !=
          nullptr);
  }
  SUBCASE("a copy damaged at the buddy is not used: the disk's") {
    const auto restored = memory_tier_run(
        disk.path, memory.path, 6,
        [&] {
          fs::remove_all(memory.path / "node1");
          dtrain::store_client client("127.0.0.1", holds_node1->port(), options);
          client.set("dtrain/memory/rank-3/round-0/step-6/rank-3.dtck/0", "not the copy");
        },
        false, buddy);
    CHECK(restored == std::vector<std::int64_t>(4, 4));
    CHECK_FALSE(fs::exists(memory.path / "node1" / "step-6.rank-3"));
  }
  SUBCASE("a buddy that cannot hold the copies: the training goes on, and the disk serves") {
    dtrain::store_options small = options;
    small.limits.max_stored_bytes = 64;  // not one copy
    holds_node1.emplace("127.0.0.1", 0, small);
    const auto restored = memory_tier_run(
        disk.path, memory.path, 6,
        [&] {
          CHECK_FALSE(held(holds_node1, "dtrain/memory/rank-3/steps"));
          fs::remove_all(memory.path / "node1");
        },
        false, buddy);
    CHECK(restored == std::vector<std::int64_t>(4, 4));
  }
  SUBCASE("the node and its buddy lost: the disk's") {
    const auto restored = memory_tier_run(
        disk.path, memory.path, 6,
        [&] {
          // Both nodes replaced: empty directories, agents holding nothing.
          fs::remove_all(memory.path / "node0");
          fs::remove_all(memory.path / "node1");
          holds_node0.emplace("127.0.0.1", 0, options);
          holds_node1.emplace("127.0.0.1", 0, options);
        },
        false, buddy);
    CHECK(restored == std::vector<std::int64_t>(4, 4));
  }
}

TEST_CASE("checkpoint: a worker of an earlier round cannot name its copies at the buddy") {
  // A host frozen (its agent and its workers) is replaced; the replacement's
  // worker of rank 0 (round 1) takes its copies from the buddy and goes on.
  // When the frozen worker (round 0) wakes and saves, the buddy's list stays
  // the replacement's.
  const dtrain::store_options options{.timeout = 20s, .log = [](std::string_view) {}};
  dtrain::store_server buddy("127.0.0.1", 0, options);
  dtrain::store_client look("127.0.0.1", buddy.port(), options);
  const std::string list = "dtrain/memory/rank-0/steps";
  scratch_dir disk, frozen_node, new_node, third_node;
  // Rank 0 of a 1-rank job in round `round` (DTRAIN_RESTART_COUNT, as dtrun
  // sets it) on `node`, its per-rank entry `own`; restores when `restore`
  // is set, then saves a memory copy of each of `steps` (own = its value),
  // and runs `frozen` (its host frozen) before the last one.
  auto worker = [&](const char* round, const fs::path& node, std::int64_t& own, bool restore,
                    const std::vector<std::int64_t>& steps,
                    const std::function<void()>& frozen = {}) {
    return on_ranks(1,
                    [&](dtrain::control_plane plane, int) {
                      std::optional<dtrain::checkpoint> c;
                      ::setenv("DTRAIN_RESTART_COUNT", round, 1);
                      c.emplace(plane,
                                dtrain::checkpoint_options{
                                    .dir = disk.path,
                                    .quiet = true,
                                    .memory_every = 1,
                                    .memory_dir = node,
                                    .memory_buddy = "127.0.0.1:" + std::to_string(buddy.port())});
                      ::unsetenv("DTRAIN_RESTART_COUNT");
                      c->add("own", own, dtrain::checkpoint_scope::per_rank);
                      if (restore) {
                        const auto step = c->restore();
                        own = step ? static_cast<std::int64_t>(*step) * 1000 + own : -1;
                      }
                      for (const std::int64_t value : steps) {
                        if (frozen && value == steps.back()) frozen();
                        own = value;
                        c->step();
                      }
                      CHECK(c->memory_failures() == 0);
                    })
        .front();
  };
  std::int64_t old = 0, replacement = 0, third = 0;
  // The worker of round 0 saves steps 1 to 3, and is frozen before step 4.
  CHECK(worker("0", frozen_node.path, old, false, {1, 2, 3, 4}, [&] {
          CHECK(look.get(list) == "round 0: 3@0 2@0");
          // The replacement takes step 3 (own 3), then trains steps 4, 5 (own 40, 50).
          CHECK(worker("1", new_node.path, replacement, true, {}) == "");
          CHECK(replacement == 3003);
          CHECK(look.get(list) == "round 1: 3@0 2@0");  // claimed at the restore
          CHECK(worker("1", new_node.path, replacement, true, {40, 50}) == "");
          CHECK(look.get(list) == "round 1: 5@1 4@1");
          // The frozen worker wakes, and saves its step 4 (own 4).
        }) == "");
  // Its copy is on its node, and not named at the buddy.
  CHECK(fs::exists(frozen_node.path / "step-4.rank-0" / "MANIFEST"));
  CHECK(look.get(list) == "round 1: 5@1 4@1");
  CHECK(look.check(std::vector<std::string>{"dtrain/memory/rank-0/round-1/step-5/MANIFEST",
                                            "dtrain/memory/rank-0/round-1/step-4/MANIFEST"}));
  // What the woken worker sent of its step 4 is gone (its keys, which no
  // list names), and so are the round-0 copies the replacement took.
  for (const std::string gone : {"dtrain/memory/rank-0/round-0/step-4/MANIFEST",
                                 "dtrain/memory/rank-0/round-0/step-4/rank-0.dtck/0",
                                 "dtrain/memory/rank-0/round-0/step-3/MANIFEST"}) {
    CAPTURE(gone);
    CHECK_FALSE(look.check(std::span<const std::string>(&gone, 1)));
  }
  // A new node's worker of round 2 resumes from them: step 5, the replacement's.
  CHECK(worker("2", third_node.path, third, true, {}) == "");
  CHECK(third == 5050);
  // A list that is not one is refused by name, and the training goes on.
  look.set(list, "five and four");
  CHECK(worker("3", third_node.path, third, false, {6}) == "");
  CHECK(look.get(list) == "five and four");
}

TEST_CASE("checkpoint: sharded state is re-cut from memory when an elastic job's size changes") {
  // 4 ranks on 2 "nodes" with a ZeRO-like sharded entry; each node's agent
  // holds the other's copies (2 nodes: each the other's buddy).
  const dtrain::store_options options{.timeout = 20s, .log = [](std::string_view) {}};
  dtrain::store_server holds_node0("127.0.0.1", 0, options), holds_node1("127.0.0.1", 0, options);
  auto at = [](const dtrain::store_server& server) {
    return "127.0.0.1:" + std::to_string(server.port());
  };
  constexpr std::uint64_t total = 1001;
  scratch_dir disk, memory;
  // `size` ranks (nodes of 2) train steps first..last, or restore (last 0);
  // returns what each restore gave. Node 0's agent holds node 1's copies.
  auto run = [&](int size, int first, int last, const std::vector<std::string>& buddy,
                 const std::vector<std::string>& held) {
    std::vector<std::int64_t> restored(static_cast<std::size_t>(size), -2);
    const auto failures = on_ranks(size, [&](dtrain::control_plane plane, int rank) {
      const auto ranges = cut(rank, size, total, 1);
      std::vector<float> mine(1 + total / static_cast<std::uint64_t>(size) + 1, -7.0f);
      std::int64_t counter = 0;
      const auto node = static_cast<std::size_t>(rank / 2);
      dtrain::checkpoint c(plane, {.dir = disk.path,
                                   .every = 4,
                                   .quiet = true,
                                   .memory_every = 1,
                                   .memory_dir = memory.path / ("node" + std::to_string(node)),
                                   .memory_buddy = buddy[node],
                                   .memory_held = held[node]});
      c.add_sharded("adam.m", dtrain::host_buffer(std::span<float>(mine)), ranges, total);
      c.add("counter", counter);
      if (last == 0) {
        const auto step = c.restore();
        restored[static_cast<std::size_t>(rank)] = step ? static_cast<std::int64_t>(*step) : -1;
        if (!step) return;
        CHECK(counter == static_cast<std::int64_t>(*step));
        bool same = true;
        for (const auto& r : ranges) {
          for (std::uint64_t k = 0; k < r.count; ++k)
            same =
                same && mine[r.local + k] == whole_value(r.global + k) + static_cast<float>(*step);
        }
        CHECK(same);
        return;
      }
      if (first > 1) CHECK(c.restore() == static_cast<std::uint64_t>(first - 1));
      for (int step = first; step <= last; ++step) {
        for (const auto& r : ranges) {
          for (std::uint64_t k = 0; k < r.count; ++k)
            mine[r.local + k] = whole_value(r.global + k) + static_cast<float>(step);
        }
        counter = step;
        c.step();
      }
    });
    for (const auto& f : failures) CHECK(f == "");
    return restored;
  };
  auto damage_disk = [&] {
    for (const auto& dir : fs::directory_iterator(disk.path)) {
      for (const auto& file : fs::directory_iterator(dir.path())) fs::resize_file(file.path(), 1);
    }
  };
  run(4, 1, 6, {at(holds_node0), at(holds_node1)}, {at(holds_node1), at(holds_node0)});
  // Node 1 lost: a round of node 0's 2 ranks. Ranks 0, 1's copies are on
  // node 0, ranks 2, 3's at node 0's agent: every part is sent to both
  // ranks, which re-cut it; nothing is read on disk (it is damaged).
  // The old ranks' parts that rank `rank` kept of its re-cut of `step` (in
  // its node's memory directory): those its shard falls in, not all.
  auto kept = [&](int rank, int step) {
    const fs::path copy = memory.path / ("node" + std::to_string(rank / 2)) /
                          ("step-" + std::to_string(step) + ".recut-" + std::to_string(rank));
    std::vector<std::string> parts;
    for (const auto& f : fs::directory_iterator(copy)) {
      if (const std::string name = f.path().filename().string(); name.starts_with("rank-"))
        parts.push_back(name);
    }
    std::ranges::sort(parts);
    return parts;
  };
  using parts = std::vector<std::string>;
  fs::remove_all(memory.path / "node1");
  damage_disk();
  CHECK(run(2, 0, 0, {"", ""}, {at(holds_node1), ""}) == std::vector<std::int64_t>(2, 6));
  CHECK(kept(0, 6) == parts{"rank-0.dtck", "rank-1.dtck"});  // elements 0..499
  CHECK(kept(1, 6) == parts{"rank-2.dtck", "rank-3.dtck"});  // 500..1000
  // The round of 2 trains on (the disk is whole again at step 8); then node
  // 1 is back, empty, and a round of 4 re-cuts the 2 ranks' copies: of step
  // 8, for rank 1 was killed in its copy of step 9.
  fs::remove_all(disk.path);
  run(2, 7, 9, {"", ""}, {at(holds_node1), ""});
  fs::create_directories(memory.path / "node1");
  fs::remove(memory.path / "node0" / "step-9.rank-1" / "MANIFEST");
  damage_disk();
  CHECK(run(4, 0, 0, {at(holds_node0), at(holds_node1)}, {at(holds_node1), at(holds_node0)}) ==
        std::vector<std::int64_t>(4, 8));
  for (int rank = 0; rank < 4; ++rank) {
    CAPTURE(rank);  // a quarter of the whole is in one half
    CHECK(kept(rank, 8) == parts{"rank-" + std::to_string(rank / 2) + ".dtck"});
  }
  // Both nodes' copies gone: the disk's (whole again).
  fs::remove_all(disk.path);
  run(4, 1, 5, {at(holds_node0), at(holds_node1)}, {at(holds_node1), at(holds_node0)});
  fs::remove_all(memory.path / "node1");
  fs::remove_all(memory.path / "node0");
  dtrain::store_server fresh("127.0.0.1", 0, options);  // node 0's agent is new too
  CHECK(run(2, 0, 0, {"", ""}, {at(fresh), ""}) == std::vector<std::int64_t>(2, 4));
}

TEST_CASE(
    "checkpoint: a job of another size resumes from memory when all its state is replicated") {
  // 4 ranks on 2 "nodes" train 6 steps (memory every step, the disk every
  // 4); node 1 is lost, and a round of node 0's 2 ranks resumes.
  scratch_dir disk, memory;
  train_replicated_on_two_nodes(disk.path, memory.path);
  fs::remove_all(memory.path / "node1");
  // With per-rank state registered, the copies of 4 ranks do not fit 2: the
  // disk's is taken, and refused by name (its per-rank state cannot be re-cut).
  const auto refused = on_ranks(2, [&](dtrain::control_plane plane, int) {
    toy_state again;
    std::int64_t own = -1;
    dtrain::checkpoint d(
        plane,
        {.dir = disk.path, .quiet = true, .memory_every = 1, .memory_dir = memory.path / "node0"});
    again.add_to(d);
    d.add("own", own, dtrain::checkpoint_scope::per_rank);
    try {
      static_cast<void>(d.restore());
      CHECK(false);
    } catch (const dtrain::checkpoint_error& e) {
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find("step-4") != std::string::npos);
    }
  });
  for (const auto& f : refused) CHECK(f == "");
  // The replicated state alone: step 6 from node 0's memory, though 4 ranks
  // wrote it, and nothing read on disk (its files are damaged now).
  for (const auto& file : fs::directory_iterator(disk.path / "step-4"))
    fs::resize_file(file.path(), 1);
  const auto resumed = on_ranks(2, [&](dtrain::control_plane plane, int) {
    toy_state again;
    dtrain::checkpoint d(
        plane,
        {.dir = disk.path, .quiet = true, .memory_every = 1, .memory_dir = memory.path / "node0"});
    again.add_to(d);
    CHECK(d.restore() == 6u);
    CHECK(again.optimizer == "adam:6");
    CHECK(again.weight[3] == 9.0f);
  });
  for (const auto& f : resumed) CHECK(f == "");
}

TEST_CASE("checkpoint: ranks without a memory copy get the replicated part from a rank with one") {
  // A node lost (or replaced) in a job of the same size: its new ranks have
  // no copies; the state is replicated, so rank 0 sends them its part.
  scratch_dir disk, memory;
  auto node_of = [&](int rank) { return memory.path / ("node" + std::to_string(rank / 2)); };
  train_replicated_on_two_nodes(disk.path, memory.path);
  fs::remove_all(memory.path / "node1");
  fs::create_directories(memory.path / "node1");  // the replacement node's, empty
  for (const auto& file : fs::directory_iterator(disk.path / "step-4"))
    fs::resize_file(file.path(), 1);  // a restore that read the disk would fail
  const auto resumed = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
    toy_state again;
    dtrain::checkpoint d(
        plane, {.dir = disk.path, .quiet = true, .memory_every = 1, .memory_dir = node_of(rank)});
    again.add_to(d);
    CHECK(d.restore() == 6u);
    CHECK(again.optimizer == "adam:6");
    CHECK(again.weight[5] == 11.0f);
  });
  for (const auto& f : resumed) CHECK(f == "");
  // Each of them committed what it got as its own copy, whole.
  for (const int rank : {2, 3}) {
    const fs::path copy = node_of(rank) / ("step-6.rank-" + std::to_string(rank));
    CHECK(ckpt::verify_step(copy).find(ckpt::replicated_name) != nullptr);
  }
}

TEST_CASE("checkpoint: a node's ranks write the replicated part in slices, joined at a restore") {
  // 4 ranks on 2 "nodes", all of the state replicated (a DDP's): a values
  // entry of 160 KB, cut in 2 ranges of elements (one per rank of a node),
  // and the toy's small entries, dealt whole. `base` makes two trainings differ.
  scratch_dir disk, memory;
  auto node_of = [&](const fs::path& at, int rank) {
    return at / ("node" + std::to_string(rank / 2));
  };
  constexpr std::size_t wide = 40000;
  auto value = [](std::size_t i, float step, float base) {
    return base + step * 0.5f + static_cast<float>(i % 977);
  };
  // Steps first..last (after a restore of first - 1, when first > 1).
  auto train = [&](const fs::path& at, float base, int first = 1, int last = 6) {
    const auto failures = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
      toy_state state;
      std::vector<float> big(wide);
      dtrain::checkpoint c(plane, {.dir = disk.path,
                                   .every = 4,
                                   .quiet = true,
                                   .memory_every = 1,
                                   .memory_dir = node_of(at, rank)});
      state.add_to(c);
      c.add("big", big);
      if (first > 1) CHECK(c.restore() == static_cast<std::uint64_t>(first - 1));
      for (int step = first; step <= last; ++step) {
        state.fill(static_cast<float>(step));
        for (std::size_t i = 0; i < wide; ++i) big[i] = value(i, static_cast<float>(step), base);
        c.step();
      }
    });
    for (const auto& f : failures) CHECK(f == "");
  };
  // Restores the 4 ranks; each checks the values it got against those of step 6.
  auto restore = [&](float base) {
    std::vector<std::int64_t> restored(4, -2);
    const auto failures = on_ranks(4, [&](dtrain::control_plane plane, int rank) {
      toy_state again;
      std::vector<float> big(wide, -1.0f);
      dtrain::checkpoint d(plane, {.dir = disk.path,
                                   .quiet = true,
                                   .memory_every = 1,
                                   .memory_dir = node_of(memory.path, rank)});
      again.add_to(d);
      d.add("big", big);
      const auto step = d.restore();
      restored[static_cast<std::size_t>(rank)] = step ? static_cast<std::int64_t>(*step) : -1;
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < wide; ++i) wrong += big[i] != value(i, 6.0f, base) ? 1 : 0;
      CHECK(wrong == 0);
      CHECK(again.optimizer == "adam:6");
      CHECK(again.weight[5] == 11.0f);
    });
    for (const auto& f : failures) CHECK(f == "");
    return restored;
  };
  auto damage_disk = [&] {
    for (const auto& file : fs::directory_iterator(disk.path / "step-4"))
      fs::resize_file(file.path(), 1);  // a restore that read the disk would fail
  };
  train(memory.path, 0.0f);
  // Each rank's copy holds its slice, none the whole; each slice about half of "big".
  for (int rank = 0; rank < 4; ++rank) {
    const fs::path copy = node_of(memory.path, rank) / ("step-6.rank-" + std::to_string(rank));
    CHECK(slice_in(copy) == "replicated." + std::to_string(rank % 2) + "-of-2");
    for (const auto& f : ckpt::verify_step(copy).files) {
      CHECK(f.bytes > wide * sizeof(float) / 2);
      CHECK(f.bytes < wide * sizeof(float) / 2 + 4096);
    }
  }
  damage_disk();
  SUBCASE("joined on each node: every value back, nothing read on disk") {
    CHECK(restore(0.0f) == std::vector<std::int64_t>(4, 6));
    for (const int node : {0, 1}) {
      CHECK(ckpt::verify_step(memory.path / ("node" + std::to_string(node)) / "step-6.node")
                .find(ckpt::replicated_name) != nullptr);
    }
  }
  SUBCASE("a torn slice: its node joins no copy of that step, and gets it from the other node") {
    const fs::path copy = memory.path / "node1" / "step-6.rank-3";
    for (const auto& f : ckpt::verify_step(copy).files) {
      if (f.name.starts_with("replicated.")) fs::resize_file(copy / f.name, f.bytes - 1);
    }
    CHECK(restore(0.0f) == std::vector<std::int64_t>(4, 6));
    CHECK_FALSE(fs::exists(memory.path / "node1" / "step-6.node"));
    CHECK(ckpt::verify_step(memory.path / "node1" / "step-6.rank-2").find(ckpt::replicated_name) !=
          nullptr);  // sent by rank 0, whole
    // The job goes on 4 steps: each copy is written over one set aside (the
    // earlier workers', the whole one sent), and holds its slice alone.
    train(memory.path, 0.0f, 7, 10);
    for (int rank = 0; rank < 4; ++rank) {
      for (const int step : {9, 10}) {
        const fs::path kept = node_of(memory.path, rank) /
                              ("step-" + std::to_string(step) + ".rank-" + std::to_string(rank));
        std::vector<std::string> files;
        for (const auto& f : fs::directory_iterator(kept)) files.push_back(f.path().filename());
        CAPTURE(kept);
        CHECK(files.size() == 2);  // its manifest and its slice
        CHECK(slice_in(kept) == "replicated." + std::to_string(rank % 2) + "-of-2");
      }
    }
  }
  SUBCASE("slices of two trainings are never joined") {
    // Node 0's copy of rank 1 is another training's (its values differ): node
    // 0 has slice 0 of one and slice 1 of the other, and joins neither.
    scratch_dir other;
    train(other.path, 1000.0f);
    const fs::path theirs = other.path / "node0" / "step-6.rank-1";
    const fs::path ours = memory.path / "node0" / "step-6.rank-1";
    fs::remove_all(ours);
    fs::copy(theirs, ours);
    damage_disk();
    CHECK(restore(0.0f) == std::vector<std::int64_t>(4, 6));  // node 1's, sent to node 0
    CHECK_FALSE(fs::exists(memory.path / "node0" / "step-6.node"));
  }
}

TEST_CASE(
    "checkpoint: a memory directory that cannot be used stops every rank at construction, and "
    "no directory at all with memory_every too") {
  scratch_dir disk, memory;
  const fs::path blocked = memory.path / "a-file";
  std::ofstream(blocked) << "not a directory";
  auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    const fs::path dir = rank == 1 ? blocked / "memory" : memory.path / "node0";
    CHECK_THROWS_WITH_AS(
        dtrain::checkpoint(plane,
                           {.dir = disk.path, .quiet = true, .memory_every = 1, .memory_dir = dir}),
        doctest::Contains(("checkpoint on rank 1: the memory tier's directory " +
                           (blocked / "memory").string() +
                           " (checkpoint_options::memory_dir) cannot be used")
                              .c_str()),
        dtrain::config_error);
  });
  for (const auto& f : failures) CHECK(f == "");
  failures = on_ranks(2, [&](dtrain::control_plane plane, int) {
    CHECK_THROWS_WITH_AS(
        dtrain::checkpoint(plane, {.dir = disk.path, .quiet = true, .memory_every = 5}),
        doctest::Contains("memory_every is 5 and the memory tier has no directory"),
        dtrain::config_error);
  });
  for (const auto& f : failures) CHECK(f == "");
}

TEST_CASE("checkpoint: a memory copy that cannot be written is counted, and the training goes on") {
  scratch_dir disk, memory;
  const fs::path blocked = memory.path / "memory";
  const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
    std::int64_t own = 0;
    dtrain::checkpoint c(
        plane,
        {.dir = disk.path, .every = 2, .quiet = true, .memory_every = 1, .memory_dir = blocked});
    c.add("own", own, dtrain::checkpoint_scope::per_rank);
    // The directory goes away after the start (a tmpfs unmounted, another
    // program's doing): a file stands where it was.
    std::vector<std::int64_t> all(2);
    plane.allgather(std::span<const std::int64_t>(&own, 1), all);
    if (rank == 0) {
      fs::remove_all(blocked);
      std::ofstream(blocked) << "not a directory";
    }
    plane.allgather(std::span<const std::int64_t>(&own, 1), all);
    for (int step = 1; step <= 4; ++step) {
      own = step;
      c.step();
    }
    CHECK(c.memory_failures() == 4u);
    CHECK(c.steps() == 4u);
  });
  for (const auto& f : failures) CHECK(f == "");
  CHECK(fs::exists(disk.path / "step-4" / "MANIFEST"));  // the disk tier is untouched
}

TEST_CASE("checkpoint: memory_budget's interval is the fewest steps whose copy fits the budget") {
  using clock = ckpt::memory_interval::clock;
  // Steps of 1 ms; a step with a copy 1.3 ms and the one after it 1.1 ms: a
  // copy costs 0.4 ms, so a 5% budget needs 8 steps between copies.
  auto run = [](ckpt::memory_interval& interval, std::uint64_t from, std::uint64_t to,
                clock::time_point& now, std::chrono::microseconds copy_extra,
                std::chrono::microseconds after_extra) {
    bool copied_before = false;
    for (std::uint64_t n = from; n <= to; ++n) {
      const bool copies = interval.due(n);
      now += 1000us + (copies ? copy_extra : 0us) + (copied_before ? after_extra : 0us);
      interval.record(copies, now);
      copied_before = copies;
    }
  };
  clock::time_point now{};
  ckpt::memory_interval interval(20, 0.05);
  CHECK(interval.automatic());
  CHECK(interval.every() == 10);  // first_every, to measure
  CHECK(interval.due(10));
  CHECK_FALSE(interval.due(15));
  run(interval, 1, 50, now, 300us, 100us);
  CHECK(interval.agreement_due(50));
  CHECK_FALSE(interval.agreement_due(49));
  std::vector<std::int64_t> mine = interval.pack();
  REQUIRE(mine.size() == ckpt::memory_interval::packed);
  CHECK(mine[1] == 1'000'000);  // a step without a copy (the median)
  CHECK(mine[0] == 400'000);    // what a copy adds: its step's and the next's
  CHECK(mine[2] == 0);          // no agreement yet
  SUBCASE("one rank") {
    const auto line = interval.adopt(mine, 50);
    CHECK(interval.every() == 8);
    CHECK(interval.next_agreement() == 100);
    REQUIRE(line.has_value());
    CHECK(line->find("a copy every 8 steps") != std::string::npos);
    CHECK(line->find("a copy costs 0.40 ms, a step without one takes 1.00 ms") !=
          std::string::npos);
    CHECK(line->find("memory_budget 5%") != std::string::npos);
    // One copy slowed 10x (the host was busy) moves the interval little: the
    // copies before it weigh too.
    run(interval, 51, 57, now, 300us, 100us);
    run(interval, 58, 65, now, 3000us, 1000us);  // the copy of step 64
    run(interval, 66, 150, now, 300us, 100us);
    CHECK_FALSE(interval.adopt(interval.pack(), 150).has_value());
    CHECK(interval.every() > 8);
    CHECK(interval.every() < 16);
    // Copies 5x cheaper from now on: within a few windows every 2 steps, said
    // once it moved more than 2x.
    std::vector<std::string> said;
    for (std::uint64_t from = 151; from < 451; from += 50) {
      run(interval, from, from + 49, now, 60us, 20us);
      if (const auto line = interval.adopt(interval.pack(), from + 49)) said.push_back(*line);
    }
    CHECK(interval.every() == 2);
    CHECK(!said.empty());  // 8 -> 3 or 2: said; then 3 -> 2 is not more than 2x
    CHECK(said.size() <= 2);
    for (const std::string& line : said) CHECK(line.find("a copy every ") != std::string::npos);
    // At 2 steps between copies no step is free of one: the step without a
    // copy is the one measured before, and the interval holds.
    run(interval, 451, 500, now, 60us, 20us);
    interval.adopt(interval.pack(), 500);
    CHECK(interval.every() == 2);
  }
  SUBCASE("the costliest rank decides; a rank that knows nothing yet does not") {
    std::vector<std::int64_t> all = mine;
    all.insert(all.end(), {900'000, 1'000'000, 0});  // 0.9 ms a copy: 18 steps
    all.insert(all.end(), {-1, -1, 0});
    CHECK(interval.adopt(all, 50).has_value());
    CHECK(interval.every() == 18);
  }
  SUBCASE("a copy that costs more than the budget at the bound: the bound, and said") {
    std::vector<std::int64_t> all = mine;
    all.insert(all.end(), {5'000'000, 1'000'000, 0});  // 100 steps would be needed
    const auto line = interval.adopt(all, 50);
    CHECK(interval.every() == 20);
    REQUIRE(line.has_value());
    CHECK(line->find("25% of the steps, over memory_budget's 5%: memory_every 20 is the most") !=
          std::string::npos);
  }
  SUBCASE("no rank knows its figures: the interval holds, nothing said") {
    const std::vector<std::int64_t> all{-1, -1, 0, -1, 1'000'000, 0};
    CHECK_FALSE(interval.adopt(all, 50).has_value());
    CHECK(interval.every() == 10);
    CHECK(interval.next_agreement() == 100);
  }
  SUBCASE("an agreement costs at most a tenth of the budget: they come as far apart") {
    // 1 ms an agreement, steps of 1 ms, 5%: 200 steps apart; at most max_window.
    std::vector<std::int64_t> all = mine;
    all.insert(all.end(), {400'000, 1'000'000, 1'000'000});
    interval.adopt(all, 50);
    CHECK(interval.next_agreement() == 250);
    CHECK_FALSE(interval.agreement_due(249));
    CHECK(interval.agreement_due(250));
    all[5] = 600'000'000;
    interval.adopt(all, 250);
    CHECK(interval.next_agreement() == 250 + ckpt::memory_interval::max_window);
  }
  SUBCASE("steps saved to disk, and the steps after them, are not measured") {
    ckpt::memory_interval other(20, 0.05);
    clock::time_point t{};
    for (std::uint64_t n = 1; n <= 50; ++n) {
      const bool disk = n % 7 == 0;
      if (disk) other.disturb();
      t += disk ? 50ms : 1000us;  // a save of 49 ms, after 1 ms of training
      other.record(other.due(n), t);
    }
    const std::vector<std::int64_t> figures = other.pack();
    CHECK(figures[1] == 1'000'000);
    CHECK(figures[0] == 0);  // copies free here: the saves' time is not theirs
  }
  SUBCASE("a restore starts again") {
    CHECK(interval.adopt(mine, 50).has_value());
    interval.reset(1234);
    CHECK(interval.every() == 10);
    CHECK(interval.pack()[0] == -1);
    CHECK(interval.next_agreement() == 1284);
  }
  SUBCASE("without a budget: every memory_every steps, never measured") {
    ckpt::memory_interval fixed(4, 0);
    CHECK_FALSE(fixed.automatic());
    CHECK(fixed.every() == 4);
    CHECK_FALSE(fixed.agreement_due(50));
    CHECK(fixed.due(8));
    CHECK_FALSE(fixed.due(6));
  }
}

TEST_CASE(
    "checkpoint: with memory_budget every rank copies the same steps, as often as it allows") {
  SUBCASE("cheap copies on long steps: more often than memory_every") {
    scratch_dir disk, memory;
    const dtrain::checkpoint_options options{.dir = disk.path,
                                             .quiet = true,
                                             .memory_every = 1000,
                                             .memory_budget = 0.5,
                                             .memory_dir = memory.path};
    std::vector<std::uint64_t> interval(2, 0);
    const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
      toy_state state;
      dtrain::checkpoint c(plane, options);
      state.add_to(c);
      CHECK(c.memory_interval() == 10);
      for (int step = 1; step <= 100; ++step) {
        state.fill(static_cast<float>(step));
        std::this_thread::sleep_for(2ms);  // a training step
        c.step();
      }
      interval[static_cast<std::size_t>(rank)] = c.memory_interval();
    });
    for (const auto& f : failures) CHECK(f == "");
    // The same on both ranks, well under the bound (a copy of 600 bytes
    // costs less than 1000 half-steps of 2 ms), and both ranks' copies are
    // of the same steps (each keeps its 2 newest).
    CHECK(interval[0] == interval[1]);
    CHECK(interval[0] < 1000);
    auto copies_of = [&](int rank) {
      std::set<std::uint64_t> steps;
      const std::string tail = ".rank-" + std::to_string(rank);
      for (const auto& e : fs::directory_iterator(memory.path)) {
        const std::string name = e.path().filename().string();
        if (name.starts_with("step-") && name.ends_with(tail) && fs::exists(e.path() / "MANIFEST"))
          steps.insert(std::stoull(name.substr(5, name.size() - 5 - tail.size())));
      }
      return steps;
    };
    const std::set<std::uint64_t> steps = copies_of(0);
    CHECK(steps.size() == 2);
    CHECK(copies_of(1) == steps);
    REQUIRE_FALSE(steps.empty());
    const std::uint64_t newest = *steps.rbegin();
    // A restart resumes from the newest.
    const auto again = on_ranks(2, [&](dtrain::control_plane plane, int) {
      toy_state state;
      dtrain::checkpoint c(plane, options);
      state.add_to(c);
      CHECK(c.restore() == newest);
      CHECK(state.optimizer == "adam:" + std::to_string(newest));
      CHECK(c.memory_interval() == 10);  // measured again from the start
    });
    for (const auto& f : again) CHECK(f == "");
  }
  SUBCASE("a costly copy on short steps: memory_every, the most it may wait") {
    scratch_dir disk, memory;
    const auto failures = on_ranks(2, [&](dtrain::control_plane plane, int) {
      toy_state state;
      dtrain::checkpoint c(plane, {.dir = disk.path,
                                   .quiet = true,
                                   .memory_every = 7,
                                   .memory_budget = 0.01,
                                   .memory_dir = memory.path});
      state.add_to(c);
      c.add(
          "slow",
          [] {
            std::this_thread::sleep_for(5ms);
            return std::string("x");
          },
          [](std::string_view) {});
      CHECK(c.memory_interval() == 7);
      for (int step = 1; step <= 100; ++step) {
        state.fill(static_cast<float>(step));
        c.step();
      }
      CHECK(c.memory_interval() == 7);
    });
    for (const auto& f : failures) CHECK(f == "");
    CHECK(fs::exists(memory.path / "step-98.rank-0" / "MANIFEST"));
    CHECK(fs::exists(memory.path / "step-91.rank-1" / "MANIFEST"));
  }
  SUBCASE("ranks given other options, or one a bad one: refused on every rank at once") {
    scratch_dir disk, memory;
    const auto failures = on_ranks(3, [&](dtrain::control_plane plane, int rank) {
      dtrain::checkpoint c(plane, {.dir = disk.path,
                                   .quiet = true,
                                   .memory_every = 20,
                                   .memory_budget = rank == 2 ? 0.05 : 0.03,
                                   .memory_dir = memory.path});
    });
    for (const std::string& f : failures) {
      CHECK(f.find("the ranks were given other checkpoint_options (rank 0: every 0, asynchronous "
                   "false, memory_every 20, memory_budget 0.03; rank 2: every 0, asynchronous "
                   "false, memory_every 20, memory_budget 0.05)") != std::string::npos);
    }
    // One rank's own bad option: every rank stops at once (none waits for
    // it), naming the rank and its problem.
    const auto bad = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
      dtrain::checkpoint c(plane, {.dir = disk.path, .keep = rank == 1 ? 0 : 3, .quiet = true});
    });
    CHECK(bad[1].find("checkpoint on rank 1: checkpoint_options::keep is 0") != std::string::npos);
    CHECK(bad[0].find("rank 1 could not take its checkpoint_options") != std::string::npos);
    CHECK(bad[0].find("keep is 0") != std::string::npos);
    // A save every other number of steps, on one rank: refused too.
    const auto saves = on_ranks(2, [&](dtrain::control_plane plane, int rank) {
      dtrain::checkpoint c(plane,
                           {.dir = disk.path, .every = rank == 0 ? 10u : 20u, .quiet = true});
    });
    for (const std::string& f : saves) {
      CHECK(f.find("(rank 0: every 10, asynchronous false, memory_every 0, memory_budget 0; rank "
                   "1: every 20,") != std::string::npos);
    }
  }
  SUBCASE("bad options") {
    on_ranks(1, [&](dtrain::control_plane plane, int) {
      CHECK_THROWS_WITH_AS(
          dtrain::checkpoint(plane, {.dir = "x", .memory_every = 10, .memory_budget = 1.5}),
          doctest::Contains("memory_budget is 1.5"), dtrain::config_error);
      CHECK_THROWS_WITH_AS(
          dtrain::checkpoint(plane, {.dir = "x", .memory_every = 2, .memory_budget = 0.03}),
          doctest::Contains("memory_every must be at least 3"), dtrain::config_error);
      CHECK_THROWS_WITH_AS(dtrain::checkpoint(plane, {.dir = "x", .memory_budget = 0.03}),
                           doctest::Contains("memory_budget is set and memory_every is 0"),
                           dtrain::config_error);
    });
  }
}
