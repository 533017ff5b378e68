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
//   stream-init  each rank writes its parameters on a compute stream of its
//                own, late, then builds DDP with ddp_options::stream: every rank
//                starts from what rank 0 wrote there (the first broadcast is
//                ordered after that stream)
#include "../support/multirank.hpp"
#include "device_rules.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
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

TEST_CASE("stream-init") {
  CHECK(dtrain_test::run_with<policy>([](auto& ctx) { return stream_init_case(ctx); }) == 0);
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
