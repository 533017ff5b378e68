// dtrain_gloo_tests: one rank of a Gloo job. Ranks meet through the store
// (rank 0 hosts it on MASTER_PORT), as under torchrun: no mpirun. Started by
// dtrain_test_launch N, or alone (no RANK: a world of one on a free port).
//
//   dtrain_gloo_tests [doctest options]       the suite and the Gloo tests
//   dtrain_gloo_tests --mode=dead-peer        rank 1 dies in the middle of a
//                                             64 MiB allreduce (or, through shared
//                                             memory, before the next); the others
//                                             must fail at once, not hang
//   dtrain_gloo_tests --mode=hung-peer        rank 1 never joins an allreduce;
//                                             the others must time out
// In the failure modes each surviving rank prints one line
// "rank R: <mode> detected ..." and exits 0, or explains and exits 1.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <dtrain/backend/gloo/gloo.hpp>
#include <dtrain/dtrain.hpp>

#include "collective_suite.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

// GCC 12 at -O3 inlines the replacement operator delete below into its callers
// and then sees free() on a pointer from "operator new": the pair is malloc and
// free, so the warning is a false positive here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

// While set, every allocation of this thread through operator new fails: how
// the tests below run the execution path out of memory. Off, operator new is
// malloc, as the library's own.
thread_local bool allocations_fail = false;

void* operator new(std::size_t bytes) {
  if (allocations_fail) throw std::bad_alloc();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

struct job {
  int rank = 0;
  int size = 1;
  dtrain::collective_options collectives;
  std::unique_ptr<dtrain::store_server> server;  // rank 0
  std::unique_ptr<dtrain::store_client> store;
  std::unique_ptr<dtrain::gloo_communicator> comm;
};

job* the_job = nullptr;

job& world() { return *the_job; }

dtrain::gloo_options options_with(dtrain::collective_options collectives) {
  // The interface variables and MASTER_ADDR come from this process's environment, as under run().
  return {.collectives = collectives, .env = dtrain::environment::from_process()};
}

using seconds = std::chrono::duration<double>;

// ---------------------------------------------------------------------------
// Failure modes: run instead of doctest.

int dead_peer(job& j) {
  j.comm->barrier().wait();                             // everyone is connected
  std::vector<float> data(std::size_t{1} << 24, 1.0f);  // 64 MiB: over TCP, still moving when
                                                        // rank 1 dies
  if (j.rank == 1) {
    auto pending = dtrain::allreduce(*j.comm, std::span(data));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    std::fflush(nullptr);
    ::_exit(3);
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    // Through shared memory the first one can finish before rank 1 dies;
    // rank 1 never starts the second.
    dtrain::allreduce(*j.comm, std::span(data)).wait();
    dtrain::allreduce(*j.comm, std::span(data)).wait();
    std::printf("rank %d: the allreduces succeeded although rank 1 is dead\n", j.rank);
    return 1;
  } catch (const dtrain::error& e) {
    const double took = seconds(std::chrono::steady_clock::now() - start).count();
    const bool expected = dynamic_cast<const dtrain::backend_error*>(&e) ||
                          dynamic_cast<const dtrain::timeout_error*>(&e);
    const double limit = seconds(j.collectives.timeout).count();
    std::printf("rank %d: dead-peer %s after %.1f s (timeout %.1f s): %s\n", j.rank,
                expected && took < limit + 5 ? "detected" : "NOT detected as expected", took, limit,
                e.what());
    std::fflush(stdout);
    if (!expected || took >= limit + 5) return 1;
  }
  // Later calls fail at once, saying why.
  try {
    j.comm->barrier();
    std::printf("rank %d: a barrier on the broken communicator was accepted\n", j.rank);
    return 1;
  } catch (const dtrain::backend_error& e) {
    if (std::string(e.what()).find("unusable") == std::string::npos) {
      std::printf("rank %d: unexpected message: %s\n", j.rank, e.what());
      return 1;
    }
  }
  return 0;
}

int hung_peer(job& j) {
  j.comm->barrier().wait();
  std::vector<float> data(1000, 1.0f);
  if (j.rank == 1) {  // alive, but never joins the allreduce
    std::this_thread::sleep_for(j.collectives.timeout + std::chrono::seconds(2));
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    dtrain::allreduce(*j.comm, std::span(data)).wait();
    std::printf("rank %d: the allreduce succeeded although rank 1 never joined\n", j.rank);
    return 1;
  } catch (const dtrain::timeout_error& e) {
    const double took = seconds(std::chrono::steady_clock::now() - start).count();
    const double limit = seconds(j.collectives.timeout).count();
    const bool in_time = took >= limit * 0.9 && took < limit + 5;
    std::printf("rank %d: hung-peer %s after %.1f s (timeout %.1f s): %s\n", j.rank,
                in_time ? "detected" : "NOT detected in time", took, limit, e.what());
    std::fflush(stdout);
    if (!in_time) return 1;
  } catch (const dtrain::error& e) {
    std::printf("rank %d: expected a timeout_error, got: %s\n", j.rank, e.what());
    return 1;
  }
  try {
    dtrain::allreduce(*j.comm, std::span(data));
    std::printf("rank %d: an allreduce on the timed-out communicator was accepted\n", j.rank);
    return 1;
  } catch (const dtrain::backend_error& e) {
    if (std::string(e.what()).find("unusable") == std::string::npos) {
      std::printf("rank %d: unexpected message: %s\n", j.rank, e.what());
      return 1;
    }
  }
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------

TEST_CASE("gloo: the collective suite") { dtrain_test::run_collective_suite(*world().comm); }

TEST_CASE("gloo: collectives queued without waiting complete in order") {
  auto& comm = *world().comm;
  constexpr int count = 12;
  std::vector<std::vector<std::int64_t>> data(count);
  std::vector<dtrain::work> pending;
  for (int k = 0; k < count; ++k) {
    data[k].assign(static_cast<std::size_t>(1000 * k + 1), comm.rank() + k);
    pending.push_back(dtrain::allreduce(comm, std::span(data[k])));
  }
  // The same buffer twice in a row: the second allreduce sees the first one's result.
  std::vector<std::int64_t> twice(33, 1);
  pending.push_back(dtrain::allreduce(comm, std::span(twice)));
  pending.push_back(dtrain::allreduce(comm, std::span(twice)));
  for (auto it = pending.rbegin(); it != pending.rend(); ++it) it->wait();
  const std::int64_t n = comm.size();
  for (int k = 0; k < count; ++k) {
    const std::int64_t want = n * (n - 1) / 2 + n * k;
    CHECK_MESSAGE(
        std::all_of(data[k].begin(), data[k].end(), [&](std::int64_t v) { return v == want; }),
        "allreduce #" << k);
  }
  CHECK(std::all_of(twice.begin(), twice.end(), [&](std::int64_t v) { return v == n * n; }));
}

// Gloo 0.5.0's halving-doubling reduce-scatter corrupted blocks on 3 ranks
// when calls followed each other; dtrain must not (see gloo_run_reduce_scatter).
TEST_CASE("gloo: reduce_scatters back to back, mixed with other collectives") {
  auto& comm = *world().comm;
  const int rank = comm.rank(), size = comm.size();
  bool all_right = true;
  for (int round = 0; round < 12 && all_right; ++round) {
    for (std::size_t n : {std::size_t{1000}, std::size_t{333}}) {
      for (auto op : {dtrain::reduce_op::sum, dtrain::reduce_op::max}) {
        std::vector<double> in(n * static_cast<std::size_t>(size)), out(n);
        for (std::size_t j = 0; j < in.size(); ++j)
          in[j] = dtrain_test::input_value(op, rank, j + static_cast<std::size_t>(round));
        dtrain::reduce_scatter(comm, std::span<const double>(in), std::span(out), op).wait();
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t j =
              static_cast<std::size_t>(rank) * n + i + static_cast<std::size_t>(round);
          all_right = all_right && out[i] == dtrain_test::reduce_serial(op, size, j);
        }
      }
      std::vector<double> token(n, rank);
      dtrain::broadcast(comm, std::span(token), round % size).wait();
      all_right = all_right && token[n - 1] == round % size;
    }
  }
  CHECK(all_right);
}

TEST_CASE("gloo: allgather in place, reduce_scatter and allreduce of 16-bit floats by avg") {
  auto& comm = *world().comm;
  const int rank = comm.rank(), size = comm.size();
  const std::size_t n = 5;
  // In place: this rank's input is its own block of the output.
  std::vector<std::int32_t> gathered(n * static_cast<std::size_t>(size), -1);
  std::span<std::int32_t> block(gathered.data() + static_cast<std::size_t>(rank) * n, n);
  for (std::size_t i = 0; i < n; ++i) block[i] = rank * 100 + static_cast<std::int32_t>(i);
  dtrain::allgather(comm, std::span<const std::int32_t>(block), std::span(gathered)).wait();
  for (std::size_t j = 0; j < gathered.size(); ++j) {
    CHECK(gathered[j] == static_cast<std::int32_t>((j / n) * 100 + j % n));
  }

  std::vector<float> in(n * static_cast<std::size_t>(size)), out(n);
  for (std::size_t j = 0; j < in.size(); ++j)
    in[j] = static_cast<float>(rank + 1) * static_cast<float>(j);
  dtrain::reduce_scatter(comm, std::span<const float>(in), std::span(out), dtrain::reduce_op::avg)
      .wait();
  const float mean_factor = static_cast<float>(size + 1) / 2.0f;  // mean of 1..size
  for (std::size_t i = 0; i < n; ++i) {
    CHECK(out[i] == doctest::Approx(mean_factor *
                                    static_cast<float>(static_cast<std::size_t>(rank) * n + i)));
  }

  std::vector<dtrain::bfloat16> halves(3, dtrain::bfloat16(static_cast<float>(rank)));
  dtrain::allreduce(comm, std::span(halves), dtrain::reduce_op::avg).wait();
  CHECK(static_cast<float>(halves[2]) == doctest::Approx((size - 1) / 2.0).epsilon(0.01));
}

TEST_CASE("gloo: errors name the collective, the rank and the engine") {
  auto& comm = *world().comm;
  std::vector<float> data(8), small(3);
  const std::string where =
      "on rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " (gloo)";
  CHECK_THROWS_WITH_AS(dtrain::allgather(comm, std::span<const float>(data), std::span(small)),
                       doctest::Contains(("allgather(8 x float32) " + where).c_str()),
                       dtrain::config_error);
  std::vector<double> in(3 * static_cast<std::size_t>(comm.size()) + 1), out(3);
  CHECK_THROWS_WITH_AS(
      dtrain::reduce_scatter(comm, std::span<const double>(in), std::span(out)),
      doctest::Contains(("input has " + std::to_string(in.size()) + " elements").c_str()),
      dtrain::config_error);
  dtrain::buffer wrong{data.data(), data.size(), dtrain::dtype::float32, dtrain::memory::device};
  CHECK_THROWS_WITH_AS(comm.allreduce(wrong, wrong, dtrain::reduce_op::sum),
                       doctest::Contains("host memory only"), dtrain::config_error);
  // Nothing was queued by the rejected calls: the communicator still works.
  std::vector<float> ok(5, 1.0f);
  dtrain::allreduce(comm, std::span(ok)).wait();
  CHECK(ok[4] == static_cast<float>(comm.size()));
}

TEST_CASE("gloo: split into even and odd ranks, ordered by key") {
  auto& comm = *world().comm;
  const int color = comm.rank() % 2;
  // Key: reverse order of the old ranks, so the new rank is not the obvious one.
  auto half = comm.split(color, comm.size() - comm.rank());
  std::vector<int> members;
  for (int r = 0; r < comm.size(); ++r) {
    if (r % 2 == color) members.push_back(r);
  }
  std::reverse(members.begin(), members.end());
  REQUIRE(half.size() == static_cast<int>(members.size()));
  CHECK(members[static_cast<std::size_t>(half.rank())] == comm.rank());

  std::vector<double> data(10007);
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = comm.rank() + 1.0 + static_cast<double>(i % 3);
  dtrain::allreduce(half, std::span(data)).wait();
  double members_sum = 0;
  for (int r : members) members_sum += r + 1.0;
  bool all_right = true;
  for (std::size_t i = 0; i < data.size(); ++i) {
    all_right = all_right && data[i] == members_sum + static_cast<double>(members.size()) *
                                                          static_cast<double>(i % 3);
  }
  CHECK(all_right);

  // Broadcast from the new rank 0 (the highest old rank of the half).
  std::vector<std::int32_t> token(3, comm.rank());
  dtrain::broadcast(half, std::span(token), 0).wait();
  CHECK(token[0] == members.front());

  // The parent still works after the split, and a split of a split too.
  auto single = half.split(half.rank(), 0);
  CHECK(single.size() == 1);
  CHECK(single.rank() == 0);
  std::vector<float> one(4, 2.0f);
  dtrain::allreduce(single, std::span(one), dtrain::reduce_op::avg).wait();
  CHECK(one[3] == 2.0f);
  std::vector<float> all(4, 1.0f);
  dtrain::allreduce(comm, std::span(all)).wait();
  CHECK(all[0] == static_cast<float>(comm.size()));
}

TEST_CASE("gloo: a negative color to split() leaves the rank out") {
  dtrain_test::run_left_out_split(*world().comm);
}

TEST_CASE("gloo: the collective suite on a split with reversed ranks") {
  auto& comm = *world().comm;
  auto reversed = comm.split(0, -comm.rank());
  CHECK(reversed.rank() == comm.size() - 1 - comm.rank());
  dtrain_test::run_collective_suite(reversed);
}

TEST_CASE("gloo: check mode reports a count that differs between ranks") {
  auto& w = world();
  auto options = options_with(w.collectives);
  options.collectives.check = true;
  dtrain::gloo_communicator checked(*w.store, w.rank, w.size, options);

  // Matching calls still work in check mode, zero-length ones included.
  std::vector<float> good(6, 1.0f), none;
  dtrain::allreduce(checked, std::span(good)).wait();
  dtrain::allreduce(checked, std::span(none)).wait();
  CHECK(good[5] == static_cast<float>(w.size));
  if (w.size == 1) return;

  // Rank 0 passes 4 elements, the others 5: reported, not a hang or garbage.
  std::vector<float> data(w.rank == 0 ? 4 : 5, 1.0f);
  const std::string other = w.rank == 0
                                ? "rank 1 called collective #3: allreduce(sum, float32 \u00d7 5)"
                                : "rank 0 called collective #3: allreduce(sum, float32 \u00d7 4)";
  auto pending = dtrain::allreduce(checked, std::span(data));
  CHECK_THROWS_WITH_AS(pending.wait(), doctest::Contains(other.c_str()), dtrain::backend_error);
  CHECK_THROWS_WITH_AS(pending.wait(),
                       doctest::Contains(("allreduce(sum, " + std::to_string(data.size()) +
                                          " x float32) on rank " + std::to_string(w.rank))
                                             .c_str()),
                       dtrain::backend_error);
  CHECK(data[0] == 1.0f);  // the mismatched collective did not run
  // The communicator is now unusable, and says so at once.
  CHECK_THROWS_WITH_AS(checked.barrier(), doctest::Contains("unusable"), dtrain::backend_error);
}

// Every rank of these tests runs on this host, so allreduces go through shared
// memory (backend/gloo/shm.hpp) unless DTRAIN_GLOO_SHM=0. Against a second
// communicator on Gloo's TCP: the same sums (bit for bit on 2 ranks, where
// the order cannot differ), the same bits on every rank, across the slots.
TEST_CASE("gloo: shared memory on one host, against Gloo's TCP") {
  auto& w = world();
  auto& comm = *w.comm;
  const auto env = dtrain::environment::from_process();
  const auto setting = env.get("DTRAIN_GLOO_SHM");
  if (comm.size() == 1) {
    CHECK(comm.describe().find("shared memory off (a world of one)") != std::string::npos);
    return;
  }
  const bool off = setting && (*setting == "0" || *setting == "false");
  CHECK_MESSAGE(comm.describe().find(off ? "shared memory off (DTRAIN_GLOO_SHM=0"
                                         : "shared memory on (") != std::string::npos,
                comm.describe());
  auto options = options_with(w.collectives);
  options.shared_memory = false;
  dtrain::gloo_communicator tcp(*w.store, w.rank, w.size, options);
  CHECK_MESSAGE(
      tcp.describe().find("shared memory off (DTRAIN_GLOO_SHM=0 or "
                          "gloo_options::shared_memory = false on rank 0)") != std::string::npos,
      tcp.describe());

  // Floats that round: 2.5 slots of them, different on every rank.
  const std::size_t n = dtrain::detail::shm_slot_bytes(w.size) / sizeof(float) * 5 / 2 + 3;
  std::vector<float> mine(n);
  for (std::size_t i = 0; i < n; ++i)
    mine[i] = 1.0f / static_cast<float>(i + 1) + 0.37f * static_cast<float>(w.rank + 1);
  std::vector<float> through_shm(n), through_tcp(n);
  dtrain::allreduce(comm, std::span<const float>(mine), std::span(through_shm)).wait();
  dtrain::allreduce(tcp, std::span<const float>(mine), std::span(through_tcp)).wait();
  std::size_t differ = 0, far = 0;
  for (std::size_t i = 0; i < n; ++i) {
    differ += through_shm[i] != through_tcp[i];
    far += std::abs(through_shm[i] - through_tcp[i]) > 1e-6f * std::abs(through_tcp[i]);
  }
  CHECK(far == 0);
  if (w.size == 2) CHECK(differ == 0);
  // Every rank holds the same bits (a sum of the bits is enough to differ).
  std::int64_t bits = 0;
  for (float v : through_shm) {
    std::uint32_t u = 0;
    std::memcpy(&u, &v, sizeof u);
    bits += u;
  }
  std::vector<std::int64_t> everyone(static_cast<std::size_t>(w.size));
  dtrain::allgather(tcp, std::span<const std::int64_t>(&bits, 1), std::span(everyone)).wait();
  CHECK(std::all_of(everyone.begin(), everyone.end(), [&](std::int64_t b) { return b == bits; }));

  // Wider and narrower types cross the slots at other element counts.
  const auto slots_of = [&]<class T>(T value) {
    const std::size_t count = dtrain::detail::shm_slot_bytes(w.size) / sizeof(T) * 2 + 1;
    std::vector<T> data(count, value);
    dtrain::allreduce(comm, std::span(data)).wait();
    return dtrain_test::value_of(data.front()) + dtrain_test::value_of(data.back());
  };
  CHECK(slots_of(2.0) == 4.0 * w.size);
  CHECK(slots_of(std::int64_t{3}) == 6.0 * w.size);
  CHECK(slots_of(dtrain::bfloat16(1.0f)) == 2.0 * w.size);
}

TEST_CASE("gloo: DTRAIN_GLOO_SHM must be a switch, read before anything connects") {
  auto& w = world();
  auto options = options_with(w.collectives);
  options.env = dtrain::environment{{"DTRAIN_GLOO_SHM", "sometimes"}};
  CHECK_THROWS_WITH_AS(dtrain::gloo_communicator(*w.store, w.rank, w.size, options),
                       doctest::Contains("DTRAIN_GLOO_SHM=sometimes is not 0, 1"),
                       dtrain::config_error);
  // Required, and on one host: it is used.
  options.env = dtrain::environment{{"DTRAIN_GLOO_SHM", "1"}};
  dtrain::gloo_communicator required(*w.store, w.rank, w.size, options);
  CHECK(required.describe().find(w.size == 1 ? "shared memory off (a world of one)"
                                             : "shared memory on (") != std::string::npos);
  std::vector<double> one(3, 1.0);
  dtrain::allreduce(required, std::span(one)).wait();
  CHECK(one[2] == w.size);
}

// The execution path runs on the worker, or on a thread that waits; nothing
// there may end the process. A collective whose run throws, with no memory
// left to put the failure into words, still fails its work: wait() throws it,
// and the communicator says it is unusable, and why.
TEST_CASE("gloo: a failed collective reaches wait(), even when no memory is left to describe it") {
  using namespace dtrain::detail;
  auto state = std::make_shared<gloo_state>();  // a world of one, as the worker sees it
  state->timeout = std::chrono::seconds(10);
  const collective_info what{
      "allreduce", "gloo", 0, 1, 4, static_cast<std::uint8_t>(dtrain::dtype::float32), 0, -1};
  gloo_state::task t;
  t.work = std::make_shared<gloo_work>(what, state->timeout, state);
  t.call = collective_call::barrier();
  t.run = [](gloo_state&, const collective_call&, std::chrono::milliseconds) {
    throw std::bad_alloc();  // as Gloo would, out of memory
  };
  allocations_fail = true;  // describing the failure allocates: that fails too
  gloo_execute(*state, t, state->timeout);
  allocations_fail = false;
  dtrain::work handle(t.work);
  CHECK(handle.test());
  CHECK_THROWS_AS(handle.wait(), std::bad_alloc);
  CHECK(state->unusable.load());
  CHECK(state->unusable_text().find("unusable since an earlier failure (std::bad_alloc)") !=
        std::string::npos);
}

TEST_CASE("gloo: a timeout marks the communicator unusable without allocating") {
  using namespace dtrain::detail;
  auto state = std::make_shared<gloo_state>();
  const collective_info what{
      "allreduce", "gloo", 0, 2, 4, static_cast<std::uint8_t>(dtrain::dtype::float32), 0, -1};
  auto w = std::make_shared<gloo_work>(what, std::chrono::seconds(10), state);
  allocations_fail = true;
  w->on_timeout();  // noexcept: an allocation here would end the process
  allocations_fail = false;
  CHECK(state->unusable.load());
  CHECK(state->unusable_text().find("(allreduce(sum, 4 x float32) on rank 0 of 2 (gloo) did not "
                                    "finish within its timeout)") != std::string::npos);
}

TEST_CASE("gloo: where Gloo's code comes from is read from /proc/self/maps") {
  // The check against LibTorch's bundled Gloo names the file that maps a
  // function; here Gloo is the system's libgloo, so the check passes.
  using create_device =
      std::shared_ptr<::gloo::transport::Device> (*)(const ::gloo::transport::tcp::attr&);
  const create_device create = &::gloo::transport::tcp::CreateDevice;
  const void* code = nullptr;
  std::memcpy(&code, &create, sizeof code);
  const std::string gloo_file = dtrain::detail::mapped_file_of(code);
  CHECK(gloo_file.find("libgloo") != std::string::npos);
  auto* const open_file = &::fopen;  // libc's
  const void* libc_code = nullptr;
  std::memcpy(&libc_code, &open_file, sizeof libc_code);
  CHECK(dtrain::detail::mapped_file_of(libc_code).find("libc") != std::string::npos);
  CHECK(dtrain::detail::mapped_file_of(nullptr).empty());
  CHECK_NOTHROW(dtrain::detail::check_gloo_library(world().rank));
}

TEST_CASE("gloo: an interface that does not exist is a config_error naming it") {
  auto& w = world();
  auto options = options_with(w.collectives);
  options.interface = "dtrain-nope0";
  CHECK_THROWS_WITH_AS(
      dtrain::gloo_communicator(*w.store, w.rank, w.size, options),
      doctest::Contains("gloo_options::interface=dtrain-nope0 names no network interface"),
      dtrain::config_error);
  CHECK_THROWS_WITH_AS(dtrain::detail::choose_gloo_endpoint(
                           "", "", dtrain::environment{{"DTRAIN_GLOO_IFNAME", "nope1"}}, 2),
                       doctest::Contains("DTRAIN_GLOO_IFNAME=nope1 names no network interface"),
                       dtrain::config_error);
  CHECK_THROWS_WITH_AS(dtrain::detail::choose_gloo_endpoint(
                           "", "", dtrain::environment{{"GLOO_SOCKET_IFNAME", "nope2,lo"}}, 2),
                       doctest::Contains("GLOO_SOCKET_IFNAME=nope2,lo names no network interface"),
                       dtrain::config_error);
  CHECK_THROWS_AS(dtrain::gloo_communicator(*w.store, w.rank, w.rank, options),
                  dtrain::config_error);
}

TEST_CASE(
    "gloo: the interface comes from the option, the environment, or the route to MASTER_ADDR") {
  using dtrain::detail::choose_gloo_endpoint;
  const dtrain::environment env{
      {"DTRAIN_GLOO_IFNAME", "lo"}, {"GLOO_SOCKET_IFNAME", "nope"}, {"MASTER_ADDR", "10.9.9.9"}};
  CHECK(choose_gloo_endpoint("lo", "", dtrain::environment{{"DTRAIN_GLOO_IFNAME", "nope"}}, 4)
            .iface == "lo");
  CHECK(choose_gloo_endpoint("", "", env, 4).iface == "lo");
  CHECK(choose_gloo_endpoint("", "", dtrain::environment{{"GLOO_SOCKET_IFNAME", "lo,eth7"}}, 4)
            .iface == "lo");
  auto routed = choose_gloo_endpoint(
      "", "", dtrain::environment{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}}, 4);
  CHECK(routed.iface.empty());
  CHECK(routed.hostname == "127.0.0.1");
  CHECK(routed.origin.find("MASTER_ADDR=127.0.0.1") != std::string::npos);
  CHECK(choose_gloo_endpoint("", "127.0.0.1",
                             dtrain::environment{{"MASTER_ADDR", "nowhere.invalid"}}, 4)
            .hostname == "127.0.0.1");
  CHECK_THROWS_WITH_AS(
      choose_gloo_endpoint("", "", dtrain::environment{{"MASTER_ADDR", "nowhere.invalid"}}, 4),
      doctest::Contains("MASTER_ADDR=nowhere.invalid cannot be resolved"), dtrain::config_error);
  CHECK(choose_gloo_endpoint("", "", dtrain::environment{}, 1).hostname == "127.0.0.1");
}

TEST_CASE("gloo: a communicator bound to the interface named lo") {
  auto& w = world();
  auto options = options_with(w.collectives);
  options.interface = "lo";
  dtrain::gloo_communicator on_lo(*w.store, w.rank, w.size, options);
  CHECK(on_lo.describe().find("gloo_options::interface=lo") != std::string::npos);
  std::vector<std::uint8_t> bytes(100, 2);
  dtrain::allreduce(on_lo, std::span(bytes), dtrain::reduce_op::prod).wait();
  CHECK(bytes[99] == static_cast<std::uint8_t>(1u << w.size));
}

// ---------------------------------------------------------------------------

int main(int argc, char** argv) {
  std::string mode;
  std::vector<char*> doctest_args;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--mode=", 0) == 0) {
      mode = arg.substr(7);
    } else {
      doctest_args.push_back(argv[i]);
    }
  }
  job j;
  try {
    const auto env = dtrain::environment::from_process();
    const dtrain::world w = dtrain::discover_world(env);
    j.rank = w.rank.value_or(0);
    j.size = w.world_size.value_or(1);
    j.collectives = dtrain::collective_options{}.with_env(env);
    const std::string host = w.master_addr.value_or("127.0.0.1");
    int port = w.master_port.value_or(0);
    if (j.rank == 0) {
      j.server = std::make_unique<dtrain::store_server>(host, port);
      port = j.server->port();
    }
    j.store = std::make_unique<dtrain::store_client>(host, port);
    j.comm = std::make_unique<dtrain::gloo_communicator>(*j.store, j.rank, j.size,
                                                         options_with(j.collectives));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain_gloo_tests: setting up: %s\n", e.what());
    return 1;
  }
  the_job = &j;
  if (mode == "dead-peer") return dead_peer(j);
  if (mode == "hung-peer") return hung_peer(j);
  if (!mode.empty()) {
    std::fprintf(stderr, "dtrain_gloo_tests: unknown --mode=%s\n", mode.c_str());
    return 2;
  }

  doctest::Context context(static_cast<int>(doctest_args.size()), doctest_args.data());
  const int status = context.run();
  // The store lives in rank 0: keep it up until every rank is done with it.
  try {
    j.comm->barrier().wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain_gloo_tests: rank %d: the closing barrier failed: %s\n", j.rank,
                 e.what());
    return status != 0 ? status : 1;
  }
  return status;
}
