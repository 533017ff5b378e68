// DistributedDataParallel's bucket assignment (dtrain::detail::assign_buckets):
// a pure function of the parameters, the order their gradients become ready
// and the caps, so it is tested here without any communication.
//
// The rule is PyTorch DDP's. Every layout marked "PyTorch:" below is what
// torch.distributed._compute_bucket_assignment_by_size (PyTorch 1.13,
// Debian's python3-torch) returns for the same sizes, types, caps and order:
//   f([tensors[i] for i in order], [first_cap, cap], [False] * n, order)[0]
// (PyTorch lists buckets in the order they close; dtrain in the order of their
// first parameter, which is their launch order: same buckets, maybe reordered.)

#include "support.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using dtrain::bucket_info;
using dtrain::dtype;
using dtrain::parameter;
using layout_t = std::vector<std::vector<std::size_t>>;

/// "p3": appended, as GCC 12 reports a false -Wrestrict for "p" + std::to_string(3) at -O2.
std::string numbered(const char* prefix, std::size_t i) {
  std::string name = prefix;
  name += std::to_string(i);
  return name;
}

/// A parameter as assign_buckets sees it: only name, count, type and device matter.
parameter fake(std::string name, std::size_t count, dtype type = dtype::float32, int device = -1) {
  parameter p;
  p.name = std::move(name);
  p.values = {nullptr, count, type, device < 0 ? dtrain::memory::host : dtrain::memory::device};
  p.device = device;
  return p;
}

/// `n` float parameters of `count` elements each, named p0, p1, ...
std::vector<parameter> floats(std::size_t n, std::size_t count) {
  std::vector<parameter> ps;
  for (std::size_t i = 0; i < n; ++i) ps.push_back(fake(numbered("p", i), count));
  return ps;
}

layout_t layout(const std::vector<bucket_info>& buckets) {
  layout_t out;
  for (const auto& b : buckets) out.push_back(b.parameters);
  return out;
}

std::string show(const std::vector<bucket_info>& buckets) {
  std::string s;
  for (const auto& b : buckets) {
    s += "[";
    for (std::size_t i = 0; i < b.parameters.size(); ++i) {
      if (i) s += ",";
      s += std::to_string(b.parameters[i]);
    }
    s += " ";
    s += dtrain::to_string(b.type);
    s += " dev ";
    s += std::to_string(b.device);
    s += " ";
    s += std::to_string(b.bytes);
    s += "B] ";
  }
  return s;
}

std::vector<bucket_info> assign(const std::vector<parameter>& ps,
                                const std::vector<std::size_t>& order, std::size_t first_cap,
                                std::size_t cap) {
  return dtrain::detail::assign_buckets(ps, order, first_cap, cap);
}

/// The same buckets, in any order: what PyTorch's layout is compared by.
layout_t sorted(layout_t l) {
  std::ranges::sort(l);
  return l;
}

/// An MLP's parameters, as its layers list them: w1 (in x out), b1, w2, b2, ...
std::vector<parameter> mlp(const std::vector<std::size_t>& dims) {
  std::vector<parameter> ps;
  for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
    ps.push_back(fake(numbered("w", l + 1), dims[l] * dims[l + 1]));
    ps.push_back(fake(numbered("b", l + 1), dims[l + 1]));
  }
  return ps;
}

/// Every parameter in exactly one bucket; each bucket one (type, device);
/// count and bytes the sums of its parameters'.
void check_partition(const std::vector<parameter>& ps, const std::vector<bucket_info>& buckets) {
  std::vector<int> seen(ps.size(), 0);
  for (const auto& b : buckets) {
    CHECK_MESSAGE(!b.parameters.empty(), "an empty bucket in " << show(buckets));
    std::size_t count = 0, bytes = 0;
    for (std::size_t i : b.parameters) {
      REQUIRE(i < ps.size());
      ++seen[i];
      CHECK_MESSAGE(ps[i].values.type == b.type,
                    "parameter " << i << " of another type in " << show(buckets));
      CHECK_MESSAGE(ps[i].device == b.device,
                    "parameter " << i << " of another device in " << show(buckets));
    }
    // Slots in layout order, without overlap; GPU slots start on bucket_alignment,
    // host slots are packed; bytes end at the last slot, count covers them.
    REQUIRE(b.offsets.size() == b.parameters.size());
    for (std::size_t k = 0; k < b.parameters.size(); ++k) {
      const parameter& p = ps[b.parameters[k]];
      if (b.device >= 0) {
        CHECK(b.offsets[k] % dtrain::bucket_alignment == 0);
        CHECK(b.offsets[k] < bytes + dtrain::bucket_alignment);
      } else {
        CHECK(b.offsets[k] == bytes);
      }
      CHECK(b.offsets[k] >= bytes);
      bytes = b.offsets[k] + p.values.bytes();
      count += p.values.count;
    }
    CHECK(b.bytes == bytes);
    CHECK(b.count * dtrain::size_of(b.type) == bytes);
    CHECK(b.count >= count);
  }
  for (std::size_t i = 0; i < ps.size(); ++i) {
    CHECK_MESSAGE(seen[i] == 1,
                  "parameter " << i << " is in " << seen[i] << " buckets: " << show(buckets));
  }
}

}  // namespace

TEST_CASE("assign_buckets: reverse order, a small first bucket, then buckets closing at the cap") {
  const auto ps = floats(6, 100);  // 400 bytes each
  const auto order = dtrain::detail::reverse_order(ps.size());
  CHECK(order == std::vector<std::size_t>{5, 4, 3, 2, 1, 0});
  const auto buckets = assign(ps, order, 800, 1200);
  check_partition(ps, buckets);
  // PyTorch: [[5, 4], [3, 2, 1], [0]]
  CHECK_MESSAGE((layout(buckets) == layout_t{{5, 4}, {3, 2, 1}, {0}}), show(buckets));
  REQUIRE(buckets.size() == 3);
  CHECK(buckets[0].count == 200);
  CHECK(buckets[0].bytes == 800);
  CHECK(buckets[1].bytes == 1200);
  CHECK(buckets[2].bytes == 400);
  for (const auto& b : buckets) {
    CHECK(b.type == dtype::float32);
    CHECK(b.device == -1);
  }
}

TEST_CASE("assign_buckets: caps are soft, a bucket closes once it reaches its cap") {
  const auto ps = floats(5, 100);  // 400 bytes each
  // 500 bytes: the second parameter takes the bucket past the cap, and closes it.
  const auto buckets = assign(ps, dtrain::detail::reverse_order(5), 500, 500);
  check_partition(ps, buckets);
  // PyTorch: [[4, 3], [2, 1], [0]]
  CHECK_MESSAGE((layout(buckets) == layout_t{{4, 3}, {2, 1}, {0}}), show(buckets));
}

TEST_CASE("assign_buckets: caps larger than the model give one bucket in the fill order") {
  const auto ps = floats(7, 33);
  const auto buckets = assign(ps, dtrain::detail::reverse_order(7), 1 << 20, 25 << 20);
  check_partition(ps, buckets);
  CHECK_MESSAGE((layout(buckets) == layout_t{{6, 5, 4, 3, 2, 1, 0}}), show(buckets));
}

TEST_CASE("assign_buckets: by unit (stage 3), no bucket holds two units, caps still apply") {
  // Units 0 0 1 1 1 2 (-1 counts as a unit of its own), 10 floats each; reverse order.
  auto ps = floats(7, 10);
  const std::int64_t units[] = {0, 0, 1, 1, 1, 2, -1};
  for (std::size_t i = 0; i < ps.size(); ++i) ps[i].unit = units[i];
  const auto order = dtrain::detail::reverse_order(7);
  auto buckets = dtrain::detail::assign_buckets(ps, order, 1 << 20, 25 << 20, true);
  check_partition(ps, buckets);
  CHECK_MESSAGE((layout(buckets) == layout_t{{6}, {5}, {4, 3, 2}, {1, 0}}), show(buckets));
  // Within a unit the cap still closes buckets: 80 bytes close after two.
  buckets = dtrain::detail::assign_buckets(ps, order, 80, 80, true);
  check_partition(ps, buckets);
  CHECK_MESSAGE((layout(buckets) == layout_t{{6}, {5}, {4, 3}, {2}, {1, 0}}), show(buckets));
  // Without by_unit the units are ignored (stages 0-2).
  buckets = dtrain::detail::assign_buckets(ps, order, 1 << 20, 25 << 20);
  CHECK_MESSAGE((layout(buckets) == layout_t{{6, 5, 4, 3, 2, 1, 0}}), show(buckets));
}

TEST_CASE("assign_buckets: a one-byte cap gives one bucket per parameter, in the fill order") {
  const auto ps = floats(4, 10);
  const std::vector<std::size_t> order{2, 0, 3, 1};
  const auto buckets = assign(ps, order, 1, 1);
  check_partition(ps, buckets);
  // PyTorch: [[2], [0], [3], [1]]
  CHECK_MESSAGE((layout(buckets) == layout_t{{2}, {0}, {3}, {1}}), show(buckets));
}

TEST_CASE("assign_buckets: a parameter larger than the cap joins the open bucket and closes it") {
  // 40 B, 4000 B, 40 B, 40 B with a 100-byte cap: the big one closes the bucket
  // the small one before it opened; no bucket is cut short to keep it out.
  std::vector<parameter> ps{fake("a", 10), fake("big", 1000), fake("c", 10), fake("d", 10)};
  const std::vector<std::size_t> order{0, 1, 2, 3};
  const auto buckets = assign(ps, order, 100, 100);
  check_partition(ps, buckets);
  // PyTorch: [[0, 1], [2, 3]]
  CHECK_MESSAGE((layout(buckets) == layout_t{{0, 1}, {2, 3}}), show(buckets));
}

TEST_CASE("assign_buckets: MLPs get PyTorch DDP's buckets, for the demo's caps and the defaults") {
  const std::size_t KiB = 1024, MiB = 1024 * 1024;
  struct example {
    std::vector<std::size_t> dims;
    std::size_t first_cap, cap;
    layout_t pytorch;
  };
  const std::vector<example> examples{
      // The demo (examples/train_mlp.cpp): 32-64-64-8 with 4 KiB / 16 KiB caps.
      {{32, 64, 64, 8}, 4 * KiB, 16 * KiB, {{5, 4, 3, 2}, {1, 0}}},
      {{32, 64, 64, 8}, 1 * MiB, 25 * MiB, {{5, 4, 3, 2, 1, 0}}},
      // The wide model: 1024-1024-1024-8.
      {{1024, 1024, 1024, 8}, 4 * KiB, 16 * KiB, {{5, 4}, {3, 2}, {1, 0}}},
      {{1024, 1024, 1024, 8}, 1 * MiB, 25 * MiB, {{5, 4, 3, 2}, {1, 0}}},
      {{32, 1024, 1024, 8}, 1 * MiB, 25 * MiB, {{5, 4, 3, 2}, {1, 0}}},
  };
  for (const auto& e : examples) {
    const auto ps = mlp(e.dims);
    const auto buckets = assign(ps, dtrain::detail::reverse_order(ps.size()), e.first_cap, e.cap);
    INFO("dims " << e.dims.size() << " layers from " << e.dims.front() << ", caps " << e.first_cap
                 << "/" << e.cap);
    check_partition(ps, buckets);
    CHECK_MESSAGE(layout(buckets) == e.pytorch, show(buckets));
  }
}

TEST_CASE(
    "assign_buckets: element types are never mixed, buckets ordered by their first parameter") {
  // f0 d1 f2 d3 f4 d5, filled in reverse: d5 comes first, so the float64 bucket launches first.
  std::vector<parameter> ps;
  for (std::size_t i = 0; i < 6; ++i) {
    ps.push_back(fake(numbered("p", i), 100, i % 2 ? dtype::float64 : dtype::float32));
  }
  const auto buckets = assign(ps, dtrain::detail::reverse_order(6), 1 << 20, 1 << 20);
  check_partition(ps, buckets);
  // PyTorch: [[4, 2, 0], [5, 3, 1]], and forward [[1, 3, 5], [0, 2, 4]]: the same buckets.
  CHECK(sorted(layout(buckets)) == sorted({{4, 2, 0}, {5, 3, 1}}));
  REQUIRE_MESSAGE(buckets.size() == 2, show(buckets));
  CHECK(buckets[0].type == dtype::float64);
  CHECK(buckets[0].parameters == std::vector<std::size_t>{5, 3, 1});
  CHECK(buckets[0].bytes == 3 * 800);
  CHECK(buckets[1].type == dtype::float32);
  CHECK(buckets[1].parameters == std::vector<std::size_t>{4, 2, 0});
  CHECK(buckets[1].bytes == 3 * 400);

  // Forward: f0 comes first.
  const std::vector<std::size_t> forward{0, 1, 2, 3, 4, 5};
  const auto fwd = assign(ps, forward, 1 << 20, 1 << 20);
  REQUIRE_MESSAGE(fwd.size() == 2, show(fwd));
  CHECK(fwd[0].type == dtype::float32);
  CHECK(fwd[0].parameters == std::vector<std::size_t>{0, 2, 4});
}

TEST_CASE("assign_buckets: each element type gets its own small first bucket") {
  // Four floats (400 B) and four doubles (800 B), interleaved; first cap 400 B.
  std::vector<parameter> ps;
  for (std::size_t i = 0; i < 8; ++i) {
    ps.push_back(fake(numbered("p", i), 100, i % 2 ? dtype::float64 : dtype::float32));
  }
  const auto buckets = assign(ps, dtrain::detail::reverse_order(8), 400, 1 << 20);
  check_partition(ps, buckets);
  // d7 | f6 | d5 d3 d1 | f4 f2 f0, ordered by first position: d7 (0), f6 (1), d5 (2), f4 (3).
  // PyTorch: [[7], [6], [4, 2, 0], [5, 3, 1]]: the same buckets.
  CHECK(sorted(layout(buckets)) == sorted({{7}, {6}, {4, 2, 0}, {5, 3, 1}}));
  CHECK_MESSAGE((layout(buckets) == layout_t{{7}, {6}, {5, 3, 1}, {4, 2, 0}}), show(buckets));
}

TEST_CASE("assign_buckets: devices are never mixed") {
  std::vector<parameter> ps{fake("h0", 10), fake("g0a", 10, dtype::float32, 0),
                            fake("g1", 10, dtype::float32, 1), fake("g0b", 10, dtype::float32, 0),
                            fake("h1", 10)};
  const auto buckets = assign(ps, dtrain::detail::reverse_order(5), 1 << 20, 1 << 20);
  check_partition(ps, buckets);
  // h1 (host, position 0), g0b (device 0, position 1), g1 (device 1, position 2).
  CHECK_MESSAGE((layout(buckets) == layout_t{{4, 0}, {3, 1}, {2}}), show(buckets));
  REQUIRE(buckets.size() == 3);
  CHECK(buckets[0].device == -1);
  CHECK(buckets[1].device == 0);
  CHECK(buckets[2].device == 1);
  // Host slots are packed; GPU slots start 256 bytes apart (10 floats each).
  CHECK(buckets[0].offsets == std::vector<std::size_t>{0, 40});
  CHECK(buckets[0].count == 20);
  CHECK(buckets[1].offsets == std::vector<std::size_t>{0, 256});
  CHECK(buckets[1].bytes == 296);
  CHECK(buckets[1].count == 74);
}

TEST_CASE("assign_buckets: a rebuild follows the observed ready order") {
  const auto ps = floats(6, 100);  // 400 bytes each
  const auto initial = assign(ps, dtrain::detail::reverse_order(6), 800, 800);
  // PyTorch: [[5, 4], [3, 2], [1, 0]], then [[2, 0], [5, 1], [3, 4]] for the observed order.
  CHECK_MESSAGE((layout(initial) == layout_t{{5, 4}, {3, 2}, {1, 0}}), show(initial));
  // Gradients became ready as 2, 0, 5, 1, 3, 4: buckets are cut along that order.
  const std::vector<std::size_t> observed{2, 0, 5, 1, 3, 4};
  const auto rebuilt = assign(ps, observed, 800, 800);
  check_partition(ps, rebuilt);
  CHECK_MESSAGE((layout(rebuilt) == layout_t{{2, 0}, {5, 1}, {3, 4}}), show(rebuilt));
}

TEST_CASE(
    "assign_buckets: random models are partitioned, each bucket below its cap before its last "
    "parameter") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t n = 1 + rng() % 40;
    std::vector<parameter> ps;
    for (std::size_t i = 0; i < n; ++i) {
      const dtype t =
          rng() % 3 == 0 ? dtype::float64 : (rng() % 4 == 0 ? dtype::bfloat16 : dtype::float32);
      ps.push_back(fake(numbered("p", i), 1 + rng() % 300, t, static_cast<int>(rng() % 2) - 1));
    }
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    const std::size_t first_cap = 1 + rng() % 3000, cap = 1 + rng() % 6000;
    const auto buckets = assign(ps, order, first_cap, cap);
    INFO("trial " << trial << ": " << n << " parameters, caps " << first_cap << "/" << cap << ": "
                  << show(buckets));
    check_partition(ps, buckets);

    // No bucket is smaller than it needs to be: every bucket but the last of
    // its (type, device) holds at least its cap (the group's first: first_cap).
    std::map<std::pair<int, int>, std::vector<std::size_t>>
        groups;  // bucket sizes, in launch order
    for (const auto& b : buckets) groups[{static_cast<int>(b.type), b.device}].push_back(b.bytes);
    for (const auto& [key, sizes] : groups) {
      for (std::size_t k = 0; k + 1 < sizes.size(); ++k)
        CHECK(sizes[k] >= (k == 0 ? first_cap : cap));
    }

    std::vector<std::size_t> position(n);
    for (std::size_t k = 0; k < n; ++k) position[order[k]] = k;
    std::size_t previous_first = 0;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const auto& params = buckets[b].parameters;
      // Laid out in fill order, buckets in the order of their first parameter.
      for (std::size_t k = 1; k < params.size(); ++k)
        CHECK(position[params[k - 1]] < position[params[k]]);
      if (b > 0) CHECK(position[params.front()] > previous_first);
      previous_first = position[params.front()];
      // Soft cap: the bucket was below the larger cap before its last parameter joined.
      // (GPU slots are aligned: the bucket ended where its second-to-last slot did.)
      const std::size_t n_in = params.size();
      const std::size_t before_last =
          n_in < 2 ? 0 : buckets[b].offsets[n_in - 2] + ps[params[n_in - 2]].bytes();
      CHECK(before_last < std::max(first_cap, cap));
    }
  }
}

TEST_CASE("assign_buckets: an order that is not a permutation of the parameters is refused") {
  const auto ps = floats(4, 10);
  const std::vector<std::size_t> duplicate{3, 2, 2, 0};
  try {
    (void)assign(ps, duplicate, 100, 100);
    FAIL("a duplicate in the order was accepted");
  } catch (const dtrain::error& e) {
    CHECK_CONTAINS(e.what(), "#2 twice");
  }
  const std::vector<std::size_t> too_short{3, 2, 1};
  CHECK_THROWS_AS((void)assign(ps, too_short, 100, 100), dtrain::error);
  const std::vector<std::size_t> out_of_range{3, 2, 1, 4};
  CHECK_THROWS_AS((void)assign(ps, out_of_range, 100, 100), dtrain::error);
}

TEST_CASE(
    "mib_to_bytes: MiB as bucket_cap_mb means them, nonsense is a config_error naming the option") {
  CHECK(dtrain::mib_to_bytes(25, "bucket_cap_mb") == 25u * 1024u * 1024u);
  CHECK(dtrain::mib_to_bytes(0.5, "bucket_cap_mb") == 512u * 1024u);
  CHECK(dtrain::mib_to_bytes(1e-12, "bucket_cap_mb") == 1u);  // never a zero cap
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    const auto text = dtrain_test::config_error_text(
        [&] { (void)dtrain::mib_to_bytes(bad, "first_bucket_cap_mb"); });
    CHECK_CONTAINS(text, "first_bucket_cap_mb");
  }
}
