// ddp_options::accumulate = accumulation::float32 (issue 49) through
// DistributedDataParallel, on any engine whose gradient memory the host can
// read after a settle (host engines, the device-rules backend, the NCCL
// fake): every rank's 16-bit gradients (a bfloat16 and a float16 model, and
// a float32 one sent compressed to bfloat16) are averaged, and every element
// of the mean must be, bit for bit, the float32 sum of the 16-bit inputs in
// the topology's order (flat: rank order; hierarchical: local order on each
// node, then node order), divided by the world size and rounded once (the
// float32 model's stage-2 shard keeps the float32 mean unrounded). The same
// reference on every rank: the same bits everywhere. The same job with
// accumulation::wire must differ from it somewhere at 3 ranks or more (the
// engine rounds its partial sums), so that the check can fail.
#pragma once

#include <dtrain/dtrain.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace dtrain_test {

/// Rank r's gradient of element i of parameter p at `step`: magnitudes over
/// 2^-6 .. 2^6 and both signs, with bits below a 16-bit mantissa, so that
/// sums round and their order matters.
inline float accumulate_gradient(int rank, std::size_t p, std::size_t i, int step) {
  std::uint64_t x = (static_cast<std::uint64_t>(rank) + 1) * 0x9E3779B97F4A7C15ull ^
                    ((i + 1) * 0xBF58476D1CE4E5B9ull) ^ ((p + 7) * 0x94D049BB133111EBull) ^
                    (static_cast<std::uint64_t>(step) << 40);
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  const float mantissa = 1.0f + static_cast<float>(x % 1000003) / 1000003.0f;
  const int exponent = static_cast<int>((x >> 24) % 13) - 6;
  return ((x >> 40) & 1 ? -1.0f : 1.0f) * std::ldexp(mantissa, exponent);
}

template <class T>
float as_float(T v) {
  return static_cast<float>(v);
}

/// The 16-bit value a gradient travels as: the type's rounding.
inline float through(dtrain::dtype wire, float x) {
  if (wire == dtrain::dtype::bfloat16) return static_cast<float>(dtrain::bfloat16(x));
  if (wire == dtrain::dtype::float16) return static_cast<float>(dtrain::float16(x));
  return x;
}

/// What the case needs of the engine's memory: host bytes the parameters
/// live in are the same everywhere here; `device` declares them as GPU
/// memory of `device_id` (device-rules, NCCL fake); `settle` waits for the
/// device before the host reads DDP's memory.
struct accumulate_memory {
  bool device = false;
  int device_id = -1;
  std::function<void()> settle = [] {};
};

/// One model of parameters of type T (sizes below), gradients written by the host.
template <class T>
struct accumulate_model {
  static constexpr std::size_t sizes[] = {1000, 3, 4099, 257};
  std::vector<std::vector<T>> w, g;
  std::vector<T*> values, grads;
  accumulate_memory memory;
  explicit accumulate_model(accumulate_memory m) : memory(std::move(m)) {
    for (const std::size_t n : sizes) {
      w.emplace_back(n, T(0.5f));
      g.emplace_back(n, T(0.0f));
    }
    for (std::size_t p = 0; p < w.size(); ++p) {
      values.push_back(w[p].data());
      grads.push_back(g[p].data());
    }
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t p = 0; p < w.size(); ++p) {
      std::string name = "a";
      name += std::to_string(p);
      if (memory.device) {
        out.push_back(dtrain::device_param(name, values[p], grads[p], sizes[p], memory.device_id));
      } else {
        out.push_back(dtrain::param(name, values[p], sizes[p], grads[p]));
      }
    }
    return out;
  }
};

/// The order of the float32 sums: flat (rank order), or `nodes` nodes of
/// consecutive ranks (hierarchical: local order on each node, then node order).
struct accumulate_order {
  int size = 1;
  int nodes = 1;  ///< 1: flat (rank order)
  [[nodiscard]] int ranks_per_node() const { return size / nodes; }
};

/// The reference mean of element i of parameter p at `step`, before its last rounding.
inline float accumulate_reference(const accumulate_order& order, dtrain::dtype wire, std::size_t p,
                                  std::size_t i, int step) {
  const int per_node = order.ranks_per_node();
  float total = 0;
  for (int n = 0; n < order.nodes; ++n) {
    float partial = 0;
    for (int l = 0; l < per_node; ++l) {
      const float x = through(wire, accumulate_gradient(n * per_node + l, p, i, step));
      partial = l == 0 ? x : partial + x;
    }
    total = n == 0 ? partial : total + partial;
  }
  return total / static_cast<float>(order.size);
}

/// Runs 2 steps of a model of T at `stage`; returns "" when every element
/// of every step's mean is the reference (bit for bit), else the first
/// difference. `wire`: T's 16-bit type, or compression's for a float32
/// model. `accumulate`: float32, or wire for the negative control, which
/// counts the elements that differ into `*differing`.
template <class T, class Context>
std::string accumulate_run(Context& ctx, dtrain::sharding stage,
                           dtrain::gradient_compression compression,
                           dtrain::accumulation accumulate, const accumulate_memory& memory,
                           const accumulate_order& order, std::size_t* differing) {
  using Policy = typename Context::policy_type;
  const dtrain::dtype type = dtrain::dtype_of<T>;
  const dtrain::dtype wire =
      compression == dtrain::gradient_compression::bfloat16  ? dtrain::dtype::bfloat16
      : compression == dtrain::gradient_compression::float16 ? dtrain::dtype::float16
                                                             : type;
  accumulate_model<T> model(memory);
  dtrain::DistributedDataParallel<accumulate_model<T>, Policy> ddp(ctx, model,
                                                                   {.bucket_cap_mb = 0.004,
                                                                    .first_bucket_cap_mb = 0.001,
                                                                    .broadcast_parameters = false,
                                                                    .compression = compression,
                                                                    .accumulate = accumulate,
                                                                    .sharding = stage});
  const bool whole = stage == dtrain::sharding::none || stage == dtrain::sharding::optimizer;
  std::string first;
  for (int step = 0; step < 2; ++step) {
    memory.settle();  // the device is done with the gradients (zeroed after the last step)
    {
      auto held = ddp.gather(ddp.parameters());
      for (std::size_t p = 0; p < model.g.size(); ++p) {
        for (std::size_t i = 0; i < model.g[p].size(); ++i)
          model.grads[p][i] = T(accumulate_gradient(ctx.rank(), p, i, step));
      }
      for (std::size_t p = model.g.size(); p-- > 0;) ddp.mark_ready(p);
    }
    ddp.synchronize();
    memory.settle();
    // The float32 model's part of the mean stays float32 at stages 2 and 3;
    // what travels back by allgather (stages 0 and 1) is rounded to the wire.
    const bool rounded_to_wire = whole || type != dtrain::dtype::float32;
    auto compare = [&](std::size_t p, std::size_t i, float got) {
      float want = accumulate_reference(order, wire, p, i, step);
      want = rounded_to_wire ? through(wire, want) : want;
      if (std::memcmp(&got, &want, sizeof got) == 0) return;
      if (differing) ++*differing;
      if (first.empty()) {
        char line[256];
        std::snprintf(line, sizeof line,
                      "step %d, parameter %zu, element %zu: %.9g (0x%08x), the float32 sum "
                      "rounded once is %.9g (0x%08x)",
                      step, p, i, static_cast<double>(got), std::bit_cast<std::uint32_t>(got),
                      static_cast<double>(want), std::bit_cast<std::uint32_t>(want));
        first = line;
      }
    };
    if (whole) {
      for (std::size_t p = 0; p < model.g.size(); ++p) {
        for (std::size_t i = 0; i < model.g[p].size(); ++i)
          compare(p, i, as_float(model.grads[p][i]));
      }
    } else {
      for (const dtrain::shard_piece& piece : ddp.shard()) {
        const T* mean = static_cast<const T*>(piece.gradients.data);
        for (std::size_t k = 0; k < piece.gradients.count; ++k)
          compare(piece.parameter, piece.offset + k, as_float(mean[k]));
      }
    }
    ddp.optimizer_step([](const dtrain::shard_piece&) {});
  }
  return first;
}

/// Every model and stage; prints one line per model and returns the number
/// of failures (each printed).
template <class Context>
int accumulate_case(Context& ctx, const accumulate_memory& memory, bool hierarchical,
                    std::vector<dtrain::sharding> stages) {
  const int r = ctx.rank(), n = ctx.size();
  accumulate_order order{.size = n, .nodes = 1};
  if (hierarchical && n > 1) {
    order.nodes = ctx.num_nodes();
    if (ctx.node_rank() * (n / order.nodes) + ctx.local_rank() != r) {
      std::printf("rank %d: FAIL: node %d, local rank %d: ranks are not numbered node by node\n", r,
                  ctx.node_rank(), ctx.local_rank());
      return 1;
    }
  }
  int failures = 0;
  auto report = [&](const char* model, dtrain::sharding stage, const std::string& problem) {
    if (problem.empty()) return;
    ++failures;
    std::printf("rank %d: FAIL: %s at %s: %s\n", r, model,
                std::string(dtrain::to_string(stage)).c_str(), problem.c_str());
  };
  using acc = dtrain::accumulation;
  for (const dtrain::sharding stage : stages) {
    report("bfloat16", stage,
           accumulate_run<dtrain::bfloat16>(ctx, stage, dtrain::gradient_compression::none,
                                            acc::float32, memory, order, nullptr));
    report("float16", stage,
           accumulate_run<dtrain::float16>(ctx, stage, dtrain::gradient_compression::none,
                                           acc::float32, memory, order, nullptr));
    report("float32 compressed to bfloat16", stage,
           accumulate_run<float>(ctx, stage, dtrain::gradient_compression::bfloat16, acc::float32,
                                 memory, order, nullptr));
  }
  // The control: the engine's 16-bit sums round their partial sums.
  std::size_t differ = 0;
  (void)accumulate_run<dtrain::bfloat16>(ctx, dtrain::sharding::none,
                                         dtrain::gradient_compression::none, acc::wire, memory,
                                         order, &differ);
  const std::size_t elements = 2 * (1000 + 3 + 4099 + 257);
  if (n >= 3 && differ == 0) {
    ++failures;
    std::printf(
        "rank %d: FAIL: accumulation::wire gave the float32 reference everywhere: the "
        "check cannot tell them apart\n",
        r);
  }
  if (failures == 0) {
    std::printf(
        "rank %d of %d: float32 accumulation, %s: every mean is the float32 sum rounded "
        "once, bit for bit (bfloat16, float16, float32 compressed; %zu stages); "
        "accumulation::wire differs in %zu of %zu elements\n",
        r, n, hierarchical && order.nodes > 1 ? "hierarchical" : "flat", stages.size(), differ,
        elements);
  }
  std::fflush(stdout);
  return failures;
}

}  // namespace dtrain_test
