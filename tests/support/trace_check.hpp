// The timeline's device spans read back from a rank's trace (issue 51), for
// the tests of DDP on streams: tests/engines/nccl_ranks.cpp (the NCCL engine
// over its fake, or on a GPU) and tests/ddp/ddp_device_rules.cpp.
#pragma once

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain_test {

/// A collective as a fake device ran it: its start and completion on the
/// host's steady clock (ns), the timeline's clock.
struct collective_run {
  std::int64_t start, end;
};

struct device_span_check {
  std::size_t spans = 0;      ///< on the device track
  double uncertainty_us = 0;  ///< the device clock's tie to the host's, as the file states
};

/// Reads the trace `file` and checks that device time is on (the file states
/// the clock's uncertainty), that every bucket launched has a span on the
/// device track, and that each bucket's span ends where a device span ends.
/// With `ran` (a fake device's log), each device span must hold a collective
/// the device ran, from its start to its completion, within the uncertainty:
/// it ends once the collective completed, not when the host enqueued it.
/// Throws std::runtime_error("FAIL: ...") naming what is wrong.
inline device_span_check check_device_spans(const std::string& file,
                                            const std::vector<collective_run>* ran) {
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) throw std::runtime_error("FAIL: " + file + ": " + what);
  };
  std::string text;
  {
    std::ifstream in(file);
    expect(in.good(), "the timeline was not written");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto trace = dtrain::detail::json::parse(text, file);
  auto number = [](const dtrain::detail::json::value* v) { return v ? std::stod(v->text) : -1.0; };
  const auto* other = trace.find("otherData");
  const auto* events = trace.find("traceEvents");
  expect(other && events, "not a dtrain trace");
  device_span_check out;
  out.uncertainty_us = number(other->find("device_clock_uncertainty_us"));
  expect(out.uncertainty_us >= 0, "it states no device clock: device time is off");
  struct span {
    double start, end;
  };
  std::vector<span> device;
  std::map<std::string, double> launched, ended;  // the bucket spans, by id
  for (const auto& e : events->items) {
    const auto* cat = e.find("cat");
    const auto* ph = e.find("ph");
    if (!cat || !ph) continue;
    const double ts = number(e.find("ts"));
    if (cat->text == "device") device.push_back({ts, ts + number(e.find("dur"))});
    if (cat->text == "bucket" && ph->text == "b") launched[e.find("id")->text] = ts;
    if (cat->text == "bucket" && ph->text == "e") ended[e.find("id")->text] = ts;
  }
  out.spans = device.size();
  expect(!launched.empty() && device.size() == launched.size(),
         std::to_string(launched.size()) + " buckets launched, " + std::to_string(device.size()) +
             " spans on the device track");
  expect(ended.size() == launched.size(), "a bucket's span was never closed");
  constexpr double rounding = 0.002;  // us: times are written to the ns, added back here
  for (const auto& [id, end] : ended) {
    const bool on_device = std::ranges::any_of(
        device, [&](const span& d) { return std::fabs(d.end - end) <= rounding; });
    expect(on_device, "bucket span " + id + " ends at " + std::to_string(end) +
                          " us, where no device span ends");
    const auto begun = launched.find(id);
    expect(begun != launched.end(), "bucket span " + id + " ends but never began");
    expect(begun->second <= end, "bucket span " + id + " ends before it starts");
  }
  if (ran) {
    const double slack = out.uncertainty_us + rounding;
    for (const span& d : device) {
      const bool holds = std::ranges::any_of(*ran, [&](const collective_run& r) {
        return static_cast<double>(r.start) / 1e3 >= d.start - slack &&
               static_cast<double>(r.end) / 1e3 <= d.end + slack;
      });
      expect(holds, "the device span [" + std::to_string(d.start) + ", " + std::to_string(d.end) +
                        "] us holds no collective the device ran (it ends before one completed)");
    }
  }
  return out;
}

}  // namespace dtrain_test
