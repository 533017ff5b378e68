// The shared-memory allreduce of backend/gloo/shm.hpp between forked processes:
// results for every type and op across the slots, and a peer that dies, stalls
// or gives up. Rank 0 is the test process; ranks 1.. are children that report
// through their exit status (0 right, 1 a wrong result, 2 an exception).

#include "support.hpp"

#include "../engines/collective_suite.hpp"

#if DTRAIN_HAS_SHM()

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

using dtrain::reduce_op;
using dtrain::detail::shm_failure;
using dtrain::detail::shm_segment;
using namespace std::chrono_literals;

namespace {

std::string fresh_name() { return "/dtrain-unit-" + dtrain::detail::new_store_token(); }

/// Rank 0 here, ranks 1..size-1 forked: each child opens the segment, says so
/// through a pipe, runs `body(segment, rank)` and exits with its result.
/// Rank 0 makes the segment, waits until every child has opened it, unlinks
/// it, then runs `body` itself. Returns rank 0's result; `statuses` gets the
/// children's exit statuses.
struct group {
  int size;
  std::vector<pid_t> children;
  std::vector<int> statuses;

  int run(const std::function<int(shm_segment&, int)>& body) {
    const std::string name = fresh_name();
    int go[2], ready[2];
    REQUIRE(::pipe(go) == 0);
    REQUIRE(::pipe(ready) == 0);
    std::fflush(nullptr);  // or the children write out what this process buffered
    for (int r = 1; r < size; ++r) {
      const pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        ::close(go[1]);
        ::close(ready[0]);
        char c = 0;
        int status = 2;
        if (::read(go[0], &c, 1) == 1) {
          try {
            shm_segment s = shm_segment::open(name, r, size);
            if (::write(ready[1], &c, 1) == 1) status = body(s, r);
          } catch (const std::exception& e) {
            std::fprintf(stderr, "rank %d: %s\n", r, e.what());
          }
        }
        std::fflush(stderr);
        ::_exit(status);
      }
      children.push_back(pid);
    }
    ::close(go[0]);
    ::close(ready[1]);
    shm_segment s = shm_segment::create(name, size);
    const std::string release(static_cast<std::size_t>(size), 'g');
    REQUIRE(::write(go[1], release.data(), release.size() - 1) == size - 1);
    for (int r = 1; r < size; ++r) {
      char c = 0;
      REQUIRE(::read(ready[0], &c, 1) == 1);
    }
    shm_segment::unlink(name);
    ::close(go[1]);
    ::close(ready[0]);
    const int mine = body(s, 0);
    for (pid_t pid : children) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      statuses.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status));
    }
    return mine;
  }
};

// Rank r's element i, and its value as a double: the engines' collective suite's.
template <dtrain::element T>
T value(reduce_op op, int rank, std::size_t i) {
  return dtrain_test::make<T>(dtrain_test::input_value(op, rank, i));
}
using dtrain_test::value_of;

// 0 when every element of every op is right, in place and out of place.
template <dtrain::element T>
int check_type(shm_segment& s, int rank, int size, const std::vector<std::size_t>& counts) {
  for (auto op :
       {reduce_op::sum, reduce_op::avg, reduce_op::min, reduce_op::max, reduce_op::prod}) {
    if (op == reduce_op::avg && !dtrain::is_floating(dtrain::dtype_of<T>)) continue;
    for (std::size_t n : counts) {
      std::vector<T> in(n), out(n);
      for (std::size_t i = 0; i < n; ++i) in[i] = value<T>(op, rank, i);
      std::vector<T> place = in;
      s.allreduce(in.data(), out.data(), n, op, 10s);
      s.allreduce(place.data(), place.data(), n, op, 10s);
      for (std::size_t i = 0; i < n; ++i) {
        const double want = dtrain_test::reduce_serial(op, size, i);
        const double tolerance = op == reduce_op::avg ? 1e-2 * std::max(1.0, want) : 0.0;
        if (std::abs(value_of(out[i]) - want) > tolerance ||
            std::abs(value_of(place[i]) - want) > tolerance ||
            value_of(in[i]) != value_of(value<T>(op, rank, i))) {
          std::fprintf(stderr, "rank %d: %s %s, %zu elements: element %zu is %g / %g, want %g\n",
                       rank, dtrain::to_string(dtrain::dtype_of<T>).data(),
                       dtrain::to_string(op).data(), n, i, value_of(out[i]), value_of(place[i]),
                       want);
          return 1;
        }
      }
    }
  }
  return 0;
}

}  // namespace

TEST_CASE("shm: the slot size stays within its budget") {
  using dtrain::detail::shm_slot_bytes;
  CHECK(shm_slot_bytes(2) == std::size_t{1} << 20);
  CHECK(shm_slot_bytes(8) == std::size_t{1} << 20);
  for (int ranks : {1, 2, 3, 15, 16, 64, 1000, 100000}) {
    CAPTURE(ranks);
    CHECK(shm_slot_bytes(ranks) % 4096 == 0);
    CHECK(shm_slot_bytes(ranks) >= 4096);
    if (ranks < 4000)
      CHECK(shm_slot_bytes(ranks) * static_cast<std::size_t>(ranks + 1) <= std::size_t{16} << 20);
  }
}

TEST_CASE("shm: allreduce of every type and op across the slots, on 2 and 3 processes") {
  for (int size : {2, 3}) {
    CAPTURE(size);
    group g{size, {}, {}};
    const int mine = g.run([size](shm_segment& s, int rank) {
      const std::size_t floats = s.slot_bytes() / sizeof(float);
      const std::vector<std::size_t> few = {1, 2, 3, 5, 1000};
      int bad = check_type<float>(s, rank, size,
                                  {1, 2, 3, 1000, floats - 1, floats, floats + 1, 2 * floats + 7});
      bad |= check_type<double>(s, rank, size, {1, 4, s.slot_bytes() / 8 * 2 + 3});
      bad |= check_type<dtrain::bfloat16>(s, rank, size, {3, s.slot_bytes() / 2 + 1});
      bad |= check_type<dtrain::float16>(s, rank, size, few);
      bad |= check_type<std::int32_t>(s, rank, size, few);
      bad |= check_type<std::int64_t>(s, rank, size, few);
      bad |= check_type<std::uint8_t>(s, rank, size, {7, s.slot_bytes() + 9});
      return bad;
    });
    CHECK(mine == 0);
    CHECK(g.statuses == std::vector<int>(static_cast<std::size_t>(size - 1), 0));
  }
}

TEST_CASE("shm: alltoall across the slots, on 2 and 3 processes") {
  for (int size : {2, 3}) {
    CAPTURE(size);
    group g{size, {}, {}};
    const int mine = g.run([size](shm_segment& s, int rank) {
      const auto ranks = static_cast<std::size_t>(size);
      // Blocks below, at and across a slot's share per rank (slot / ranks).
      const std::size_t share = s.slot_bytes() / ranks;
      for (const std::size_t block :
           {std::size_t{1}, std::size_t{7}, share - 1, share, 2 * share + 13}) {
        // The byte rank `from` sends to rank `to` at offset i of its block.
        auto byte = [](std::size_t from, std::size_t to, std::size_t i) {
          return static_cast<unsigned char>((from * 131 + to * 17 + i * 7 + i / 251) % 256);
        };
        const auto me = static_cast<std::size_t>(rank);
        std::vector<unsigned char> in(ranks * block), out(ranks * block, 0);
        for (std::size_t to = 0; to < ranks; ++to)
          for (std::size_t i = 0; i < block; ++i) in[to * block + i] = byte(me, to, i);
        s.alltoall(in.data(), out.data(), block, 10s);
        for (std::size_t from = 0; from < ranks; ++from) {
          for (std::size_t i = 0; i < block; ++i) {
            if (out[from * block + i] != byte(from, me, i)) {
              std::fprintf(stderr,
                           "rank %d: alltoall of %zu-byte blocks: rank %zu's byte %zu wrong\n",
                           rank, block, from, i);
              return 1;
            }
          }
        }
      }
      return 0;
    });
    CHECK(mine == 0);
    CHECK(g.statuses == std::vector<int>(static_cast<std::size_t>(size - 1), 0));
  }
}

TEST_CASE("shm: allgather across the slots, in place and not, on 2 and 3 processes") {
  for (int size : {2, 3}) {
    CAPTURE(size);
    group g{size, {}, {}};
    const int mine = g.run([size](shm_segment& s, int rank) {
      const auto ranks = static_cast<std::size_t>(size);
      for (const std::size_t bytes : {std::size_t{1}, std::size_t{7}, s.slot_bytes() - 1,
                                      s.slot_bytes(), 2 * s.slot_bytes() + 13}) {
        auto byte = [](std::size_t q, std::size_t i) {
          return static_cast<unsigned char>((q * 131 + i * 7 + i / 251) % 256);
        };
        std::vector<unsigned char> in(bytes), out(ranks * bytes, 0), place(ranks * bytes, 0);
        for (std::size_t i = 0; i < bytes; ++i) {
          in[i] = byte(static_cast<std::size_t>(rank), i);
          place[static_cast<std::size_t>(rank) * bytes + i] = in[i];
        }
        s.allgather(in.data(), out.data(), bytes, 10s);
        s.allgather(place.data() + static_cast<std::size_t>(rank) * bytes, place.data(), bytes,
                    10s);
        for (std::size_t q = 0; q < ranks; ++q) {
          for (std::size_t i = 0; i < bytes; ++i) {
            if (out[q * bytes + i] != byte(q, i) || place[q * bytes + i] != byte(q, i)) {
              std::fprintf(stderr, "rank %d: allgather of %zu bytes: rank %zu's byte %zu wrong\n",
                           rank, bytes, q, i);
              return 1;
            }
          }
        }
      }
      return 0;
    });
    CHECK(mine == 0);
    CHECK(g.statuses == std::vector<int>(static_cast<std::size_t>(size - 1), 0));
  }
}

TEST_CASE(
    "shm: reduce_scatter gives each rank its block of the allreduce, bit for bit, "
    "in place and not, across the slots, on 2, 3 and 4 processes") {
  for (int size : {2, 3, 4}) {
    CAPTURE(size);
    group g{size, {}, {}};
    const int mine = g.run([size](shm_segment& s, int rank) {
      const auto ranks = static_cast<std::size_t>(size);
      const auto me = static_cast<std::size_t>(rank);
      const std::size_t per_slot = s.slot_bytes() / sizeof(float) / ranks;
      for (const reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
        for (const std::size_t block :
             {std::size_t{1}, std::size_t{5}, per_slot - 1, per_slot, 2 * per_slot + 3}) {
          std::vector<float> in(ranks * block);
          for (std::size_t i = 0; i < in.size(); ++i)
            in[i] = 1.0f / static_cast<float>(i + 1) + 0.37f * static_cast<float>(rank);
          std::vector<float> whole = in, out(block, -1.0f), place = in;
          s.allreduce(whole.data(), whole.data(), whole.size(), op, 10s);
          s.reduce_scatter(in.data(), out.data(), block, op, 10s);
          s.reduce_scatter(place.data(), place.data() + me * block, block, op, 10s);
          for (std::size_t i = 0; i < block; ++i) {
            const float want = whole[me * block + i];
            if (out[i] != want || place[me * block + i] != want) {
              std::fprintf(stderr,
                           "rank %d: reduce_scatter (%s) of blocks of %zu: element %zu is %g "
                           "(in place %g), the allreduce gave %g\n",
                           rank, std::string(dtrain::to_string(op)).c_str(), block, i,
                           static_cast<double>(out[i]), static_cast<double>(place[me * block + i]),
                           static_cast<double>(want));
              return 1;
            }
          }
        }
      }
      return 0;
    });
    CHECK(mine == 0);
    CHECK(g.statuses == std::vector<int>(static_cast<std::size_t>(size - 1), 0));
  }
}

TEST_CASE("shm: every rank ends with the same bits, reduced in rank order") {
  group g{3, {}, {}};
  const int mine = g.run([](shm_segment& s, int rank) {
    std::vector<float> data(5000);
    for (std::size_t i = 0; i < data.size(); ++i)
      data[i] = 1.0f / static_cast<float>(i + 1) + 0.1f * static_cast<float>(rank);
    s.allreduce(data.data(), data.data(), data.size(), reduce_op::sum, 10s);
    for (std::size_t i = 0; i < data.size(); ++i) {
      const float x = 1.0f / static_cast<float>(i + 1);
      const float want = ((x + 0.0f) + (x + 0.1f)) + (x + 0.2f);  // rank 0, then 1, then 2
      if (data[i] != want) return 1;
    }
    return 0;
  });
  CHECK(mine == 0);
  CHECK(g.statuses == std::vector<int>{0, 0});
}

TEST_CASE(
    "shm: ranks that call another collective, count, type or op all stop, with one message "
    "naming both") {
  struct mismatch {
    const char* what;
    std::function<void(shm_segment&, int)> call;
    std::string expected;
  };
  const std::vector<mismatch> cases{
      {"counts",
       [](shm_segment& s, int rank) {
         std::vector<float> v(1000 + 10 * static_cast<std::size_t>(rank), 1.0f);
         s.allreduce(v.data(), v.data(), v.size(), reduce_op::sum, 10s);
       },
       "rank 0 called allreduce(1000 x float32, sum) and rank 1 allreduce(1010 x float32, sum)"},
      {"ops",
       [](shm_segment& s, int rank) {
         std::vector<float> v(64, 1.0f);
         s.allreduce(v.data(), v.data(), v.size(), rank == 2 ? reduce_op::max : reduce_op::sum,
                     10s);
       },
       "rank 0 called allreduce(64 x float32, sum) and rank 2 allreduce(64 x float32, max)"},
      {"collectives",
       [](shm_segment& s, int rank) {
         std::vector<std::int32_t> v(3 * 8, 1);
         if (rank == 1) {
           s.allgather(v.data(), v.data(), 8 * sizeof(std::int32_t), 10s);
         } else {
           s.reduce_scatter(v.data(), v.data(), 8, reduce_op::sum, 10s);
         }
       },
       "rank 0 called reduce_scatter(8 x int32, sum) and rank 1 allgather(32 bytes)"}};
  for (const mismatch& m : cases) {
    CAPTURE(m.what);
    group g{3, {}, {}};
    std::string message;
    g.run([&](shm_segment& s, int rank) {
      // A collective that agrees first: the check passes it.
      std::vector<double> ok(5, 1.0);
      s.allreduce(ok.data(), ok.data(), ok.size(), reduce_op::sum, 10s);
      if (ok[4] != 3.0) return 2;
      try {
        m.call(s, rank);
      } catch (const shm_failure& e) {
        if (std::string(e.what()).find(m.expected) == std::string::npos) {
          std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
          return 3;
        }
        if (rank == 0) message = e.what();
        return 0;
      }
      return 1;  // it went through
    });
    CHECK(g.statuses == std::vector<int>{0, 0});
    CHECK_MESSAGE(message.find(m.expected) != std::string::npos, message);
  }
}

TEST_CASE("shm: a peer that exits is reported at once, by rank, not at the timeout") {
  group g{3, {}, {}};
  std::string message;
  bool timed_out = true;
  double took = 0;
  g.run([&](shm_segment& s, int rank) {
    std::vector<float> data(1000, 1.0f);
    if (rank == 2) return 0;  // leaves without joining
    const auto start = std::chrono::steady_clock::now();
    try {
      s.allreduce(data.data(), data.data(), data.size(), reduce_op::sum, 30s);
    } catch (const shm_failure& e) {
      if (rank != 0) return 0;  // rank 1 hears it from rank 0, or sees rank 2 itself
      message = e.what();
      timed_out = e.timed_out();
      took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return 0;
    }
    return 1;
  });
  CHECK(g.statuses == std::vector<int>{0, 0});
  CHECK_MESSAGE(message.find("rank 2 exited or closed its communicator") != std::string::npos,
                message);
  CHECK(message.find("rank 0 of 3") != std::string::npos);
  CHECK_FALSE(timed_out);
  CHECK(took < 10.0);
}

TEST_CASE(
    "shm: a peer that never comes times out, naming it, and one that gives up stops the rest") {
  group g{2, {}, {}};
  std::string stalled, abandoned;
  bool timed_out = false;
  bool abandoned_timed_out = true;
  g.run([&](shm_segment& s, int rank) {
    std::vector<double> data(10, 1.0);
    if (rank == 1) {  // alive, but late for the first, then gives up
      ::usleep(600'000);
      s.abandon();
      return 0;
    }
    try {
      s.allreduce(data.data(), data.data(), data.size(), reduce_op::sum, 200ms);
    } catch (const shm_failure& e) {
      stalled = e.what();
      timed_out = e.timed_out();
    }
    return 0;
  });
  CHECK(g.statuses == std::vector<int>{0});
  CHECK_MESSAGE(
      stalled.find("rank 1 did not come within the timeout (200 ms)") != std::string::npos,
      stalled);
  CHECK(timed_out);

  group h{2, {}, {}};
  h.run([&](shm_segment& s, int rank) {
    std::vector<double> data(10, 1.0);
    if (rank == 1) {
      s.abandon();
      ::usleep(300'000);  // still alive: only the flag can stop rank 0
      return 0;
    }
    try {
      s.allreduce(data.data(), data.data(), data.size(), reduce_op::sum, 20s);
    } catch (const shm_failure& e) {
      abandoned = e.what();
      abandoned_timed_out = e.timed_out();
    }
    return 0;
  });
  CHECK_MESSAGE(abandoned.find("rank 1 gave up on this allreduce") != std::string::npos, abandoned);
  CHECK_FALSE(abandoned_timed_out);

  // A peer that gave up at its timeout makes this rank's failure a timeout too.
  group t{2, {}, {}};
  t.run([&](shm_segment& s, int rank) {
    std::vector<double> data(10, 1.0);
    if (rank == 1) {
      s.abandon("rank 2 did not come within the timeout", true);
      ::usleep(300'000);
      return 0;
    }
    try {
      s.allreduce(data.data(), data.data(), data.size(), reduce_op::sum, 20s);
    } catch (const shm_failure& e) {
      abandoned = e.what();
      abandoned_timed_out = e.timed_out();
    }
    return 0;
  });
  CHECK_MESSAGE(
      abandoned.find("rank 1 gave up on this allreduce: rank 2 did not come") != std::string::npos,
      abandoned);
  CHECK(abandoned_timed_out);
}

TEST_CASE("shm: a group of one copies") {
  const std::string name = fresh_name();
  shm_segment alone = shm_segment::create(name, 1);
  shm_segment::unlink(name);
  const std::vector<float> in{1.0f, 2.0f, 3.0f};
  std::vector<float> out(3, 0.0f);
  alone.allreduce(in.data(), out.data(), in.size(), reduce_op::avg, 1s);
  CHECK(out == in);
}

TEST_CASE("shm: a name that exists, or a segment of another size, is refused") {
  const std::string name = fresh_name();
  shm_segment made = shm_segment::create(name, 3);
  CHECK(made.bytes() > 4 * made.slot_bytes());
  CHECK_THROWS_WITH_AS(shm_segment::create(name, 3), doctest::Contains("O_EXCL"), shm_failure);
  CHECK_THROWS_WITH_AS(shm_segment::open(name, 1, 2), doctest::Contains("not the"), shm_failure);
  shm_segment::unlink(name);
  CHECK_THROWS_WITH_AS(shm_segment::open(name, 1, 3), doctest::Contains("No such file"),
                       shm_failure);
}

#endif  // DTRAIN_HAS_SHM()
