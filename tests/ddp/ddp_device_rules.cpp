// dtrain_ddp_device_rules: DistributedDataParallel on the device-rules
// backend (tests/ddp/device_rules.hpp: NCCL's rules on host memory), one
// doctest case per job in every rank (tests/support/multirank.hpp), under
// dtrain_test_launch. It is the GPU path without a GPU: construction,
// agreement, rebuild and the buckets through a communicator that rejects host
// memory, and the watchdog on a hung peer.
//
//   dtrain_test_launch N dtrain_ddp_device_rules [--topology=hierarchical] --test-case=<case>
//
//   mean         exact means over several steps, views and copies, a rebuild,
//                bf16 compression, a hook; with --topology=hierarchical (run the
//                ranks as nodes: dtrain_test_launch --nodes 2,2) its steps
//                enqueued at once on the streams of the node-local and
//                cross-node communicators, as on NCCL
//   shard        sharding none, optimizer and gradients: the reduce-scatter and
//                the allgather on streams (hierarchical: stage 2's two levels)
//   mismatch     the last rank renames a parameter: every rank fails with the
//                agreement's message (the job's status and output are checked)
//   hung-peer    rank 1 never steps: rank 0's synchronize() (or its next call)
//                throws timeout_error within the timeout plus one second
//   stage3       sharding::parameters (ZeRO stage 3): the values' allgathers on
//                streams, prefetched 0, 1 and 2 layers ahead, each value read in
//                a gather() exact (the compute ordered after the allgather)
//   timeline     DTRAIN_TIMELINE's device track on a compute stream: each bucket's
//                span holds its collective (DEVICE_RULES_COLLECTIVE_MS), to its
//                completion
//   stream-init  each rank writes its parameters on a compute stream of its
//                own, late, then builds DDP with ddp_options::stream: every rank
//                starts from what rank 0 wrote there (the first broadcast is
//                ordered after that stream)
#include <unistd.h>

#include "../support/multirank.hpp"
#include "accumulate_case.hpp"
#include "device_rules.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using policy = dtrain::policy<dtrain::launch::per_process, device_rules::backend>;
using hierarchical_policy = dtrain::policy<dtrain::launch::per_process, device_rules::backend,
                                           dtrain::topology::hierarchical>;

}  // namespace

// A compiled library's explicit instantiation for a backend on streams that
// reaches no host memory (NCCL's rules): every member defined, no
// static_assert of the host-only constructor tripped.
template class dtrain::basic_ddp<policy>;
template class dtrain::basic_ddp<hierarchical_policy>;

namespace {

struct model {
  // Host memory that DDP sees as GPU memory of device 0.
  std::vector<std::vector<float>> values;
  std::vector<float*> grads;                 // view parameters: DDP repoints these
  std::vector<std::vector<float>> kept;      // copy parameters: the model keeps these
  std::vector<float> step_counter = {0.0f};  // a buffer: broadcast from rank 0
  std::string renamed;

  explicit model(int rank) {
    for (std::size_t p = 0; p < 9; ++p) {
      const std::size_t count = 1 + (p * 131) % 700 + (p == 4 ? 5000 : 0);
      values.emplace_back(count, static_cast<float>(rank * 1000 + p));
      grads.push_back(nullptr);
      kept.emplace_back(count, 0.0f);
    }
    step_counter[0] = static_cast<float>(rank + 7);
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t p = 0; p < values.size(); ++p) {
      std::string name = "layer" + std::to_string(p) + (p % 3 == 1 ? ".copy" : ".view");
      if (p == 5 && !renamed.empty()) name = renamed;
      if (p % 3 == 1) {
        const std::size_t n = values[p].size();
        out.push_back(dtrain::param(name, dtrain::device_span<float>{values[p].data(), n, 0},
                                    dtrain::device_span<float>{kept[p].data(), n, 0}));
      } else {
        // The name before param() took a device_span, kept for existing code.
        out.push_back(dtrain::device_param(name, values[p].data(), grads[p], values[p].size(), 0));
      }
    }
    return out;
  }
  std::vector<dtrain::parameter> buffers() {
    return {dtrain::param("step_counter", dtrain::device_span<float>{step_counter.data(), 1, 0})};
  }
  float* grad(std::size_t p) { return p % 3 == 1 ? kept[p].data() : grads[p]; }
};

// Rank r's gradient of element i of parameter p at step s: integers, so every mean is exact.
float gradient(int rank, std::size_t p, std::size_t i, int step) {
  return static_cast<float>(2 * (rank + 1) * ((static_cast<int>(p + i) + step) % 16));
}

int fail(const std::string& what) {
  FAIL_CHECK(what);
  std::fflush(stdout);
  return 1;
}

template <class Policy>
int mean_case(dtrain::context<Policy>& ctx, dtrain::gradient_compression compression, bool hook) {
  const int rank = ctx.rank(), size = ctx.size();
  model m(rank);
  dtrain::DistributedDataParallel<model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 0.004, .first_bucket_cap_mb = 0.001, .compression = compression});
  if (m.values[3][0] != 3.0f || m.step_counter[0] != 7.0f)
    return fail("rank 0's values and buffers were not broadcast");
  if (hook) {
    ddp.register_comm_hook([](device_rules::communicator& c, dtrain::gradient_bucket& b) {
      return c.allreduce(b.data, b.data, dtrain::reduce_op::avg, b.stream);
    });
  }
  for (int step = 0; step < 4; ++step) {
    for (std::size_t p = 0; p < m.values.size(); ++p) {
      float* g = m.grad(p);
      for (std::size_t i = 0; i < m.values[p].size(); ++i) g[i] = gradient(rank, p, i, step);
    }
    // Step 0 marks in an order other than the layout's, so the rebuild moves buckets.
    const std::vector<std::size_t> order =
        step == 0 ? std::vector<std::size_t>{0, 2, 4, 6, 8, 1, 3, 5, 7}
                  : std::vector<std::size_t>{8, 7, 6, 5, 4, 3, 2, 1, 0};
    for (std::size_t p : order) ddp.mark_ready(p);
    ddp.synchronize(nullptr);
    ddp.wait();
    for (std::size_t p = 0; p < m.values.size(); ++p) {
      const float* g = m.grad(p);
      for (std::size_t i = 0; i < m.values[p].size(); ++i) {
        float expected = 0;
        for (int r = 0; r < size; ++r) expected += gradient(r, p, i, step);
        expected /= static_cast<float>(size);
        // bf16 keeps 8 significant bits of each rank's pre-divided share and of the sums.
        const float tolerance =
            compression == dtrain::gradient_compression::bfloat16 ? 2e-2f : 1e-6f;
        if (std::fabs(g[i] - expected) > tolerance * std::max(1.0f, std::fabs(expected))) {
          return fail("step " + std::to_string(step) + ": parameter " + std::to_string(p) + "[" +
                      std::to_string(i) + "] is " + std::to_string(g[i]) + ", expected " +
                      std::to_string(expected));
        }
      }
    }
  }
  if (!ddp.buckets_rebuilt()) return fail("the buckets were not rebuilt after step 0");
  for (const dtrain::bucket_info& b : ddp.buckets()) {
    for (std::size_t offset : b.offsets) {
      if (offset % dtrain::bucket_alignment != 0)
        return fail("a bucket slot is not 256-byte aligned");
    }
  }
  if (device_rules::communicator::host_buffers_seen() != 0)
    return fail("DDP sent host memory to the device-only communicator");
  std::printf(
      "rank %d of %d: 4 steps averaged exactly (compression %s, hook %d, %zu buckets, rebuilt), "
      "no host buffer reached the device engine; %s\n",
      rank, size, std::string(dtrain::to_string(compression)).c_str(), hook ? 1 : 0,
      ddp.buckets().size(), ddp.topology().describe().c_str());
  return 0;
}

// Sharding (issue 34) on streams: stage 1 allreduces, stage 2 reduce-scatters
// each bucket into the rank's shard, and gather_parameters() allgathers the
// updated shards, each collective ordered after the compute stream, through a
// communicator that refuses host memory. Three steps of w -= g / 2 on each
// rank's pieces; then every value on every rank is rank 0's start minus half
// the sum of the exact means, and the pieces of all ranks cover each
// parameter once.
template <class Policy>
int shard_case(dtrain::context<Policy>& ctx, dtrain::sharding stage) {
  const int rank = ctx.rank(), size = ctx.size();
  model m(rank);
  dtrain::DistributedDataParallel<model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 0.004, .first_bucket_cap_mb = 0.001, .sharding = stage});
  constexpr int steps = 3;
  for (int step = 0; step < steps; ++step) {
    for (std::size_t p = 0; p < m.values.size(); ++p) {
      float* g = m.grad(p);
      for (std::size_t i = 0; i < m.values[p].size(); ++i) g[i] = gradient(rank, p, i, step);
    }
    for (std::size_t p = m.values.size(); p-- > 0;) ddp.mark_ready(p);
    ddp.synchronize(nullptr);
    ddp.wait();  // the host reads the gradients next (on a GPU: a kernel on the compute stream)
    for (const dtrain::shard_piece& piece : ddp.shard()) {
      if (piece.gradients.where != dtrain::memory::device)
        return fail("a shard piece's gradients are not in device memory");
      const auto* g = static_cast<const float*>(piece.gradients.data);
      auto* w = static_cast<float*>(piece.values.data);
      for (std::size_t k = 0; k < piece.values.count; ++k) {
        float expected = 0;
        for (int r = 0; r < size; ++r)
          expected += gradient(r, piece.parameter, piece.offset + k, step);
        expected /= static_cast<float>(size);
        if (g[k] != expected) {
          return fail("sharding " + std::string(dtrain::to_string(stage)) + ", step " +
                      std::to_string(step) + ": parameter " + std::to_string(piece.parameter) +
                      "[" + std::to_string(piece.offset + k) + "]'s gradient is " +
                      std::to_string(g[k]) + ", expected " + std::to_string(expected));
        }
        w[k] -= 0.5f * g[k];
      }
    }
    ddp.gather_parameters();
    ddp.wait();
  }
  std::vector<std::int64_t> covered(m.values.size(), 0);
  for (const dtrain::shard_piece& piece : ddp.shard())
    covered[piece.parameter] += static_cast<std::int64_t>(piece.values.count);
  std::vector<std::int64_t> all(covered.size() * static_cast<std::size_t>(size));
  ctx.control_plane().allgather(covered, all);
  for (std::size_t p = 0; p < m.values.size(); ++p) {
    std::int64_t sum = 0;
    for (int r = 0; r < size; ++r) sum += all[static_cast<std::size_t>(r) * covered.size() + p];
    const std::int64_t expected = static_cast<std::int64_t>(m.values[p].size()) *
                                  (stage == dtrain::sharding::none ? size : 1);
    if (sum != expected) {
      return fail("the ranks' pieces hold " + std::to_string(sum) + " elements of parameter " +
                  std::to_string(p) + ", expected " + std::to_string(expected));
    }
    for (std::size_t i = 0; i < m.values[p].size(); ++i) {
      float expected_value = static_cast<float>(p);  // rank 0's start, broadcast
      for (int step = 0; step < steps; ++step) {
        float mean = 0;
        for (int r = 0; r < size; ++r) mean += gradient(r, p, i, step);
        expected_value -= 0.5f * (mean / static_cast<float>(size));
      }
      if (m.values[p][i] != expected_value) {
        return fail("sharding " + std::string(dtrain::to_string(stage)) + ": parameter " +
                    std::to_string(p) + "[" + std::to_string(i) + "] is " +
                    std::to_string(m.values[p][i]) + " after the allgather, expected " +
                    std::to_string(expected_value));
      }
    }
  }
  if (device_rules::communicator::host_buffers_seen() != 0)
    return fail("DDP sent host memory to the device-only communicator");
  std::printf(
      "rank %d of %d: sharding %s: 3 steps on %zu of this rank's elements, every value "
      "equal after the allgather; %s\n",
      rank, size, std::string(dtrain::to_string(stage)).c_str(), ddp.shard_elements(),
      ddp.topology().describe().c_str());
  return 0;
}

// ZeRO stage 3 on streams (issue 48): each layer's values held as the
// rank's shard in "device" memory, allgathered on the communicator's stream
// by gather() (prefetched ahead by 0, 1 or 2 layers), the compute ordered
// after the allgather before any value is read. Every value read inside a
// guard is checked against the exact expected value (rank 0's start minus
// half the sum of the exact means so far): a read before the allgather has
// landed sees zeros or a mix. Then the shard's values through the host and
// back (download_shard_values / upload_shard_values: what a checkpoint of
// GPU values does), and nothing stays gathered past synchronize().
struct layered_model {
  std::vector<std::vector<float>> init;  // "device" memory: DDP copies it, then it is freed
  std::vector<float*> w, g;              // stage 3: DDP points both
  explicit layered_model(int rank) {
    for (std::size_t l = 0; l < 7; ++l) {
      const std::size_t count = 40 + (l * 211) % 600 + (l == 3 ? 3000 : 0);
      init.emplace_back(count, static_cast<float>(rank * 1000 + l));
      w.push_back(init.back().data());
      g.push_back(nullptr);
    }
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t l = 0; l < init.size(); ++l)
      out.push_back(dtrain::param("layer" + std::to_string(l), w[l], init[l].size(), g[l], 0));
    return out;
  }
};

// The value of element i of layer l at the start of step `step`.
float stage3_value(int size, std::size_t l, std::size_t i, int step) {
  float value = static_cast<float>(l);  // rank 0's start, broadcast
  for (int s = 0; s < step; ++s) {
    float mean = 0;
    for (int r = 0; r < size; ++r) mean += gradient(r, l, i, s);
    value -= 0.5f * (mean / static_cast<float>(size));
  }
  return value;
}

template <class Policy>
int stage3_case(dtrain::context<Policy>& ctx, std::size_t prefetch) {
  const int rank = ctx.rank(), size = ctx.size();
  layered_model m(rank);
  const std::vector<std::size_t> counts = [&] {
    std::vector<std::size_t> c;
    for (const auto& v : m.init) c.push_back(v.size());
    return c;
  }();
  dtrain::DistributedDataParallel<layered_model, Policy> ddp(
      ctx, m,
      {.bucket_cap_mb = 0.002,
       .first_bucket_cap_mb = 0.002,
       .sharding = dtrain::sharding::parameters,
       .prefetch_units = prefetch});
  m.init.clear();  // DDP holds the values now
  for (float* w : m.w) {
    if (w != nullptr) return fail("a value pointer is not null after construction at stage 3");
  }
  auto check_layer = [&](std::size_t l, int step, const char* pass) -> int {
    if (m.w[l] == nullptr) return fail(std::string(pass) + ": layer's values are null");
    for (std::size_t i = 0; i < counts[l]; ++i) {
      const float expected = stage3_value(size, l, i, step);
      if (m.w[l][i] != expected) {
        return fail("prefetch " + std::to_string(prefetch) + ", step " + std::to_string(step) +
                    ", " + pass + ": layer " + std::to_string(l) + "[" + std::to_string(i) +
                    "] reads " + std::to_string(m.w[l][i]) + ", expected " +
                    std::to_string(expected) +
                    " (the compute was not ordered after the allgather)");
      }
    }
    return 0;
  };
  constexpr int steps = 4;
  for (int step = 0; step < steps; ++step) {
    for (std::size_t l = 0; l < counts.size(); ++l) {  // forward
      auto held = ddp.gather({l});
      if (int status = check_layer(l, step, "forward")) return status;
    }
    for (std::size_t l = counts.size(); l-- > 0;) {  // backward
      // The reduce-scatter of the layer before is in flight: the compute
      // waits for this layer's allgather alone (work::stream_wait), not for
      // every collective so far (the communicator's stream_wait).
      const int waits = device_rules::communicator::waits_for_all();
      auto held = ddp.gather({l});
      if (device_rules::communicator::waits_for_all() != waits)
        return fail("gather() ordered the compute after every collective, not its allgather alone");
      if (int status = check_layer(l, step, "backward")) return status;
      for (std::size_t i = 0; i < counts[l]; ++i) m.g[l][i] = gradient(rank, l, i, step);
      ddp.mark_ready(l);
    }
    ddp.synchronize(nullptr);
    if (ddp.memory_use().gathered != 0) return fail("values stay gathered past synchronize()");
    ddp.wait();
    ddp.optimizer_step([&](const dtrain::shard_piece& piece) {
      if (piece.values.where != dtrain::memory::device)
        throw std::runtime_error("a stage-3 piece's values are not in device memory");
      auto* w = static_cast<float*>(piece.values.data);
      const auto* grad = static_cast<const float*>(piece.gradients.data);
      for (std::size_t k = 0; k < piece.values.count; ++k) w[k] -= 0.5f * grad[k];
    });
    ddp.wait();
  }
  for (float* w : m.w) {
    if (w != nullptr) return fail("a value pointer is not null between steps");
  }
  // The shard through the host and back, as a checkpoint of GPU values moves it.
  std::vector<std::byte> host(ddp.shard_elements() * sizeof(float));
  ddp.download_shard_values(host);
  std::vector<std::byte> zeros(host.size());
  ddp.upload_shard_values(zeros);
  {
    auto held = ddp.gather({std::size_t{0}});
    for (std::size_t i = 0; i < counts[0]; ++i) {
      if (m.w[0][i] != 0.0f) return fail("upload_shard_values() did not reach the values");
    }
  }
  ddp.upload_shard_values(host);
  for (std::size_t l = 0; l < counts.size(); ++l) {
    auto held = ddp.gather({l});
    if (int status = check_layer(l, steps, "after the shard's round trip")) return status;
  }
  // The export for inference: rank 0 gets every layer once, one bucket at a
  // time, and leaves whole only what was (the prefetch window of the pass above).
  const std::size_t whole_before = ddp.memory_use().gathered;
  std::size_t exported = 0;
  std::string wrong;
  ddp.export_parameters([&](const dtrain::parameter& p, std::span<const std::byte> bytes) {
    const std::size_t l = std::stoul(p.name.substr(5));  // "layer<l>"
    std::vector<float> values(bytes.size() / sizeof(float));
    std::memcpy(values.data(), bytes.data(), bytes.size());
    ++exported;
    for (std::size_t i = 0; i < values.size() && wrong.empty(); ++i) {
      if (values.size() != counts[l] || values[i] != stage3_value(size, l, i, steps))
        wrong = "export_parameters(): " + p.name + "[" + std::to_string(i) + "] is wrong";
    }
  });
  if (!wrong.empty()) return fail(wrong);
  if (exported != (rank == 0 ? counts.size() : 0))
    return fail("export_parameters() visited " + std::to_string(exported) + " parameters");
  if (ddp.memory_use().gathered != whole_before)
    return fail("export_parameters() left values whole");
  // Steps whose pass uses the first layer only: mark_all_ready() marks the
  // others without the named error. (The first such step follows the
  // gathers of every layer above, in the same step; the second has only its own.)
  for (int pass = 0; pass < 2; ++pass) {
    {
      auto held = ddp.gather({std::size_t{0}});
      ddp.mark_ready(std::size_t{0});
    }
    try {
      ddp.mark_all_ready();
    } catch (const std::exception& e) {
      return fail(std::string("mark_all_ready() after a pass over one layer threw: ") + e.what());
    }
    ddp.synchronize(nullptr);
    ddp.wait();
  }
  const dtrain::gather_counts counted = ddp.gather_counts();
  if (size > 1 && device_rules::rules_work::waits_for_one() == 0)
    return fail("no gather() waited for its allgather (work::stream_wait)");
  if (size > 1 && prefetch > 0 && counted.prefetched == 0)
    return fail("prefetch " + std::to_string(prefetch) + ": nothing was prefetched");
  if (prefetch == 0 && counted.prefetched != 0) return fail("prefetch 0 prefetched");
  if (device_rules::communicator::host_buffers_seen() != 0)
    return fail("DDP sent host memory to the device-only communicator");
  std::printf(
      "rank %d of %d: stage 3 on streams, prefetch %zu: %d steps, every value read in a "
      "gather() exact (%llu gathers on demand, %llu prefetched); %s\n",
      rank, size, prefetch, steps, static_cast<unsigned long long>(counted.on_demand),
      static_cast<unsigned long long>(counted.prefetched), ddp.topology().describe().c_str());
  return 0;
}

// What rank `rank` writes on its compute stream before DDP is built.
float late_value(int rank, std::size_t p) {
  return static_cast<float>(100000 + rank * 1000) + static_cast<float>(p);
}

int stream_init_case(dtrain::context<policy>& ctx) {
  const int rank = ctx.rank();
  model m(rank);
  // The compute stream: the parameters and the buffer are written there, after
  // a while (as a kernel still running when the host goes on).
  auto compute = std::make_shared<device_rules::fake_stream>();
  const dtrain::stream_handle handle = device_rules::register_stream(compute);
  compute->enqueue({}, [&m, rank] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (std::size_t p = 0; p < m.values.size(); ++p)
      std::fill(m.values[p].begin(), m.values[p].end(), late_value(rank, p));
    m.step_counter[0] = static_cast<float>(rank + 70);
  });
  dtrain::DistributedDataParallel<model, policy> ddp(ctx, m, {.stream = handle});
  static const std::atomic<bool> never{false};
  compute->synchronize(never);
  for (std::size_t p = 0; p < m.values.size(); ++p) {
    for (float v : m.values[p]) {
      if (v != late_value(0, p)) {
        return fail("rank " + std::to_string(rank) + ": parameter " + std::to_string(p) +
                    " starts at " + std::to_string(v) + ", not rank 0's " +
                    std::to_string(late_value(0, p)) +
                    " written on the compute stream: the first broadcast was not ordered after it");
      }
    }
  }
  if (m.step_counter[0] != 70.0f)
    return fail("rank " + std::to_string(rank) + ": the buffer starts at " +
                std::to_string(m.step_counter[0]) + ", not rank 0's 70");
  std::printf(
      "rank %d: every parameter and buffer starts from what rank 0 wrote on its compute "
      "stream\n",
      rank);
  return 0;
}

// The timeline's device time (issue 51), on a compute stream of the rank's
// own: every bucket's span ends with its span on the device track, and each
// device span holds the collective it times, up to its completion
// (DEVICE_RULES_COLLECTIVE_MS makes each last that long after the host
// enqueued it).
int timeline_case(dtrain::context<policy>& ctx) {
  const int rank = ctx.rank();
  model m(rank);
  auto compute = std::make_shared<device_rules::fake_stream>();
  const dtrain::stream_handle handle = device_rules::register_stream(compute);
  const std::string path =
      (std::filesystem::temp_directory_path() /
       ("dtrain_device_rules_timeline_" + std::to_string(::getpid()) + ".json"))
          .string();
  const std::string file = dtrain::detail::timeline_file(path, rank);
  {
    dtrain::DistributedDataParallel<model, policy> ddp(
        ctx, m,
        {.bucket_cap_mb = 0.004, .first_bucket_cap_mb = 0.001, .timeline = path, .stream = handle});
    for (int step = 0; step < 3; ++step) {
      for (std::size_t p = 0; p < m.values.size(); ++p) {
        float* g = m.grad(p);
        for (std::size_t i = 0; i < m.values[p].size(); ++i) g[i] = gradient(rank, p, i, step);
      }
      for (std::size_t p = m.values.size(); p-- > 0;) ddp.mark_ready(p);
      ddp.synchronize(handle);
      ddp.wait();
    }
    ddp.flush_timeline();
  }
  std::vector<dtrain_test::collective_run> ran;
  {
    const std::lock_guard lock(device_rules::communicator::ran_mutex());
    ran = device_rules::communicator::ran();
  }
  dtrain_test::device_span_check checked;
  try {
    checked = dtrain_test::check_device_spans(file, &ran);
  } catch (const std::exception& e) {
    std::filesystem::remove(file);
    return fail(e.what());
  }
  std::filesystem::remove(file);
  std::printf(
      "rank %d of %d: %zu bucket spans end with their device time, each after its collective "
      "completed (clock within %.3f us)\n",
      rank, ctx.size(), checked.spans, checked.uncertainty_us);
  return 0;
}

int mismatch_case(dtrain::context<policy>& ctx) {
  model m(ctx.rank());
  if (ctx.rank() == ctx.size() - 1) m.renamed = "layer5.renamed";
  dtrain::DistributedDataParallel<model, policy> ddp(ctx, m);
  return fail("the models differ, but the constructor returned");
}

int hung_peer_case(dtrain::context<policy>& ctx) {
  model m(ctx.rank());
  dtrain::DistributedDataParallel<model, policy> ddp(ctx, m);
  const auto timeout = std::chrono::milliseconds(
      static_cast<long>(std::atof(std::getenv("DTRAIN_COLLECTIVE_TIMEOUT")) * 1000));
  if (ctx.rank() != 0) {
    // Never steps: rank 0's buckets wait for it. Leave without tearing down the
    // communicator rank 0 gave up on.
    std::this_thread::sleep_for(timeout * 2 + std::chrono::seconds(2));
    std::fflush(stdout);
    std::_Exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  bool timed_out = false;
  try {
    for (std::size_t p = 0; p < m.values.size(); ++p) ddp.mark_ready(p);
    ddp.synchronize();
    ddp.mark_ready(std::size_t{0});  // the next call reports what the watchdog found
  } catch (const dtrain::timeout_error& e) {
    timed_out = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  std::printf("rank 0: after %lld ms: %s\n", static_cast<long long>(took.count()), message.c_str());
  std::fflush(stdout);
  int status = 0;
  if (!timed_out) status = fail("expected a timeout_error");
  if (message.find("allreduce") == std::string::npos)
    status = fail("the message does not name the collective");
  if (took > timeout + std::chrono::seconds(1))
    status = fail("not reported within the timeout plus one second");
  // The timeout counts from the bucket's launch, a moment after `start`.
  if (took < timeout - std::chrono::milliseconds(100)) status = fail("reported before the timeout");
  if (status == 0) std::printf("rank 0: the watchdog reported the hung peer in time\n");
  std::fflush(stdout);
  std::_Exit(status);
}

bool hierarchical() { return dtrain_test::job().topology == "hierarchical"; }

}  // namespace

TEST_CASE("mean") {
  if (hierarchical()) {
    CHECK(dtrain_test::run_with<hierarchical_policy>([](auto& ctx) {
            int status = mean_case(ctx, dtrain::gradient_compression::none, false);
            if (status == 0) status = mean_case(ctx, dtrain::gradient_compression::bfloat16, false);
            return status;
          }) == 0);
    return;
  }
  CHECK(dtrain_test::run_with<policy>([](auto& ctx) {
          int status = mean_case(ctx, dtrain::gradient_compression::none, false);
          if (status == 0) status = mean_case(ctx, dtrain::gradient_compression::bfloat16, false);
          if (status == 0) status = mean_case(ctx, dtrain::gradient_compression::none, true);
          return status;
        }) == 0);
}

TEST_CASE("accumulate") {
  // Float32 accumulation with NCCL's rules: the alltoalls on the
  // communicators' streams, each sum enqueued on the stream after its
  // alltoall (device_rules::memory::accumulate), never before the blocks arrive.
  const dtrain_test::accumulate_memory memory{.device = true, .device_id = 0};
  const std::vector<dtrain::sharding> stages{dtrain::sharding::none, dtrain::sharding::optimizer,
                                             dtrain::sharding::gradients};
  if (hierarchical()) {
    CHECK(dtrain_test::run_with<hierarchical_policy>([&](auto& ctx) {
            return dtrain_test::accumulate_case(ctx, memory, true, stages);
          }) == 0);
    return;
  }
  CHECK(dtrain_test::run_with<policy>([&](auto& ctx) {
          return dtrain_test::accumulate_case(ctx, memory, false, stages);
        }) == 0);
}

TEST_CASE("shard") {
  if (hierarchical()) {
    // Stage 2's two-level reduce-scatter and allgather, each on a stream.
    CHECK(dtrain_test::run_with<hierarchical_policy>([](auto& ctx) {
            int status = 0;
            for (const dtrain::sharding stage :
                 {dtrain::sharding::optimizer, dtrain::sharding::gradients}) {
              if (status == 0) status = shard_case(ctx, stage);
            }
            return status;
          }) == 0);
    return;
  }
  CHECK(dtrain_test::run_with<policy>([](auto& ctx) {
          int status = 0;
          for (const dtrain::sharding stage :
               {dtrain::sharding::none, dtrain::sharding::optimizer, dtrain::sharding::gradients}) {
            if (status == 0) status = shard_case(ctx, stage);
          }
          return status;
        }) == 0);
}

TEST_CASE("stage3") {
  auto all_prefetches = [](auto& ctx) {
    int status = 0;
    for (const std::size_t prefetch : {std::size_t{0}, std::size_t{1}, std::size_t{2}}) {
      if (status == 0) status = stage3_case(ctx, prefetch);
    }
    return status;
  };
  if (hierarchical()) {
    CHECK(dtrain_test::run_with<hierarchical_policy>(all_prefetches) == 0);
    return;
  }
  CHECK(dtrain_test::run_with<policy>(all_prefetches) == 0);
}

TEST_CASE("stream-init") {
  CHECK(dtrain_test::run_with<policy>([](auto& ctx) { return stream_init_case(ctx); }) == 0);
}

TEST_CASE("timeline") {
  CHECK(dtrain_test::run_with<policy>([](auto& ctx) { return timeline_case(ctx); }) == 0);
}

// The job must fail: its status and output are the test's (check_job.cmake).
TEST_CASE("mismatch") {
  dtrain_test::end_job(dtrain_test::run_with<policy>([](auto& ctx) { return mismatch_case(ctx); }));
}

// Every rank leaves with _Exit: rank 0 says whether the watchdog reported in time.
TEST_CASE("hung-peer") {
  dtrain_test::end_job(
      dtrain_test::run_with<policy>([](auto& ctx) { return hung_peer_case(ctx); }));
}
