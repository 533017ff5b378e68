// distributed_sampler: every rank's share of a dataset, as torch's
// DistributedSampler (disjoint shards, padding or drop_last, the same
// length on every rank, a new order per epoch, the same on every rank).

#include "support.hpp"

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <string>
#include <vector>

namespace {

using dtrain::distributed_sampler;
using dtrain::sampler_options;

std::vector<std::size_t> copy(std::span<const std::size_t> s) { return {s.begin(), s.end()}; }

/// Every rank's shard, as each rank would compute it on its own.
std::vector<std::vector<std::size_t>> shards(std::size_t n, int world_size, sampler_options o,
                                             std::uint64_t epoch = 0) {
  std::vector<std::vector<std::size_t>> out;
  for (int r = 0; r < world_size; ++r) {
    distributed_sampler s(n, r, world_size, o);
    s.set_epoch(epoch);
    CHECK(s.indices().size() == s.size());
    out.push_back(copy(s.indices()));
  }
  return out;
}

/// The global list the ranks took strided slices of: entry k*W + r is rank r's k-th.
std::vector<std::size_t> interleave(const std::vector<std::vector<std::size_t>>& parts) {
  std::vector<std::size_t> all;
  for (std::size_t k = 0; k < parts[0].size(); ++k) {
    for (const auto& p : parts) all.push_back(p[k]);
  }
  return all;
}

bool is_permutation_of_range(std::vector<std::size_t> v, std::size_t n) {
  if (v.size() != n) return false;
  std::ranges::sort(v);
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] != i) return false;
  }
  return true;
}

}  // namespace

TEST_CASE(
    "distributed_sampler: without shuffle, rank r takes r, r + W, r + 2W, ... padded from the "
    "start") {
  // 10 samples on 4 ranks: 3 each, the list 0..9 padded with 0, 1.
  const auto parts = shards(10, 4, {.shuffle = false});
  CHECK(parts[0] == std::vector<std::size_t>{0, 4, 8});
  CHECK(parts[1] == std::vector<std::size_t>{1, 5, 9});
  CHECK(parts[2] == std::vector<std::size_t>{2, 6, 0});
  CHECK(parts[3] == std::vector<std::size_t>{3, 7, 1});
  // Evenly divisible: no padding.
  const auto even = shards(12, 3, {.shuffle = false});
  CHECK(even[1] == std::vector<std::size_t>{1, 4, 7, 10});
}

TEST_CASE("distributed_sampler: drop_last truncates to a multiple of the world size") {
  const auto parts = shards(10, 4, {.shuffle = false, .drop_last = true});
  for (const auto& p : parts) CHECK(p.size() == 2);
  CHECK(parts[0] == std::vector<std::size_t>{0, 4});
  CHECK(parts[3] == std::vector<std::size_t>{3, 7});
  CHECK(is_permutation_of_range(interleave(parts), 8));
}

TEST_CASE("distributed_sampler: sizes equal on every rank, as torch's num_samples") {
  for (std::size_t n : {1u, 2u, 5u, 7u, 10u, 16u, 99u, 100u, 101u}) {
    for (int w : {1, 2, 3, 4, 7}) {
      for (bool drop_last : {false, true}) {
        const std::size_t expected =
            drop_last ? n / static_cast<std::size_t>(w)
                      : (n + static_cast<std::size_t>(w) - 1) / static_cast<std::size_t>(w);
        INFO("n=" << n << " world_size=" << w << " drop_last=" << drop_last);
        if (expected == 0) {
          // Documented: a rank with nothing to do is a config_error, not an empty epoch.
          CHECK_THROWS_AS(distributed_sampler(n, 0, w, {.drop_last = drop_last}),
                          dtrain::config_error);
          continue;
        }
        for (int r = 0; r < w; ++r) {
          distributed_sampler s(n, r, w, {.seed = 3, .drop_last = drop_last});
          CHECK(s.size() == expected);
          CHECK(s.indices().size() == expected);
        }
      }
    }
  }
}

TEST_CASE(
    "distributed_sampler: shuffled shards are disjoint, cover every index, and pad with the "
    "start") {
  for (std::size_t n : {7u, 10u, 64u, 101u}) {
    for (int w : {1, 2, 3, 4}) {
      INFO("n=" << n << " world_size=" << w);
      const auto parts = shards(n, w, {.seed = 17}, 5);
      const auto all = interleave(parts);
      const std::size_t total = all.size();
      REQUIRE(total >= n);
      // The first n entries are a permutation of 0..n-1 (so the shards are disjoint but for
      // padding) ...
      CHECK(
          is_permutation_of_range({all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n)}, n));
      // ... and the padding repeats the start of that permutation.
      for (std::size_t j = n; j < total; ++j) CHECK(all[j] == all[j - n]);
      CHECK(total - n < static_cast<std::size_t>(w));

      const auto dropped = interleave(shards(n, w, {.seed = 17, .drop_last = true}, 5));
      std::vector<std::size_t> sorted = dropped;
      std::ranges::sort(sorted);
      CHECK(std::ranges::adjacent_find(sorted) == sorted.end());  // no index twice
      CHECK(dropped.size() == n / static_cast<std::size_t>(w) * static_cast<std::size_t>(w));
      for (std::size_t i : dropped) CHECK(i < n);
    }
  }
}

TEST_CASE("distributed_sampler: fewer samples than ranks repeat the start as often as needed") {
  // torch: [0, 1] on 5 ranks -> [0, 1, 0, 1, 0].
  const auto parts = shards(2, 5, {.shuffle = false});
  CHECK(interleave(parts) == std::vector<std::size_t>{0, 1, 0, 1, 0});
}

TEST_CASE(
    "distributed_sampler: the order changes with the epoch, and is the same for the same seed and "
    "epoch") {
  distributed_sampler a(1000, 1, 4, {.seed = 42});
  distributed_sampler b(1000, 1, 4, {.seed = 42});
  const auto epoch0 = copy(a.indices());
  CHECK(copy(b.indices()) == epoch0);  // same seed, epoch 0, two samplers (two processes)
  a.set_epoch(1);
  const auto epoch1 = copy(a.indices());
  CHECK(epoch1 != epoch0);
  b.set_epoch(1);
  CHECK(copy(b.indices()) == epoch1);
  a.set_epoch(0);
  CHECK(copy(a.indices()) == epoch0);  // an epoch's order does not depend on the epochs before it

  distributed_sampler other_seed(1000, 1, 4, {.seed = 43});
  CHECK(copy(other_seed.indices()) != epoch0);

  // Shuffled means not the strided order, and the whole list changes between epochs on every rank.
  distributed_sampler plain(1000, 1, 4, {.shuffle = false});
  CHECK(copy(plain.indices()) != epoch0);
  CHECK(interleave(shards(1000, 4, {.seed = 42}, 0)) !=
        interleave(shards(1000, 4, {.seed = 42}, 1)));
  // Without shuffle the epoch changes nothing.
  const auto before = copy(plain.indices());
  plain.set_epoch(9);
  CHECK(copy(plain.indices()) == before);
}

TEST_CASE("distributed_sampler: batches cut indices() into batch_size pieces, the last one short") {
  distributed_sampler s(103, 2, 4, {.seed = 1});  // 26 per rank
  REQUIRE(s.size() == 26);
  const auto batches = s.batches(8);
  REQUIRE(batches.size() == 4);
  CHECK(batches[0].size() == 8);
  CHECK(batches[1].size() == 8);
  CHECK(batches[2].size() == 8);
  CHECK(batches[3].size() == 2);
  std::vector<std::size_t> joined;
  for (auto b : batches) joined.insert(joined.end(), b.begin(), b.end());
  CHECK(joined == copy(s.indices()));
  CHECK(s.batches(26).size() == 1);
  CHECK(s.batches(100).size() == 1);
  CHECK(s.batches(1).size() == 26);
  // Every rank the same batch count and sizes: the ranks step together.
  for (int r = 0; r < 4; ++r) {
    distributed_sampler other(103, r, 4, {.seed = 1});
    const auto theirs = other.batches(8);
    REQUIRE(theirs.size() == batches.size());
    for (std::size_t k = 0; k < theirs.size(); ++k) CHECK(theirs[k].size() == batches[k].size());
  }
  CHECK_THROWS_AS((void)s.batches(0), dtrain::config_error);
}

TEST_CASE(
    "distributed_sampler: rank and world size from a world, and bad ones are a config_error") {
  dtrain::world w;
  w.rank = 2;
  w.world_size = 3;
  distributed_sampler from_world(50, w, {.seed = 8});
  distributed_sampler explicit_rank(50, 2, 3, {.seed = 8});
  CHECK(copy(from_world.indices()) == copy(explicit_rank.indices()));

  const auto text = dtrain_test::config_error_text([] { (void)distributed_sampler(10, 3, 3); });
  CHECK_CONTAINS(text, "rank 3");
  CHECK_CONTAINS(text, "world size 3");
  (void)dtrain_test::config_error_text([] { (void)distributed_sampler(10, -1, 3); });
  (void)dtrain_test::config_error_text([] { (void)distributed_sampler(10, 0, 0); });
  dtrain::world agent;  // no rank: an agent's world
  agent.world_size = 2;
  (void)dtrain_test::config_error_text([&] { (void)distributed_sampler(10, agent); });
  (void)dtrain_test::config_error_text(
      [] { (void)distributed_sampler(0, 0, 2); });  // nothing to sample
}
