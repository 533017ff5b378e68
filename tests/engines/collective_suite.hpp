#pragma once
// The collective suite every engine runs: each collective × element type × op
// against a serial computation, in and out of place, odd and zero sizes, and a
// buffer larger than any internal chunk. Every rank computes every rank's
// input (a function of rank and index), so each can check the result alone.

#include <doctest/doctest.h>
#include <dtrain/dtrain.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dtrain_test {

/// The input of `rank` at index i for `op`: small integers, so that sums,
/// products, minima and maxima are exact in every type including uint8,
/// float16 and bfloat16 with up to 4 ranks.
inline double input_value(dtrain::reduce_op op, int rank, std::size_t i) {
  switch (op) {
    case dtrain::reduce_op::prod:
      return 1.0 + static_cast<double>((static_cast<std::size_t>(rank) + i) % 2);
    case dtrain::reduce_op::min:
    case dtrain::reduce_op::max:
      return static_cast<double>((static_cast<std::size_t>(rank) * 3 + i) % 7);
    default: return static_cast<double>(rank + 1) + static_cast<double>(i % 5);
  }
}

inline double reduce_serial(dtrain::reduce_op op, int size, std::size_t i) {
  double acc = input_value(op, 0, i);
  for (int r = 1; r < size; ++r) {
    double v = input_value(op, r, i);
    acc = op == dtrain::reduce_op::min    ? std::min(acc, v)
          : op == dtrain::reduce_op::max  ? std::max(acc, v)
          : op == dtrain::reduce_op::prod ? acc * v
                                          : acc + v;
  }
  return op == dtrain::reduce_op::avg ? acc / size : acc;
}

template <dtrain::element T>
T make(double v) {
  if constexpr (std::is_same_v<T, dtrain::float16> || std::is_same_v<T, dtrain::bfloat16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <dtrain::element T>
double value_of(T v) {
  if constexpr (std::is_same_v<T, dtrain::float16> || std::is_same_v<T, dtrain::bfloat16>) {
    return static_cast<double>(static_cast<float>(v));
  } else {
    return static_cast<double>(v);
  }
}

/// "" when every element matches (exactly, or within the type's rounding for
/// avg), else the first mismatch.
template <dtrain::element T, class Expected>
std::string first_mismatch(std::span<const T> got, Expected expected, bool rounded) {
  const double tol = std::is_same_v<T, dtrain::bfloat16>  ? 1e-2
                     : std::is_same_v<T, dtrain::float16> ? 1e-3
                                                          : 1e-6;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double want = value_of(make<T>(expected(i)));
    double have = value_of(got[i]);
    bool ok =
        rounded ? std::fabs(have - want) <= tol * std::max(1.0, std::fabs(want)) : have == want;
    if (!ok) {
      return "element " + std::to_string(i) + " of " + std::to_string(got.size()) + " is " +
             std::to_string(have) + ", expected " + std::to_string(want);
    }
  }
  return {};
}

template <dtrain::communicator C, dtrain::element T>
void allreduce_cases(C& comm, std::size_t n) {
  const int rank = comm.rank(), size = comm.size();
  for (auto op : {dtrain::reduce_op::sum, dtrain::reduce_op::avg, dtrain::reduce_op::min,
                  dtrain::reduce_op::max, dtrain::reduce_op::prod}) {
    if (op == dtrain::reduce_op::avg && !dtrain::is_floating(dtrain::dtype_of<T>)) continue;
    CAPTURE(dtrain::to_string(dtrain::dtype_of<T>));
    CAPTURE(dtrain::to_string(op));
    CAPTURE(n);
    auto expected = [&](std::size_t i) { return reduce_serial(op, size, i); };
    std::vector<T> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = make<T>(input_value(op, rank, i));
    std::vector<T> in = data, out(n);

    dtrain::allreduce(comm, std::span(data), op).wait();  // in place
    CHECK_MESSAGE(first_mismatch<T>(data, expected, op == dtrain::reduce_op::avg) == "",
                  "in place");

    dtrain::allreduce(comm, std::span<const T>(in), std::span(out), op).wait();  // out of place
    CHECK_MESSAGE(first_mismatch<T>(out, expected, op == dtrain::reduce_op::avg) == "",
                  "out of place");
    CHECK_MESSAGE(first_mismatch<T>(
                      in, [&](std::size_t i) { return input_value(op, rank, i); }, false) == "",
                  "the input of an out-of-place allreduce is unchanged");
  }
}

template <dtrain::communicator C, dtrain::element T>
void data_movement_cases(C& comm, std::size_t n) {
  const int rank = comm.rank(), size = comm.size();
  const auto sum = dtrain::reduce_op::sum;
  CAPTURE(dtrain::to_string(dtrain::dtype_of<T>));
  CAPTURE(n);
  for (int root = 0; root < size; ++root) {
    std::vector<T> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = make<T>(input_value(sum, rank, i));
    dtrain::broadcast(comm, std::span(data), root).wait();
    CHECK_MESSAGE(first_mismatch<T>(
                      data, [&](std::size_t i) { return input_value(sum, root, i); }, false) == "",
                  "broadcast from root " << root);
  }
  {
    std::vector<T> in(n), out(n * static_cast<std::size_t>(size));
    for (std::size_t i = 0; i < n; ++i) in[i] = make<T>(input_value(sum, rank, i));
    dtrain::allgather(comm, std::span<const T>(in), std::span(out)).wait();
    CHECK_MESSAGE(first_mismatch<T>(
                      out,
                      [&](std::size_t j) {
                        return input_value(sum, static_cast<int>(j / std::max<std::size_t>(n, 1)),
                                           j % std::max<std::size_t>(n, 1));
                      },
                      false) == "",
                  "allgather");
  }
  {
    // Block j of every rank's input goes to rank j: rank r's block i of the
    // output is rank i's block r, each element where it was in its block.
    const std::size_t all = n * static_cast<std::size_t>(size);
    std::vector<T> in(all), out(all);
    for (std::size_t j = 0; j < all; ++j) in[j] = make<T>(input_value(sum, rank, j));
    dtrain::alltoall(comm, std::span<const T>(in), std::span(out)).wait();
    const std::size_t block = std::max<std::size_t>(n, 1);
    CHECK_MESSAGE(first_mismatch<T>(
                      out,
                      [&](std::size_t j) {
                        return input_value(sum, static_cast<int>(j / block),
                                           static_cast<std::size_t>(rank) * n + j % block);
                      },
                      false) == "",
                  "alltoall");
  }
  for (auto op : {dtrain::reduce_op::sum, dtrain::reduce_op::max}) {
    std::vector<T> in(n * static_cast<std::size_t>(size)), out(n);
    for (std::size_t j = 0; j < in.size(); ++j) in[j] = make<T>(input_value(op, rank, j));
    dtrain::reduce_scatter(comm, std::span<const T>(in), std::span(out), op).wait();
    const std::size_t base = static_cast<std::size_t>(rank) * n;
    CHECK_MESSAGE(
        first_mismatch<T>(
            out, [&](std::size_t i) { return reduce_serial(op, size, base + i); }, false) == "",
        "reduce_scatter " << dtrain::to_string(op));
  }
}

template <dtrain::communicator C, dtrain::element T>
void all_cases(C& comm) {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
    allreduce_cases<C, T>(comm, n);
    data_movement_cases<C, T>(comm, n);
  }
}

/// Runs everything against `comm`; call it from a TEST_CASE on every rank.
template <dtrain::communicator C>
void run_collective_suite(C& comm) {
  all_cases<C, float>(comm);
  all_cases<C, double>(comm);
  all_cases<C, dtrain::float16>(comm);
  all_cases<C, dtrain::bfloat16>(comm);
  all_cases<C, std::int32_t>(comm);
  all_cases<C, std::int64_t>(comm);
  all_cases<C, std::uint8_t>(comm);

  // Odd sizes, and a buffer larger than any engine's internal chunk (16 MiB).
  allreduce_cases<C, float>(comm, 65537);
  data_movement_cases<C, float>(comm, 4099);
  {
    const std::size_t big = std::size_t{1} << 22;
    std::vector<float> data(big);
    for (std::size_t i = 0; i < big; ++i)
      data[i] = static_cast<float>(input_value(dtrain::reduce_op::sum, comm.rank(), i));
    dtrain::allreduce(comm, std::span(data)).wait();
    CHECK(first_mismatch<float>(
              data,
              [&](std::size_t i) { return reduce_serial(dtrain::reduce_op::sum, comm.size(), i); },
              false) == "");
  }

  comm.barrier().wait();

  // Arguments one rank can check alone are config_errors naming the collective and the rank.
  std::vector<std::int32_t> ints(4), small(3);
  CHECK_THROWS_WITH_AS(dtrain::allreduce(comm, std::span(ints), dtrain::reduce_op::avg),
                       doctest::Contains("avg of int32 would truncate"), dtrain::config_error);
  CHECK_THROWS_WITH_AS(
      dtrain::allreduce(comm, std::span<const std::int32_t>(ints), std::span(small)),
      doctest::Contains("output has 3 elements, expected 4"), dtrain::config_error);
  const std::string bad_root = "root " + std::to_string(comm.size()) + " is not a rank";
  CHECK_THROWS_WITH_AS(dtrain::broadcast(comm, std::span(ints), comm.size()),
                       doctest::Contains(bad_root.c_str()), dtrain::config_error);
  // A null pointer with elements is refused before the engine reads it (not a crash).
  const dtrain::buffer null4{nullptr, 4, dtrain::dtype::float32, dtrain::memory::host};
  std::vector<float> four(4, 1.0f);
  const dtrain::buffer floats = dtrain::host_buffer(std::span(four));
  CHECK_THROWS_WITH_AS(comm.allreduce(null4, null4, dtrain::reduce_op::sum),
                       doctest::Contains("input is a null pointer with 4 elements"),
                       dtrain::config_error);
  CHECK_THROWS_WITH_AS(comm.allreduce(floats, null4, dtrain::reduce_op::sum),
                       doctest::Contains("output is a null pointer with 4 elements"),
                       dtrain::config_error);
  CHECK_THROWS_WITH_AS(comm.broadcast(null4, 0),
                       doctest::Contains("data is a null pointer with 4 elements"),
                       dtrain::config_error);
  // alltoall runs out of place, on whole blocks.
  std::vector<float> blocks(static_cast<std::size_t>(comm.size()) * 2, 1.0f);
  const dtrain::buffer whole = dtrain::host_buffer(std::span(blocks));
  CHECK_THROWS_WITH_AS(comm.alltoall(whole, whole), doctest::Contains("input and output overlap"),
                       dtrain::config_error);
  if (comm.size() > 1) {
    std::vector<float> odd(static_cast<std::size_t>(comm.size()) + 1), odd_out(odd.size());
    const std::string uneven = "not a multiple of the " + std::to_string(comm.size()) + " ranks";
    CHECK_THROWS_WITH_AS(dtrain::alltoall(comm, std::span<const float>(odd), std::span(odd_out)),
                         doctest::Contains(uneven.c_str()), dtrain::config_error);
  }
  // Nothing was started by the refused calls: the communicator still works.
  std::vector<std::int32_t> ones(3, 1);
  dtrain::allreduce(comm, std::span(ones)).wait();
  CHECK(ones[2] == comm.size());
}

/// split() with a negative color leaves a rank out, the same on every engine:
/// here rank 0 stays out, the others form a group, and both go on working.
template <dtrain::communicator C>
void run_left_out_split(C& comm) {
  const bool out = comm.rank() == 0;
  C group = comm.split(out ? -1 : 7, comm.rank());
  CHECK(comm.valid());
  if (out) {
    CHECK_FALSE(group.valid());
    CHECK(group.rank() == -1);
    CHECK(group.size() == 0);
    std::vector<float> v(3, 1.0f);
    CHECK_THROWS_WITH_AS(dtrain::allreduce(group, std::span(v)),
                         doctest::Contains("passed a negative color to split() and belongs to no "
                                           "communicator"),
                         dtrain::config_error);
    CHECK_THROWS_WITH_AS(group.barrier(), doctest::Contains("negative color"),
                         dtrain::config_error);
    CHECK_THROWS_WITH_AS((void)group.split(0, 0), doctest::Contains("negative color"),
                         dtrain::config_error);
  } else {
    REQUIRE(group.valid());
    CHECK(group.size() == comm.size() - 1);
    CHECK(group.rank() == comm.rank() - 1);
    std::vector<double> v(5, static_cast<double>(comm.rank()));
    dtrain::allreduce(group, std::span(v)).wait();
    const double expected = comm.size() * (comm.size() - 1) / 2.0;  // ranks 1 .. size-1
    CHECK(v[4] == expected);
  }
  // The parent is untouched: every rank, the left-out one too, still reduces on it.
  std::vector<int> one(2, 1);
  dtrain::allreduce(comm, std::span(one)).wait();
  CHECK(one[1] == comm.size());
}

}  // namespace dtrain_test
