// The API a newcomer meets first (issue 14): mark_ready with a braced list,
// mark_all_ready, the report of parameters no rank marked, collectives on
// any contiguous range, the param() overload set, and --nproc-per-node on
// the command line. DDP runs here on one rank over `solo`, a communicator
// of world size 1 that only records what it is given.

#include "solo.hpp"
#include "support.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

using dtrain_test::solo;
using dtrain_test::solo_log;
using dtrain_test::solo_policy;
using dtrain_test::two_layers;

using ddp_t = dtrain::DistributedDataParallel<two_layers, solo_policy>;

/// Everything written to stderr (fd 2) while `f` runs.
template <class F>
std::string stderr_of(F&& f) {
  std::fflush(stderr);
  char path[] = "/tmp/dtrain-unit-stderr.XXXXXX";
  const int file = ::mkstemp(path);
  REQUIRE(file >= 0);
  const int saved = ::dup(2);
  ::dup2(file, 2);
  try {
    f();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    ::close(file);
    ::unlink(path);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(file);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path);
  return text.str();
}

}  // namespace

TEST_CASE("ddp.mark_ready takes a braced list of names, as a newcomer writes it") {
  solo comm;
  two_layers m;
  ddp_t ddp(comm, m);
  m.backward();
  // {"w2", "b2"} once picked string_view's (first, last) constructor and
  // threw "no parameter named 'w2..." at run time.
  ddp.mark_ready({"w2", "b2"});
  ddp.mark_ready({"w1", "b1"});
  ddp.synchronize();
  CHECK(ddp.steps() == 1);
  CHECK(m.g_w2[1] == doctest::Approx(80));  // one rank: the mean is the gradient
  CHECK(m.g_b2[0] == doctest::Approx(90));
}

TEST_CASE("ddp.mark_ready takes braced lists of indices and of parameters") {
  solo comm;
  two_layers m;
  ddp_t ddp(comm, m);
  m.backward();
  ddp.mark_ready({3, 2});
  ddp.mark_ready({ddp.parameters()[1], ddp.parameters()[0]});
  ddp.synchronize();
  CHECK(ddp.steps() == 1);
  // The old overloads still work: one name, one index, a range.
  ddp.mark_ready(std::string_view("b2"));
  ddp.mark_ready(std::size_t{2});
  ddp.mark_ready(std::vector<std::string>{"b1", "w1"});
  ddp.synchronize();
  CHECK(ddp.steps() == 2);
  // An unknown name in a list still names it.
  CHECK_THROWS_WITH_AS(ddp.mark_ready({"w2", "w3"}), doctest::Contains("no parameter named 'w3'"),
                       dtrain::error);
}

TEST_CASE("ddp.mark_all_ready is the one-line step") {
  solo comm;
  two_layers m;
  ddp_t ddp(comm, m);
  const auto layout = ddp.buckets();
  for (int step = 0; step < 3; ++step) {
    m.backward();
    ddp.mark_all_ready();
    ddp.synchronize();
  }
  CHECK(ddp.steps() == 3);
  CHECK(m.g_w1[3] == doctest::Approx(40));
  // Last parameter first, the order of the first layout: the rebuild changes nothing.
  REQUIRE(ddp.buckets().size() == layout.size());
  for (std::size_t b = 0; b < layout.size(); ++b)
    CHECK(ddp.buckets()[b].parameters == layout[b].parameters);
  // Marks only what is left: after the last layer's own mark, no "marked twice".
  m.backward();
  ddp.mark_ready({"w2", "b2"});
  ddp.mark_all_ready();
  ddp.synchronize();
  CHECK(ddp.steps() == 4);
}

TEST_CASE("ddp.find_unused_parameters names what no rank marked, once") {
  solo comm;
  two_layers m;
  ddp_t ddp(comm, m, {.find_unused_parameters = true});
  CHECK(ddp_t::unused_report_steps == 2);
  const auto step = [&](bool mark_w1) {
    m.backward();
    ddp.mark_ready({"b2", "b1"});  // "w2" forgotten; "w1" only when asked
    if (mark_w1) ddp.mark_ready("w1");
    ddp.synchronize();
  };
  CHECK(stderr_of([&] { step(false); }).empty());  // not after one step
  const std::string report = stderr_of([&] { step(true); });
  CHECK_CONTAINS(report,
                 "[rank 0/1] dtrain: DistributedDataParallel: no rank marked parameter 'w2' ready "
                 "in the first 2 steps");
  CHECK_CONTAINS(report, "treated as unused and its gradient zeroed");
  CHECK_CONTAINS(report, "report_unused_parameters = false");
  CHECK(report.find("'w1'") == std::string::npos);  // marked in step 2: used
  CHECK(std::count(report.begin(), report.end(), '\n') == 1);
  CHECK(m.g_w2[0] == 0.0f);                        // what the report warns about
  CHECK(stderr_of([&] { step(false); }).empty());  // once
}

TEST_CASE("ddp.report_unused_parameters = false is silent") {
  solo comm;
  two_layers m;
  ddp_t ddp(comm, m, {.find_unused_parameters = true, .report_unused_parameters = false});
  const std::string text = stderr_of([&] {
    for (int s = 0; s < 3; ++s) {
      m.backward();
      ddp.mark_ready({"b2", "b1", "w1"});
      ddp.synchronize();
    }
  });
  CHECK(text.empty());
}

TEST_CASE("ddp.basic_ddp works from parameter lists, without a model type") {
  solo comm;
  std::vector<double> w = {1, 2}, gw = {0.5, 0.25};
  std::vector<std::int64_t> counter = {7};
  dtrain::basic_ddp<solo_policy> ddp(comm, {dtrain::param("w", w, gw)},
                                     {dtrain::param("counter", counter)});
  ddp.mark_all_ready();
  ddp.synchronize();
  CHECK(gw[1] == doctest::Approx(0.25));
  CHECK(ddp.parameters().size() == 1);
}

TEST_CASE("ddp at world size 1 communicates nothing, unless always_reduce") {
  solo comm;
  const auto calls = [] { return solo::log().calls; };
  SUBCASE("views: the gradients are the mean as they are") {
    two_layers m;
    ddp_t ddp(comm, m);
    const int before = calls();
    for (int step = 0; step < 3; ++step) {  // the rebuild included
      m.backward();
      ddp.mark_all_ready();
      ddp.synchronize();
    }
    CHECK(calls() == before);
    CHECK(m.g_w1[3] == 40.0f);
    CHECK(ddp.buckets_rebuilt());
  }
  SUBCASE("copies: an unused gradient is zeroed where the model keeps it") {
    std::vector<float> w = {1, 2}, gw = {3, 4}, u = {5}, gu = {6};
    dtrain::basic_ddp<solo_policy> ddp(
        comm, {dtrain::param("w", w, gw), dtrain::param("u", u, gu)}, {},
        {.find_unused_parameters = true, .report_unused_parameters = false});
    const int before = calls();
    ddp.mark_ready("w");
    ddp.synchronize();
    CHECK(calls() == before);
    CHECK(gw == std::vector<float>{3, 4});
    CHECK(gu[0] == 0.0f);
  }
  SUBCASE("compression still rounds through the wire type, without a collective") {
    std::vector<float> x = {1, 2}, gx = {1.0f + 1.0f / 1024, 3};  // 1 + 2^-10: no bfloat16
    dtrain::basic_ddp<solo_policy> ddp(comm, {dtrain::param("x", x, gx)}, {},
                                       {.compression = dtrain::gradient_compression::bfloat16});
    const int before = calls();
    ddp.mark_all_ready();
    ddp.synchronize();
    CHECK(calls() == before);
    CHECK(gx[0] == 1.0f);
    CHECK(gx[1] == 3.0f);
  }
  SUBCASE("always_reduce: one allreduce per bucket, as on more ranks") {
    two_layers m;
    ddp_t ddp(comm, m, {.first_bucket_cap_mb = 8.0 / (1 << 20), .always_reduce = true});
    REQUIRE(ddp.buckets().size() > 1);
    const int before = calls();
    m.backward();
    ddp.mark_all_ready();
    ddp.synchronize();
    CHECK(calls() == before + static_cast<int>(ddp.buckets().size()));
    CHECK(m.g_b2[0] == 90.0f);
  }
  SUBCASE("a comm hook still runs; it is registered between steps only") {
    two_layers m;
    ddp_t ddp(comm, m);
    std::size_t hooked = 0;
    auto hook = [&](solo& c, dtrain::gradient_bucket& b) {
      ++hooked;
      return c.allreduce(b.data, b.data, dtrain::reduce_op::avg);
    };
    ddp.register_comm_hook(hook);
    m.backward();
    ddp.mark_all_ready();
    ddp.synchronize();
    CHECK(hooked == ddp.buckets().size());
    m.backward();
    ddp.mark_ready("b2");
    CHECK_THROWS_WITH_AS(ddp.register_comm_hook(hook), doctest::Contains("between steps"),
                         dtrain::config_error);
  }
}

TEST_CASE("ddp.no_sync_guard is made only by no_sync(), which refuses the middle of a step") {
  // A guard built directly skipped no_sync()'s check: zero_grad() then zeroed
  // buckets that the communication thread was still reducing.
  CHECK_FALSE(std::is_constructible_v<ddp_t::no_sync_guard, ddp_t&>);
  CHECK_FALSE(std::is_constructible_v<dtrain::basic_ddp<solo_policy>::no_sync_guard,
                                      dtrain::basic_ddp<solo_policy>&>);
  solo comm;
  two_layers m;
  ddp_t ddp(comm, m);
  m.backward();
  ddp.mark_ready("b2");
  CHECK_THROWS_WITH_AS((void)ddp.no_sync(),
                       doctest::Contains("in the middle of a synchronized step"), dtrain::error);
  CHECK_THROWS_WITH_AS(ddp.zero_grad(), doctest::Contains("in the middle of a step"),
                       dtrain::error);
  ddp.mark_all_ready();
  ddp.synchronize();
  {
    auto guard = ddp.no_sync();
    const auto moved = std::move(guard);  // moving keeps one guard alive
    ddp.mark_all_ready();                 // recorded only
    ddp.synchronize();                    // nothing inside no_sync()
    CHECK(ddp.steps() == 1);
  }
  ddp.mark_all_ready();  // the accumulated step, synchronized
  ddp.synchronize();
  CHECK(ddp.steps() == 2);
}

TEST_CASE("collectives take any contiguous range of an element type") {
  solo comm;
  solo_log& log = solo::log();
  std::vector<float> v = {1, 2, 3};
  std::array<double, 2> a = {1, 2};
  std::int32_t c[4] = {1, 2, 3, 4};
  dtrain::allreduce(comm, v).wait();
  CHECK(
      (log.count == 3 && log.type == dtrain::dtype::float32 && log.where == dtrain::memory::host));
  dtrain::allreduce(comm, a, dtrain::reduce_op::avg).wait();
  CHECK((log.count == 2 && log.type == dtrain::dtype::float64));
  dtrain::allreduce(comm, c, dtrain::reduce_op::max).wait();
  CHECK((log.count == 4 && log.type == dtrain::dtype::int32));
  dtrain::broadcast(comm, v, 0).wait();
  CHECK(log.count == 3);
  // Out of place: a const input of one kind of range, an output of another.
  const std::vector<double> in = {3, 4};
  dtrain::allreduce(comm, in, a).wait();
  CHECK(a[1] == 4);
  std::vector<std::int32_t> gathered(4);
  dtrain::allgather(comm, c, gathered).wait();
  CHECK(gathered[3] == 4);
  std::array<float, 3> scattered{};
  dtrain::reduce_scatter(comm, v, scattered).wait();
  CHECK(scattered[2] == 3);
  // Spans, as before.
  dtrain::allreduce(comm, std::span(v)).wait();
  dtrain::allgather(comm, std::span<const std::int32_t>(c), std::span(gathered)).wait();
  CHECK(log.count == 4);
}

TEST_CASE("param is one overload set: host ranges, device spans, buffers") {
  std::vector<float> values(6), grad(6);
  float* grad_ptr = nullptr;
  const dtrain::parameter view = dtrain::param("a", values, grad_ptr);
  CHECK((view.rebindable() && view.values.where == dtrain::memory::host && view.device == -1));
  const dtrain::parameter copy = dtrain::param("b", values, grad);
  CHECK((!copy.rebindable() && copy.gradient == grad.data()));
  const dtrain::parameter state = dtrain::param("c", values);
  CHECK((state.gradient == nullptr && state.values.count == 6));

  // Device memory is a type, not another function name (no GPU needed: views only).
  float* dptr = values.data();
  float* dgrad = nullptr;
  const dtrain::parameter dview = dtrain::param("d", dtrain::device_span<float>{dptr, 6, 1}, dgrad);
  CHECK((dview.rebindable() && dview.values.where == dtrain::memory::device && dview.device == 1 &&
         dview.values.device == 1));
  const dtrain::parameter dcopy = dtrain::param("e", dtrain::device_span<float>{dptr, 6, 1},
                                                dtrain::device_span<float>{grad.data(), 6, 1});
  CHECK((!dcopy.rebindable() && dcopy.gradient == grad.data() && dcopy.device == 1));
  const dtrain::parameter dstate = dtrain::param("f", dtrain::device_span<float>{dptr, 6, 1});
  CHECK((dstate.gradient == nullptr && dstate.values.where == dtrain::memory::device));
  CHECK_THROWS_AS(dtrain::param("g", dtrain::device_span<float>{dptr, 6, 1},
                                dtrain::device_span<float>{grad.data(), 5, 1}),
                  dtrain::config_error);
  // The old names are the same views.
  const dtrain::parameter old = dtrain::device_param("d", dptr, dgrad, 6, 1);
  CHECK((old.values.data == dview.values.data && old.device == 1 && old.rebindable()));
  CHECK(dtrain::device_buffer("f", dptr, 6, 1).values.where == dtrain::memory::device);
  CHECK(dtrain::model_buffer("c", values).gradient == nullptr);
}

TEST_CASE("run reads --nproc-per-node from the command line, torchrun's spellings") {
  using dtrain::detail::nproc_per_node_from_args;
  using args = std::vector<std::string_view>;
  CHECK(!nproc_per_node_from_args(args{"--epochs", "2"}).has_value());
  CHECK(nproc_per_node_from_args(args{"--nproc-per-node", "3"}) == 3);
  CHECK(nproc_per_node_from_args(args{"--epochs", "2", "--nproc-per-node=4"}) == 4);
  CHECK(nproc_per_node_from_args(args{"--nproc_per_node", "5"}) == 5);
  CHECK(nproc_per_node_from_args(args{"--nproc_per_node=6", "--lr", "0.1"}) == 6);
  CHECK(nproc_per_node_from_args(args{"--nproc-per-node=2", "--nproc-per-node", "7"}) == 7);
  CHECK(!nproc_per_node_from_args(args{"--", "--nproc-per-node", "3"}).has_value());
  CHECK(!nproc_per_node_from_args(args{"--nproc-per-nodes=3"}).has_value());
  CHECK_CONTAINS(
      dtrain_test::config_error_text(
          [] { (void)nproc_per_node_from_args(args{"--nproc-per-node=x"}); }),
      "--nproc-per-node=x on the command line is not a number of workers, gpu, cpu or auto");
  CHECK_CONTAINS(dtrain_test::config_error_text([] {
                   (void)nproc_per_node_from_args(args{"--nproc_per_node", "0"});
                 }),
                 "--nproc_per_node=0 on the command line must be at least 1");
  CHECK_CONTAINS(dtrain_test::config_error_text(
                     [] { (void)nproc_per_node_from_args(args{"--nproc-per-node"}); }),
                 "--nproc-per-node on the command line needs a value");
}

TEST_CASE(
    "ddp.gradient_norm reads bfloat16 and float16 gradients, their squares summed in double") {
  // Issue 49: a 16-bit model clips by the global norm as a float32 one does.
  // 1e30 in bfloat16 squares to 1e60, past float32's range (a sum in float
  // would be inf), and 60000 in float16 squares past float16's.
  using dtrain::bfloat16;
  using dtrain::float16;
  solo comm;
  for (const dtrain::sharding stage :
       {dtrain::sharding::none, dtrain::sharding::optimizer, dtrain::sharding::gradients}) {
    CAPTURE(dtrain::to_string(stage));
    std::vector<bfloat16> wb(3, bfloat16(1.0f)),
        gb = {bfloat16(1.5f), bfloat16(-2.0f), bfloat16(1e30f)};
    std::vector<float16> wh(2, float16(1.0f)), gh = {float16(60000.0f), float16(-0.5f)};
    std::vector<float> wf = {1.0f}, gf = {3.0f};
    dtrain::basic_ddp<solo_policy> ddp(
        comm, {dtrain::param("b", wb, gb), dtrain::param("h", wh, gh), dtrain::param("f", wf, gf)},
        {}, {.sharding = stage});
    ddp.mark_all_ready();
    ddp.synchronize();
    double want = 0;
    for (const bfloat16 x : gb) want += static_cast<double>(float(x)) * float(x);
    for (const float16 x : gh) want += static_cast<double>(float(x)) * float(x);
    want += 9.0;
    want = std::sqrt(want);
    const double norm = ddp.gradient_norm();
    CHECK(std::isfinite(norm));
    CHECK(norm == doctest::Approx(want).epsilon(1e-12));
    CHECK(norm > 1e29);
  }
}
