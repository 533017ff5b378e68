// DDP's one core, basic_ddp (issue 30): the state a wrapper asks it (open
// step, marks, no_sync), marks from many threads at once, the parameters a
// wrapper declares unused before the backward pass, the callback when a step's
// last parameter is marked, which parameters some rank used, and the
// environment snapshot it reads DTRAIN_TIMELINE from. World size 1 over
// `solo`; the same state at 2 and 4 ranks is what dtrain::torch's tests use.

#include "solo.hpp"
#include "support.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

using dtrain_test::solo;
using dtrain_test::solo_policy;
using core_t = dtrain::basic_ddp<solo_policy>;

/// `n` host parameters of `size` floats each, gradients kept by the model (copy mode).
struct wide_model {
  std::vector<std::vector<float>> values, grads;
  wide_model(std::size_t n, std::size_t size) : values(n, std::vector<float>(size, 1.0f)) {
    grads = values;
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t i = 0; i < values.size(); ++i) {
      std::string name = "p";  // not "p" + ...: GCC 12's false -Wrestrict (bug 105329)
      name += std::to_string(i);
      out.push_back(dtrain::param(std::move(name), values[i], grads[i]));
    }
    return out;
  }
  void fill(float v) {
    for (auto& g : grads) std::fill(g.begin(), g.end(), v);
  }
};

/// What DDP needs of dtrain::context, with an environment snapshot of its own.
struct fake_context {
  solo comm;
  dtrain::communicator_channel<solo> channel{comm};
  dtrain::world w;
  dtrain::environment env;
  solo& communicator() { return comm; }
  dtrain::control_plane control_plane() { return dtrain::control_plane(channel); }
  const dtrain::world& world() const { return w; }
  const dtrain::environment& environment() const { return env; }
};
static_assert(dtrain::ddp_context<fake_context, solo_policy>);

}  // namespace

TEST_CASE("ddp core: the step's state, as a wrapper asks it") {
  solo comm;
  wide_model m(4, 3);
  core_t ddp(comm, m.parameters());
  CHECK(ddp.idle());
  CHECK_FALSE(ddp.step_open());
  CHECK(ddp.unmarked() == 4);
  ddp.mark_ready(std::size_t{2});
  CHECK(ddp.marked(2));
  CHECK_FALSE(ddp.marked(1));
  CHECK(ddp.step_open());
  CHECK_FALSE(ddp.idle());
  CHECK(ddp.unmarked() == 3);
  CHECK_THROWS_WITH_AS((void)ddp.no_sync(),
                       doctest::Contains("in the middle of a synchronized step"), dtrain::error);
  ddp.mark_all_ready();
  CHECK(ddp.unmarked() == 0);
  ddp.synchronize();
  CHECK(ddp.idle());
  CHECK(ddp.steps() == 1);
  {
    auto guard = ddp.no_sync();
    CHECK(ddp.accumulating());
    ddp.mark_all_ready();
    CHECK_FALSE(ddp.step_open());  // accumulating is not a synchronized step
    CHECK_FALSE(ddp.idle());       // but something happened since the last step
    ddp.synchronize();             // does nothing inside no_sync()
  }
  CHECK_FALSE(ddp.accumulating());
  CHECK(ddp.steps() == 1);
}

TEST_CASE("ddp core: mark_ready from many threads at once, as autograd's threads call it") {
  solo comm;
  constexpr std::size_t n = 96;
  constexpr int threads = 6;
  wide_model m(n, 40);
  // Small buckets, reduced through the runner even at world size 1: every mark may launch one.
  core_t ddp(comm, m.parameters(), {},
             {.bucket_cap_mb = 400.0 / (1 << 20),
              .first_bucket_cap_mb = 200.0 / (1 << 20),
              .always_reduce = true});
  REQUIRE(ddp.buckets().size() > 10);
  for (int step = 0; step < 20; ++step) {
    m.fill(static_cast<float>(step));
    const int before = solo::log().calls;
    std::vector<std::thread> markers;
    for (int t = 0; t < threads; ++t) {
      markers.emplace_back([&, t] {
        for (std::size_t i = n; i-- > 0;) {
          if (static_cast<int>(i % threads) == t) ddp.mark_ready(i);
        }
      });
    }
    for (std::thread& t : markers) t.join();
    CHECK(ddp.unmarked() == 0);
    ddp.synchronize();
    CHECK(ddp.steps() == static_cast<std::size_t>(step) + 1);
    // Each bucket went through the communicator once.
    CHECK(solo::log().calls - before == static_cast<int>(ddp.buckets().size()));
    CHECK(m.grads[n - 1][7] == static_cast<float>(step));
  }
}

TEST_CASE("ddp core: parameters declared unused are ready, as zeros, with the step's first mark") {
  solo comm;
  wide_model m(4, 3);
  core_t ddp(comm, m.parameters(), {}, {.find_unused_parameters = true});
  m.fill(5);
  const std::vector<std::size_t> unused = {1, 3};
  ddp.prepare_for_backward(unused);
  CHECK(ddp.declared_unused(1));
  CHECK_FALSE(ddp.marked(1));  // not before the backward pass begins
  ddp.mark_ready(std::size_t{0});
  CHECK(ddp.marked(1));
  CHECK(ddp.marked(3));
  CHECK(ddp.unmarked() == 1);
  CHECK_THROWS_WITH_AS(ddp.mark_ready(std::size_t{3}),
                       doctest::Contains("after prepare_for_backward() listed it"), dtrain::error);
  ddp.mark_ready(std::size_t{2});
  ddp.synchronize();
  CHECK(m.grads[0][0] == 5.0f);
  CHECK(m.grads[1][0] == 0.0f);  // a zero contribution, not the stale 5
  CHECK(m.grads[3][2] == 0.0f);
  CHECK_FALSE(ddp.declared_unused(1));  // for one step only
  // Only between steps, and only with find_unused_parameters.
  ddp.mark_ready(std::size_t{0});
  CHECK_THROWS_WITH_AS(ddp.prepare_for_backward(unused),
                       doctest::Contains("in the middle of a step"), dtrain::error);
  ddp.mark_all_ready();
  ddp.synchronize();
  core_t plain(comm, m.parameters());
  CHECK_THROWS_WITH_AS(plain.prepare_for_backward(unused),
                       doctest::Contains("without ddp_options::find_unused_parameters"),
                       dtrain::config_error);
}

TEST_CASE("ddp core: on_all_marked runs once, when mark_ready marks a step's last parameter") {
  solo comm;
  wide_model m(5, 2);
  core_t ddp(comm, m.parameters());
  int calls = 0;
  bool unmarked_when_called = true;
  ddp.on_all_marked([&] {
    ++calls;
    unmarked_when_called = ddp.unmarked() != 0;  // the lock is released: the core can be asked
  });
  for (std::size_t i : {4, 2, 0, 1}) ddp.mark_ready(i);
  CHECK(calls == 0);
  ddp.mark_ready(std::size_t{3});
  CHECK(calls == 1);
  CHECK_FALSE(unmarked_when_called);
  ddp.synchronize();
  ddp.mark_all_ready();  // the caller completes this step itself
  ddp.synchronize();
  {
    auto guard = ddp.no_sync();
    for (std::size_t i = 0; i < 5; ++i) ddp.mark_ready(i);
  }
  CHECK(calls == 1);
}

TEST_CASE(
    "ddp core: used_anywhere says what some rank used, without a collective at world size 1") {
  solo comm;
  wide_model m(4, 2);
  core_t ddp(comm, m.parameters(), {}, {.find_unused_parameters = true});
  CHECK(ddp.used_anywhere() == std::vector<bool>{false, false, false, false});  // no step yet
  {
    auto guard = ddp.no_sync();
    ddp.mark_ready(std::size_t{3});  // accumulated: used in the step it is part of
  }
  ddp.mark_ready({std::size_t{0}, std::size_t{2}});
  ddp.synchronize();
  const int calls = solo::log().calls;
  CHECK(ddp.used_anywhere() == std::vector<bool>{true, false, true, true});
  CHECK(ddp.used_anywhere() == std::vector<bool>{true, false, true, true});
  CHECK(solo::log().calls == calls);
  core_t every(comm, m.parameters());  // without find_unused_parameters all are marked
  every.mark_all_ready();
  every.synchronize();
  CHECK(every.used_anywhere() == std::vector<bool>(4, true));
}

TEST_CASE("ddp core: DTRAIN_TIMELINE comes from the context's environment snapshot") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("dtrain-core-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  wide_model m(2, 2);
  fake_context ctx;
  ctx.w.rank = 0;
  ctx.w.world_size = 1;
  const std::string ours = (dir / "ours.json").string();
  const std::string process = (dir / "process.json").string();
  ::setenv("DTRAIN_TIMELINE", process.c_str(), 1);
  {
    ctx.env = dtrain::environment{{"DTRAIN_TIMELINE", ours}};
    core_t ddp(ctx, m.parameters());
    ddp.mark_all_ready();
    ddp.synchronize();
  }
  CHECK(fs::exists(dir / "ours.rank0.json"));
  CHECK_FALSE(fs::exists(dir / "process.rank0.json"));
  {
    ctx.env = dtrain::environment{};  // the snapshot has none: the process's is not read
    core_t ddp(ctx, m.parameters());
  }
  CHECK_FALSE(fs::exists(dir / "process.rank0.json"));
  ::unsetenv("DTRAIN_TIMELINE");
  fs::remove_all(dir);
}

TEST_CASE("ddp core: ddp_options::stream on a host backend is a config_error naming it") {
  solo comm;
  wide_model m(2, 3);
  int on_stream = 0;  // any address: a host backend has no stream to order after
  CHECK_THROWS_WITH_AS(
      core_t(comm, m.parameters(), {},
             {.stream = static_cast<dtrain::stream_handle>(static_cast<void*>(&on_stream))}),
      doctest::Contains("rank 0: ddp_options::stream is set, but solo reduces host memory"),
      dtrain::config_error);
  core_t plain(comm, m.parameters(), {}, {.stream = nullptr});
  CHECK(plain.size() == 1);
}
