#pragma once
// `solo`: a communicator of world size 1 that only records what it is given
// (a collective copies `in` to `out` and is complete), its policy, and a
// two-layer model whose gradients are bucket views. DDP's unit tests run on it.

#include <doctest/doctest.h>
#include <dtrain/dtrain.hpp>

#include <cstddef>
#include <cstring>
#include <string_view>
#include <vector>

namespace dtrain_test {

/// What the last collective was given.
struct solo_log {
  int calls = 0;
  std::size_t count = 0;
  dtrain::dtype type = dtrain::dtype::float32;
  dtrain::memory where = dtrain::memory::device;
};

/// World size 1, host memory: a collective copies `in` to `out` and is complete.
class solo {
 public:
  static constexpr bool reaches_device_memory = false;
  static constexpr bool reaches_host_memory = true;
  static constexpr std::string_view name = "solo";

  static solo_log& log() {
    static solo_log l;
    return l;
  }
  [[nodiscard]] int rank() const { return 0; }
  [[nodiscard]] int size() const { return 1; }
  [[nodiscard]] bool valid() const { return true; }
  dtrain::work allreduce(dtrain::buffer in, dtrain::buffer out, dtrain::reduce_op) {
    return copy(in, out);
  }
  dtrain::work broadcast(dtrain::buffer data, int) { return copy(data, data); }
  dtrain::work allgather(dtrain::buffer in, dtrain::buffer out) { return copy(in, out); }
  dtrain::work reduce_scatter(dtrain::buffer in, dtrain::buffer out, dtrain::reduce_op) {
    return copy(in, out);
  }
  dtrain::work alltoall(dtrain::buffer in, dtrain::buffer out) { return copy(in, out); }
  dtrain::work barrier() { return {}; }
  solo split(int, int) { return {}; }

 private:
  static dtrain::work copy(const dtrain::buffer& in, const dtrain::buffer& out) {
    log() = {log().calls + 1, in.count, in.type, in.where};
    if (in.data != out.data && in.count > 0) std::memmove(out.data, in.data, in.bytes());
    return {};
  }
};
static_assert(dtrain::communicator<solo>);

struct solo_backend {
  static constexpr bool available = true;
  static constexpr std::string_view name = "solo";
};

}  // namespace dtrain_test

template <>
struct dtrain::backend_traits<dtrain_test::solo_backend> {
  using communicator = dtrain_test::solo;
  using memory_space = dtrain::host_memory;
  static constexpr bool uses_gpus = false;
  static constexpr bool needs_store = false;
};

namespace dtrain_test {

using solo_policy = dtrain::policy<dtrain::launch::per_process, solo_backend>;

/// Two layers, gradients kept as pointers (bucket views).
struct two_layers {
  std::vector<float> w1 = {1, 2, 3, 4}, b1 = {5, 6}, w2 = {7, 8}, b2 = {9};
  float *g_w1 = nullptr, *g_b1 = nullptr, *g_w2 = nullptr, *g_b2 = nullptr;
  std::vector<dtrain::parameter> parameters() {
    return {dtrain::param("w1", w1, g_w1), dtrain::param("b1", b1, g_b1),
            dtrain::param("w2", w2, g_w2), dtrain::param("b2", b2, g_b2)};
  }
  /// A backward pass: gradient = 10 * value.
  void backward() {
    for (std::size_t i = 0; i < w1.size(); ++i) g_w1[i] = 10 * w1[i];
    for (std::size_t i = 0; i < b1.size(); ++i) g_b1[i] = 10 * b1[i];
    for (std::size_t i = 0; i < w2.size(); ++i) g_w2[i] = 10 * w2[i];
    for (std::size_t i = 0; i < b2.size(); ++i) g_b2[i] = 10 * b2[i];
  }
};

}  // namespace dtrain_test
