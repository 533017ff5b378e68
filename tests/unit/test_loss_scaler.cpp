// dtrain::loss_scaler (issue 49): the scale's backoff and growth, the
// division of the averaged gradients in place, the step skipped on every rank
// when any rank's gradients hold an inf or a NaN, its state as text, and the
// refusals by name. Driven through a DDP stand-in whose norm, any_rank()
// answer and pieces the test chooses; tests/ddp/ddp_shard.cpp's
// "loss_scaler" case runs it on a real DistributedDataParallel at 1-4 ranks.

#include <doctest/doctest.h>
#include <dtrain/dtrain.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

/// What unscale() and check() need of a DistributedDataParallel: rank(),
/// gradient_norm(), any_rank(), parameters(), shard(). Its pieces are one
/// float32 parameter "g" and one bfloat16 parameter "h", host memory.
struct scaler_fake_ddp {
  std::vector<float> g = {1024.0f, -2048.0f, 3.0f};
  std::vector<dtrain::bfloat16> h = {dtrain::bfloat16(512.0f), dtrain::bfloat16(-6.0f)};
  std::vector<dtrain::parameter> params;
  std::vector<dtrain::shard_piece> pieces;
  bool others_found_inf = false;  // what the other ranks say to any_rank()
  int norms = 0, agreements = 0;  // collectives called

  scaler_fake_ddp() {
    params.resize(2);
    params[0].name = "g";
    params[1].name = "h";
    pieces.resize(2);
    pieces[0].parameter = 0;
    pieces[0].gradients = dtrain::host_buffer(std::span<float>(g));
    pieces[1].parameter = 1;
    pieces[1].gradients = dtrain::host_buffer(std::span<dtrain::bfloat16>(h));
  }
  [[nodiscard]] int rank() const { return 3; }
  double gradient_norm() {
    ++norms;
    double squares = 0;
    for (const float x : g) squares += static_cast<double>(x) * x;
    for (const dtrain::bfloat16 x : h) squares += static_cast<double>(float(x)) * float(x);
    return std::sqrt(squares);
  }
  bool any_rank(bool mine) {
    ++agreements;
    return mine || others_found_inf;
  }
  [[nodiscard]] const std::vector<dtrain::parameter>& parameters() const { return params; }
  [[nodiscard]] const std::vector<dtrain::shard_piece>& shard() const { return pieces; }
};

std::string scaler_error(auto&& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("loss_scaler: unscale divides float32 and bfloat16 gradients by the scale, in place") {
  dtrain::loss_scaler scaler({.init_scale = 512});
  scaler_fake_ddp ddp;
  CHECK(scaler.scale() == 512.0);
  const double scaled_norm = ddp.gradient_norm();
  REQUIRE(scaler.unscale(ddp));
  CHECK(ddp.g == std::vector<float>{2.0f, -4.0f, 3.0f / 512.0f});
  CHECK(float(ddp.h[0]) == 1.0f);
  CHECK(float(ddp.h[1]) == float(dtrain::bfloat16(-6.0f / 512.0f)));
  CHECK(scaler.gradient_norm() == doctest::Approx(scaled_norm / 512.0));
  CHECK_FALSE(scaler.found_inf());
  CHECK(ddp.norms == 2);  // the test's own, then unscale's
  CHECK(ddp.agreements == 1);
  scaler.update();
  CHECK(scaler.scale() == 512.0);  // one clean step of 2000
  CHECK(scaler.growth_tracker() == 1u);
}

TEST_CASE("loss_scaler: an inf or a NaN on any rank skips the step, the gradients untouched") {
  dtrain::loss_scaler scaler({.init_scale = 1024, .growth_interval = 2});
  scaler_fake_ddp ddp;
  SUBCASE("this rank's") { ddp.g[1] = std::numeric_limits<float>::infinity(); }
  SUBCASE("this rank's NaN") {
    ddp.h[0] = dtrain::bfloat16(std::numeric_limits<float>::quiet_NaN());
  }
  SUBCASE("another rank's only") { ddp.others_found_inf = true; }
  const std::vector<float> before = ddp.g;
  CHECK_FALSE(scaler.unscale(ddp));
  CHECK(scaler.found_inf());
  CHECK(std::memcmp(before.data(), ddp.g.data(), before.size() * sizeof(float)) == 0);
  scaler.update();
  CHECK(scaler.scale() == 512.0);
  CHECK(scaler.skipped_steps() == 1u);
  CHECK(scaler.growth_tracker() == 0u);
}

TEST_CASE("loss_scaler: backoff and growth follow GradScaler's schedule") {
  dtrain::loss_scaler scaler(
      {.init_scale = 8, .growth_factor = 4, .backoff_factor = 0.25, .growth_interval = 3});
  const std::vector<bool> inf = {false, false, true, false, false, false, false, true, true};
  const std::vector<double> want = {8, 8, 8, 2, 2, 2, 8, 8, 2, 0.5};  // the scale before each step
  for (std::size_t step = 0; step < inf.size(); ++step) {
    CAPTURE(step);
    CHECK(scaler.scale() == want[step]);
    scaler_fake_ddp ddp;
    ddp.others_found_inf = inf[step];
    CHECK(scaler.unscale(ddp) == !inf[step]);
    scaler.update();
  }
  CHECK(scaler.scale() == want.back());
  CHECK(scaler.skipped_steps() == 3u);
}

TEST_CASE("loss_scaler: check() decides without dividing, and disabled nothing is collective") {
  scaler_fake_ddp ddp;
  dtrain::loss_scaler scaler({.init_scale = 4});
  CHECK(scaler.check(ddp));
  CHECK(ddp.g[0] == 1024.0f);
  CHECK(scaler.gradient_norm() == doctest::Approx(ddp.gradient_norm() / 4));
  scaler.update();

  dtrain::loss_scaler off({.enabled = false});
  scaler_fake_ddp other;
  other.others_found_inf = true;
  CHECK(off.scale() == 1.0);
  CHECK(off.unscale(other));
  CHECK(other.g[0] == 1024.0f);
  CHECK(other.norms == 0);
  CHECK(other.agreements == 0);
  off.update();
  CHECK(off.skipped_steps() == 0u);
}

TEST_CASE("loss_scaler: a step out of order, device memory and bad options are refused by name") {
  dtrain::loss_scaler scaler;
  CHECK(scaler_error([&] { scaler.update(); }).find("update() without unscale(ddp)") !=
        std::string::npos);
  scaler_fake_ddp ddp;
  CHECK(scaler.unscale(ddp));
  const std::string twice = scaler_error([&] { static_cast<void>(scaler.unscale(ddp)); });
  CHECK(twice.find("loss_scaler on rank 3: unscale() or check() called twice") !=
        std::string::npos);
  scaler.update();

  scaler_fake_ddp gpu;
  gpu.pieces[1].gradients.where = dtrain::memory::device;
  const std::string device = scaler_error([&] { static_cast<void>(scaler.unscale(gpu)); });
  CHECK(device.find("rank 3: parameter 'h' has its gradients in device memory") !=
        std::string::npos);
  CHECK(device.find("check(ddp)") != std::string::npos);

  CHECK(scaler_error([] {
          dtrain::loss_scaler s({.growth_factor = 1});
        }).find("loss_scaler_options::growth_factor = 1.000000") != std::string::npos);
  CHECK(scaler_error([] {
          dtrain::loss_scaler s({.backoff_factor = 1.5});
        }).find("backoff_factor = 1.5") != std::string::npos);
  CHECK(scaler_error([] { dtrain::loss_scaler s({.init_scale = -1}); }).find("init_scale = -1") !=
        std::string::npos);
  CHECK(scaler_error([] {
          dtrain::loss_scaler s({.growth_interval = 0});
        }).find("growth_interval = 0") != std::string::npos);
}

TEST_CASE("loss_scaler: a scale that keeps falling is an error that names the cause") {
  dtrain::loss_scaler scaler({.init_scale = 0x1p-22});
  scaler_fake_ddp ddp;
  ddp.others_found_inf = true;
  for (int step = 0; step < 2; ++step) {
    CHECK_FALSE(scaler.unscale(ddp));
    scaler.update();
  }
  CHECK(scaler.scale() == 0x1p-24);
  CHECK_FALSE(scaler.unscale(ddp));
  const std::string e = scaler_error([&] { scaler.update(); });
  CHECK(e.find("loss_scaler on rank 3: the averaged gradients held an inf or a NaN") !=
        std::string::npos);
  CHECK(e.find("3 steps skipped") != std::string::npos);
  CHECK(e.find("NaN in the model") != std::string::npos);
}

TEST_CASE("loss_scaler: its state as text round-trips exactly, and bad text is refused") {
  dtrain::loss_scaler a({.init_scale = 3.0 / 7.0, .growth_interval = 5});
  scaler_fake_ddp ddp;
  CHECK(a.unscale(ddp));
  a.update();
  dtrain::loss_scaler b;
  b.load_state(a.state());
  CHECK(b.scale() == a.scale());  // every bit: %a
  CHECK(b.growth_tracker() == 1u);
  CHECK(b.state() == a.state());
  for (const std::string bad : {"", "dtrain.loss_scaler 2 scale 0x1p+0 growth_tracker 0 skipped 0",
                                "dtrain.loss_scaler 1 scale inf growth_tracker 0 skipped 0",
                                "dtrain.loss_scaler 1 scale 0x1p+0 growth_tracker -1 skipped 0",
                                "dtrain.loss_scaler 1 scale 0x1p+0 growth_tracker 0"}) {
    CAPTURE(bad);
    const std::string e = scaler_error([&] { b.load_state(bad); });
    CHECK(e.find("is not a loss scaler's") != std::string::npos);
  }
  CHECK(b.state() == a.state());  // nothing changed
}

TEST_CASE("loss_scaler: state() between check and update is what update() will leave") {
  for (const bool inf : {false, true}) {
    CAPTURE(inf);
    dtrain::loss_scaler scaler({.init_scale = 64, .growth_interval = 1});
    scaler_fake_ddp ddp;
    ddp.others_found_inf = inf;
    static_cast<void>(scaler.check(ddp));
    const std::string mid_step = scaler.state();
    dtrain::loss_scaler resumed;
    resumed.load_state(mid_step);
    scaler.update();
    CHECK(scaler.state() == mid_step);
    CHECK(resumed.scale() == (inf ? 32.0 : 128.0));
    CHECK(resumed.skipped_steps() == (inf ? 1u : 0u));
  }
}
