// dtrain_gpu_tests: the GPU path on a real GPU (issue 11). Without a CUDA
// device every mode prints "SKIPPED: no CUDA device (...)" and exits 77.
//
//   dtrain_gpu_tests              the doctest suite "gpu": DistributedDataParallel
//                                 over NCCL at world size 1 (one GPU cannot host two
//                                 NCCL ranks): views and copies, a rebuild, fp16/bf16
//                                 compression against the host casts, a compute
//                                 stream held by cudaLaunchHostFunc, comm hooks with
//                                 and without a stream (each with always_reduce, so
//                                 that NCCL runs), and world size 1 as users get it (no
//                                 collective), the timeline's device spans behind a held
//                                 compute stream. Registered as gpu.ddp.1rank.
//   dtrain_gpu_tests --hang       the watchdog on a real hang: the compute stream is
//                                 held past the collective timeout; wait() must throw
//                                 timeout_error naming the allreduce within the timeout
//                                 plus one second. Registered as gpu.watchdog_hang.
//   mpirun -np N dtrain_gpu_tests --mpi
//                                 MPI with device buffers, staged through pinned host
//                                 memory (every rank may share one GPU): every
//                                 collective, ordering after the caller's stream, and
//                                 a staging pool that stops growing. gpu.mpi_device.Nranks.
//
// gpu_casts.cu, an nvcc unit of this program, registers dtrain's CUDA casts
// (gradient compression on the device).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <unistd.h>

#include <dtrain/dtrain.hpp>

#include "../support/trace_check.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>

std::string_view dtrain_gpu_casts_unit();  // gpu_casts.cu: "nvcc"

namespace {

using namespace std::chrono_literals;
using policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::nccl>;

// A failed CUDA call in the test itself fails the test case with its text.
#define GPU_CHECK(call) DTRAIN_CUDA_CHECK(call)

/// A world of one rank: a store on port 0, an NCCL communicator on GPU 0 and
/// the host control plane over the same store.
struct world_of_one {
  explicit world_of_one(std::chrono::milliseconds timeout = 60s)
      : comm(store, 0, 1, 0,
             dtrain::nccl_options{.collectives = {.timeout = timeout}, .init_timeout = 60s}) {}

  dtrain::store_server server{"127.0.0.1", 0, {.timeout = 60s, .log = [](std::string_view) {}}};
  dtrain::store_client client{"127.0.0.1", server.port(), {.timeout = 60s}};
  dtrain::prefix_store<dtrain::store_client> store{client, "gpu-test"};
  dtrain::store_channel<dtrain::prefix_store<dtrain::store_client>> channel{store, 0, 1};
  dtrain::control_plane control{channel};
  dtrain::nccl_communicator comm;
};

/// Device memory freed with its owner.
struct device_floats {
  explicit device_floats(std::size_t n) : count(n) {
    GPU_CHECK(cudaGetDevice(&device));
    GPU_CHECK(cudaMalloc(&data, n * sizeof(float)));
    GPU_CHECK(cudaMemset(data, 0, n * sizeof(float)));
  }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
  ~device_floats() { (void)cudaFree(data); }
  [[nodiscard]] dtrain::buffer buffer() const {
    return {data, count, dtrain::dtype::float32, dtrain::memory::device, device};
  }
  float* data = nullptr;
  std::size_t count = 0;
  int device = 0;
};

/// Pinned host memory (an async copy from it does not wait for the stream).
struct pinned_floats {
  explicit pinned_floats(std::size_t n) : count(n) {
    GPU_CHECK(cudaMallocHost(&data, n * sizeof(float)));
  }
  pinned_floats(const pinned_floats&) = delete;
  pinned_floats& operator=(const pinned_floats&) = delete;
  ~pinned_floats() { (void)cudaFreeHost(data); }
  float* data = nullptr;
  std::size_t count = 0;
};

/// A non-blocking stream of the test's, destroyed with its owner: declare it
/// before the DDP that uses it, so that it outlives the DDP's destructor.
struct test_stream {
  test_stream() { GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  test_stream(const test_stream&) = delete;
  test_stream& operator=(const test_stream&) = delete;
  ~test_stream() { (void)cudaStreamDestroy(stream); }
  cudaStream_t stream = nullptr;
};

std::vector<float> download(const float* device, std::size_t n) {
  std::vector<float> out(n);
  GPU_CHECK(cudaMemcpy(out.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

/// cudaMemcpy from pageable memory may return before the copy has landed
/// (CUDA's API synchronisation rules), and a collective ordered after a
/// non-blocking stream does not wait for the legacy default stream: wait for
/// the device, so that what follows sees the values on any stream.
void upload(float* device, const std::vector<float>& values) {
  GPU_CHECK(
      cudaMemcpy(device, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
  GPU_CHECK(cudaDeviceSynchronize());
}

/// Parameter p's gradient in step `step`: values no 16-bit float holds exactly.
float gradient(std::size_t p, std::size_t i, int step) {
  return 0.001f * static_cast<float>(i % 977) + 1.0f / static_cast<float>(3 + p + step);
}

/// A model whose parameters live on GPU 0: sizes that cross bucket caps and
/// the 256-byte slot alignment. Gradients are device pointers DDP may repoint
/// into its buckets (views) or buffers it copies (copies).
struct device_model {
  explicit device_model(bool copies) : copies(copies) {
    for (std::size_t n : sizes) {
      values.emplace_back(std::make_unique<device_floats>(n));
      owned_grads.emplace_back(std::make_unique<device_floats>(n));
      grads.push_back(owned_grads.back()->data);
      std::vector<float> v(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(values.size()) + 0.5f;
      upload(values.back()->data, v);
    }
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      const std::string name = "layer" + std::to_string(p);
      out.push_back(copies ? dtrain::device_param_copy(name, values[p]->data, grads[p], sizes[p], 0)
                           : dtrain::device_param(name, values[p]->data, grads[p], sizes[p], 0));
    }
    return out;
  }

  bool copies;
  std::vector<std::size_t> sizes{1000, 3, 70000, 257, 4096};
  std::vector<std::unique_ptr<device_floats>> values, owned_grads;
  std::vector<float*> grads;  // where each gradient is now
};

/// The host's rounding of x through the wire type, as DDP's mean at world size 1.
float through(dtrain::gradient_compression c, float x) {
  switch (c) {
    case dtrain::gradient_compression::none: return x;
    case dtrain::gradient_compression::float16: return static_cast<float>(dtrain::float16(x));
    case dtrain::gradient_compression::bfloat16: return static_cast<float>(dtrain::bfloat16(x));
  }
  return x;
}

/// Steps of DDP on `stream` (null: the legacy default stream), gradients
/// written on the device in reverse layer order (so that the rebuild changes
/// the layout), each step's means checked bit for bit against the host.
void train_and_check(
    bool copies, dtrain::gradient_compression compression, cudaStream_t stream,
    std::function<void(dtrain::DistributedDataParallel<device_model, policy>&)> setup = {},
    bool always_reduce = true) {
  world_of_one world;
  device_model model(copies);
  dtrain::DistributedDataParallel<device_model, policy> ddp(world.comm, world.control, model,
                                                            {.bucket_cap_mb = 0.1,
                                                             .first_bucket_cap_mb = 0.01,
                                                             .gradient_as_bucket_view = !copies,
                                                             .compression = compression,
                                                             .always_reduce = always_reduce});
  if (stream) ddp.set_stream(stream);
  if (setup) setup(ddp);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t p = model.sizes.size(); p-- > 0;) {
      std::vector<float> g(model.sizes[p]);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = gradient(p, i, step);
      GPU_CHECK(cudaMemcpyAsync(model.grads[p], g.data(), g.size() * sizeof(float),
                                cudaMemcpyHostToDevice, stream));
      GPU_CHECK(cudaStreamSynchronize(stream));  // g goes out of scope
      ddp.mark_ready(p);
    }
    ddp.synchronize();
    GPU_CHECK(cudaStreamSynchronize(stream));
    for (std::size_t p = 0; p < model.sizes.size(); ++p) {
      const std::vector<float> mean = download(model.grads[p], model.sizes[p]);
      std::size_t wrong = 0, first = 0;
      for (std::size_t i = 0; i < mean.size(); ++i) {
        if (mean[i] != through(compression, gradient(p, i, step)) && wrong++ == 0) first = i;
      }
      INFO("step ", step, ", layer", p, ": first wrong element ", first, " = ", mean[first],
           ", expected ", through(compression, gradient(p, first, step)));
      CHECK(wrong == 0);
    }
  }
  CHECK(ddp.buckets_rebuilt());
  CHECK(ddp.steps() == 3);
  for (std::size_t p = 0; p < model.sizes.size(); ++p) {
    const float* own = model.owned_grads[p]->data;
    if (copies) {
      CHECK(model.grads[p] == own);  // the model's own buffers, never repointed
    } else {
      CHECK(model.grads[p] != own);  // repointed into the bucket storage
    }
  }
}

bool have_device() {
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found == cudaSuccess && devices > 0) return true;
  std::printf("SKIPPED: no CUDA device (%s)\n",
              found != cudaSuccess ? cudaGetErrorString(found) : "cudaGetDeviceCount found 0");
  return false;
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("DDP over NCCL: views, copies, a rebuild; the legacy default stream") {
    SUBCASE("views") { train_and_check(false, dtrain::gradient_compression::none, nullptr); }
    SUBCASE("copies") { train_and_check(true, dtrain::gradient_compression::none, nullptr); }
  }

  TEST_CASE("DDP over NCCL on a stream of the caller's, views and copies") {
    const test_stream owned;
    cudaStream_t stream = owned.stream;
    SUBCASE("views") { train_and_check(false, dtrain::gradient_compression::none, stream); }
    SUBCASE("copies") { train_and_check(true, dtrain::gradient_compression::none, stream); }
  }

  TEST_CASE("DDP compression on the GPU rounds exactly as the host casts") {
    REQUIRE(dtrain_gpu_casts_unit() == "nvcc");
    REQUIRE(dtrain::DistributedDataParallel<device_model, policy>::compression_available());
    const test_stream owned;
    cudaStream_t stream = owned.stream;
    for (auto c : {dtrain::gradient_compression::float16, dtrain::gradient_compression::bfloat16}) {
      CAPTURE(dtrain::to_string(c));
      train_and_check(false, c, stream);
      train_and_check(true, c, stream);
    }
  }

  TEST_CASE("world size 1 as users get it: no collective, the same gradients, compression rounds") {
    const test_stream owned;
    for (auto c : {dtrain::gradient_compression::none, dtrain::gradient_compression::bfloat16}) {
      CAPTURE(dtrain::to_string(c));
      train_and_check(false, c, owned.stream, {}, false);
      train_and_check(true, c, owned.stream, {}, false);
      train_and_check(true, c, nullptr, {}, false);
    }
  }

  TEST_CASE("sharding at world size 1 on the GPU: pieces in device memory, the norm, the update") {
    // (Two and more ranks of the same code: ddp.device_rules.shard, NCCL's rules on the host.)
    const test_stream owned;
    for (const auto stage : {dtrain::sharding::optimizer, dtrain::sharding::gradients}) {
      CAPTURE(dtrain::to_string(stage));
      world_of_one world;
      device_model model(false);
      dtrain::DistributedDataParallel<device_model, policy> ddp(world.comm, world.control, model,
                                                                {.bucket_cap_mb = 0.1,
                                                                 .first_bucket_cap_mb = 0.01,
                                                                 .always_reduce = true,
                                                                 .sharding = stage});
      ddp.set_stream(owned.stream);
      std::size_t elements = 0;
      for (std::size_t n : model.sizes) elements += n;
      CHECK(ddp.shard_elements() == elements);
      double squares = 0;
      for (std::size_t p = model.sizes.size(); p-- > 0;) {
        std::vector<float> g(model.sizes[p]);
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] = gradient(p, i, 0);
          squares += static_cast<double>(g[i]) * static_cast<double>(g[i]);
        }
        GPU_CHECK(cudaMemcpyAsync(model.grads[p], g.data(), g.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, owned.stream));
        GPU_CHECK(cudaStreamSynchronize(owned.stream));
        ddp.mark_ready(p);
      }
      ddp.synchronize();
      CHECK(ddp.gradient_norm() == doctest::Approx(std::sqrt(squares)));
      // The update: w -= g / 2 on each piece, through the host (a kernel in a real trainer).
      ddp.optimizer_step([&](const dtrain::shard_piece& piece) {
        REQUIRE(piece.values.where == dtrain::memory::device);
        std::vector<float> w =
            download(static_cast<const float*>(piece.values.data), piece.values.count);
        const std::vector<float> g =
            download(static_cast<const float*>(piece.gradients.data), piece.values.count);
        for (std::size_t k = 0; k < w.size(); ++k) w[k] -= 0.5f * g[k];
        upload(static_cast<float*>(piece.values.data), w);
      });
      GPU_CHECK(cudaStreamSynchronize(owned.stream));
      for (std::size_t p = 0; p < model.sizes.size(); ++p) {
        const std::vector<float> w = download(model.values[p]->data, model.sizes[p]);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < w.size(); ++i) {
          const float expected = static_cast<float>(p + 1) + 0.5f - 0.5f * gradient(p, i, 0);
          wrong += w[i] == expected ? 0 : 1;
        }
        INFO("layer ", p);
        CHECK(wrong == 0);
      }
      CHECK_THROWS_AS(ddp.optimizer_step([](const dtrain::shard_piece&) {}), dtrain::error);
    }
  }

  TEST_CASE(
      "stage 3 at world size 1 on the GPU: the shard in device memory, gathers on the stream") {
    // (Two and more ranks of the same code: ddp.device_rules.stage3, NCCL's rules on the host.)
    const test_stream owned;
    const cudaStream_t stream = owned.stream;
    auto on_stream = [&](const float* device, std::size_t n) {
      std::vector<float> out(n);
      GPU_CHECK(
          cudaMemcpyAsync(out.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
      GPU_CHECK(cudaStreamSynchronize(stream));
      return out;
    };
    auto to_stream = [&](float* device, const std::vector<float>& values) {
      GPU_CHECK(cudaMemcpyAsync(device, values.data(), values.size() * sizeof(float),
                                cudaMemcpyHostToDevice, stream));
      GPU_CHECK(cudaStreamSynchronize(stream));
    };
    struct layers {
      std::vector<std::size_t> sizes = {3000, 17, 70000, 513};
      std::vector<std::unique_ptr<device_floats>> init;
      std::vector<float*> w, g;
      int device = 0;
      std::vector<dtrain::parameter> parameters() {
        std::vector<dtrain::parameter> out;
        for (std::size_t l = 0; l < sizes.size(); ++l)
          out.push_back(dtrain::param("layer" + std::to_string(l), w[l], sizes[l], g[l], device));
        return out;
      }
    } model;
    GPU_CHECK(cudaGetDevice(&model.device));
    for (std::size_t l = 0; l < model.sizes.size(); ++l) {
      model.init.push_back(std::make_unique<device_floats>(model.sizes[l]));
      upload(model.init.back()->data,
             std::vector<float>(model.sizes[l], static_cast<float>(l + 1)));
      model.w.push_back(model.init.back()->data);
      model.g.push_back(nullptr);
    }
    world_of_one world;
    dtrain::DistributedDataParallel<layers, policy> ddp(world.comm, world.control, model,
                                                        {.bucket_cap_mb = 0.1,
                                                         .first_bucket_cap_mb = 0.01,
                                                         .always_reduce = true,
                                                         .sharding = dtrain::sharding::parameters,
                                                         .prefetch_units = 1});
    ddp.set_stream(stream);
    GPU_CHECK(cudaDeviceSynchronize());
    model.init.clear();  // DDP holds the values: the model's memory may go
    for (float* w : model.w) CHECK(w == nullptr);
    for (const dtrain::shard_piece& piece : ddp.shard())
      CHECK(piece.values.where == dtrain::memory::device);
    auto expected = [](std::size_t l, std::size_t i, int step) {
      float value = static_cast<float>(l + 1);
      for (int s = 0; s < step; ++s) value -= 0.5f * gradient(l, i, s);
      return value;
    };
    auto check_layer = [&](std::size_t l, int step) {
      REQUIRE(model.w[l] != nullptr);
      const std::vector<float> w = on_stream(model.w[l], model.sizes[l]);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < w.size(); ++i) wrong += w[i] == expected(l, i, step) ? 0 : 1;
      INFO("step ", step, ", layer ", l);
      CHECK(wrong == 0);
    };
    constexpr int steps = 3;
    for (int step = 0; step < steps; ++step) {
      for (std::size_t l = 0; l < model.sizes.size(); ++l) {
        auto held = ddp.gather({l});
        check_layer(l, step);
      }
      for (std::size_t l = model.sizes.size(); l-- > 0;) {
        auto held = ddp.gather({l});
        check_layer(l, step);
        std::vector<float> grad(model.sizes[l]);
        for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = gradient(l, i, step);
        to_stream(model.g[l], grad);
        ddp.mark_ready(l);
      }
      ddp.synchronize();
      CHECK(ddp.memory_use().gathered == 0);
      ddp.optimizer_step([&](const dtrain::shard_piece& piece) {
        auto* values = static_cast<float*>(piece.values.data);
        std::vector<float> w = on_stream(values, piece.values.count);
        const std::vector<float> grad =
            on_stream(static_cast<const float*>(piece.gradients.data), piece.values.count);
        for (std::size_t k = 0; k < w.size(); ++k) w[k] -= 0.5f * grad[k];
        to_stream(values, w);
      });
    }
    CHECK(ddp.gather_counts().on_demand > 0);
    // The shard through the host and back, as checkpoint::add_sharded("parameters", ddp).
    std::vector<std::byte> host(ddp.shard_elements() * sizeof(float));
    ddp.download_shard_values(host);
    ddp.upload_shard_values(std::vector<std::byte>(host.size()));
    {
      auto held = ddp.gather({std::size_t{0}});
      const std::vector<float> zero = on_stream(model.w[0], model.sizes[0]);
      CHECK(std::all_of(zero.begin(), zero.end(), [](float x) { return x == 0.0f; }));
    }
    ddp.upload_shard_values(host);
    for (std::size_t l = 0; l < model.sizes.size(); ++l) {
      auto held = ddp.gather({l});
      check_layer(l, steps);
    }
  }

  TEST_CASE("comm hooks see the bucket on the device and the compute stream") {
    const test_stream owned;
    cudaStream_t stream = owned.stream;
    for (cudaStream_t s : {stream, static_cast<cudaStream_t>(nullptr)}) {
      CAPTURE(s == nullptr ? "legacy default stream" : "a stream of the caller's");
      std::size_t calls = 0;
      bool all_on_device = true, all_on_stream = true;
      train_and_check(false, dtrain::gradient_compression::none, s, [&](auto& ddp) {
        ddp.register_comm_hook([&, s](dtrain::nccl_communicator& c, dtrain::gradient_bucket& b) {
          ++calls;
          all_on_device = all_on_device && b.data.where == dtrain::memory::device;
          all_on_stream = all_on_stream && b.stream == s;
          return c.allreduce(b.data, b.data, dtrain::reduce_op::avg, b.stream);
        });
      });
      CHECK(calls >= 3);
      CHECK(all_on_device);
      CHECK(all_on_stream);
    }
  }

  TEST_CASE("buckets wait for the compute stream (held by cudaLaunchHostFunc)") {
    const test_stream owned;
    cudaStream_t stream = owned.stream;
    world_of_one world;
    device_model model(true);
    dtrain::DistributedDataParallel<device_model, policy> ddp(
        world.comm, world.control, model,
        {.gradient_as_bucket_view = false, .always_reduce = true});
    ddp.set_stream(stream);

    // The compute stream stops at a host function until the test lets it go;
    // the gradients are written only after it, from pinned memory (no host sync).
    static std::atomic<bool> release{false};
    release = false;
    GPU_CHECK(cudaLaunchHostFunc(
        stream,
        [](void*) {
          while (!release.load()) std::this_thread::sleep_for(1ms);
        },
        nullptr));
    // Should DDP block the host on the held stream, the test fails instead of hanging.
    std::thread safety([] {
      for (int i = 0; i < 200 && !release.load(); ++i) std::this_thread::sleep_for(100ms);
      release = true;
    });
    const auto before = std::chrono::steady_clock::now();
    std::vector<std::unique_ptr<pinned_floats>> staged;
    for (std::size_t p = 0; p < model.sizes.size(); ++p) {
      staged.emplace_back(std::make_unique<pinned_floats>(model.sizes[p]));
      for (std::size_t i = 0; i < model.sizes[p]; ++i) staged.back()->data[i] = gradient(p, i, 7);
      GPU_CHECK(cudaMemcpyAsync(model.grads[p], staged.back()->data, model.sizes[p] * sizeof(float),
                                cudaMemcpyHostToDevice, stream));
      ddp.mark_ready(p);
    }
    ddp.synchronize();  // the host does not wait
    CHECK(std::chrono::steady_clock::now() - before < 10s);
    std::this_thread::sleep_for(300ms);
    // Every bucket's allreduce is queued behind the held compute stream.
    const cudaError_t comm_stream = cudaStreamQuery(ddp.communicator().stream());
    CHECK(comm_stream == cudaErrorNotReady);
    release = true;
    safety.join();
    GPU_CHECK(cudaStreamSynchronize(stream));
    GPU_CHECK(cudaStreamSynchronize(ddp.communicator().stream()));
    for (std::size_t p = 0; p < model.sizes.size(); ++p) {
      const std::vector<float> mean = download(model.grads[p], model.sizes[p]);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < mean.size(); ++i) wrong += mean[i] != gradient(p, i, 7);
      INFO("layer", p);
      CHECK(wrong == 0);
    }
  }

  TEST_CASE("the timeline's device spans start when the held compute stream lets them go") {
    // Issue 51: the host launches every bucket at once; the device reaches
    // them only after the host function holding the compute stream returns.
    // Their device spans say so, on the host's clock.
    const test_stream owned;
    cudaStream_t stream = owned.stream;
    world_of_one world;
    device_model model(true);
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("dtrain_gpu_timeline_" + std::to_string(::getpid()) + ".json"))
                                 .string();
    const std::string file = dtrain::detail::timeline_file(path, 0);
    static std::atomic<bool> release{false};
    static std::atomic<std::int64_t> released_ns{0};
    release = false;
    {
      dtrain::DistributedDataParallel<device_model, policy> ddp(
          world.comm, world.control, model,
          {.gradient_as_bucket_view = false, .always_reduce = true, .timeline = path});
      ddp.set_stream(stream);
      GPU_CHECK(cudaLaunchHostFunc(
          stream,
          [](void*) {
            while (!release.load()) std::this_thread::sleep_for(1ms);
            released_ns = dtrain::detail::timeline::now();
          },
          nullptr));
      std::thread safety([] {
        for (int i = 0; i < 200 && !release.load(); ++i) std::this_thread::sleep_for(100ms);
        release = true;
      });
      for (std::size_t p = 0; p < model.sizes.size(); ++p) ddp.mark_ready(p);
      ddp.synchronize();  // the host does not wait
      std::this_thread::sleep_for(200ms);
      release = true;
      safety.join();
      GPU_CHECK(cudaStreamSynchronize(stream));
      ddp.flush_timeline();
    }
    dtrain_test::device_span_check checked;
    CHECK_NOTHROW(checked = dtrain_test::check_device_spans(file, nullptr));
    CHECK(checked.spans > 0);
    // Every device span starts after the release (the host launched them 200 ms before).
    std::ifstream in(file);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    const auto trace = dtrain::detail::json::parse(text, file);
    const double released_us = static_cast<double>(released_ns.load()) / 1e3;
    for (const auto& e : trace.find("traceEvents")->items) {
      const auto* cat = e.find("cat");
      if (!cat) continue;
      const double ts = std::stod(e.find("ts")->text);
      if (cat->text == "device") CHECK(ts >= released_us - checked.uncertainty_us - 0.002);
      if (cat->text == "bucket" && e.find("ph")->text == "b") CHECK(ts < released_us);
    }
    std::printf("timeline on the GPU: %zu device spans, clock within %.3f us\n", checked.spans,
                checked.uncertainty_us);
    std::filesystem::remove(file);
  }

  TEST_CASE("a stream under graph capture is refused with a clear error") {
    const test_stream owned;
    cudaStream_t stream = owned.stream;
    world_of_one world;
    device_model model(false);
    dtrain::DistributedDataParallel<device_model, policy> ddp(world.comm, world.control, model);
    GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    std::string message;
    try {
      ddp.set_stream(stream);
    } catch (const dtrain::config_error& e) {
      message = e.what();
    }
    cudaGraph_t graph = nullptr;
    GPU_CHECK(cudaStreamEndCapture(stream, &graph));
    if (graph) GPU_CHECK(cudaGraphDestroy(graph));
    CHECK(message.find("capture") != std::string::npos);
  }
}

namespace {

// --hang: the watchdog on a real hang. The compute stream is held by a host
// function for longer than the collective timeout, so the bucket's allreduce
// cannot start; wait() must throw timeout_error within the timeout plus one
// second, naming the allreduce. The process then ends at once (std::_Exit),
// as a training job does after a timeout: the held stream and the aborted
// communicator are not torn down.
int hang_case() {
  constexpr auto timeout = 2s;
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  world_of_one world(timeout);
  device_model model(false);
  dtrain::DistributedDataParallel<device_model, policy> ddp(world.comm, world.control, model,
                                                            {.always_reduce = true});
  ddp.set_stream(stream);
  GPU_CHECK(cudaLaunchHostFunc(
      stream, [](void*) { std::this_thread::sleep_for(std::chrono::hours(1)); }, nullptr));
  std::string message;
  bool timed_out = false;
  const auto start = std::chrono::steady_clock::now();
  try {
    for (std::size_t p = 0; p < model.sizes.size(); ++p) ddp.mark_ready(p);
    ddp.synchronize();
    ddp.wait();
    message = "wait() returned although the compute stream was held";
  } catch (const dtrain::timeout_error& e) {
    timed_out = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not a timeout_error: ") + e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("gpu.watchdog_hang: %.2f s (timeout %lld s): %s\n", seconds,
              static_cast<long long>(timeout.count()), message.c_str());
  const bool in_time = seconds < std::chrono::duration<double>(timeout).count() + 1.0;
  const bool named = message.find("allreduce") != std::string::npos;
  const bool ok = timed_out && in_time && named;
  if (ok) {
    std::printf("gpu.watchdog_hang: ok\n");
  } else {
    std::printf("gpu.watchdog_hang: FAILED (%s%s%s)\n", timed_out ? "" : "no timeout_error; ",
                in_time ? "" : "too late; ", named ? "" : "the collective is not named");
  }
  std::fflush(stdout);
  std::_Exit(ok ? 0 : 1);
}

#if DTRAIN_HAS_MPI()
// --mpi: MPI collectives on device buffers, staged through pinned host memory.
int mpi_case() {
  auto world = dtrain::mpi_communicator::world();
  const int rank = world.rank(), size = world.size();
  int devices = 0;
  GPU_CHECK(cudaGetDeviceCount(&devices));
  const int device = rank % devices;
  GPU_CHECK(cudaSetDevice(device));
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
      ++failures;
    }
  };
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr std::size_t n = (std::size_t{1} << 18) + 5;
  device_floats a(n), b(n * static_cast<std::size_t>(size));
  std::vector<float> mine(n);
  for (std::size_t i = 0; i < n; ++i)
    mine[i] = static_cast<float>(rank + 1) + static_cast<float>(i % 7);
  const float ranks_sum = static_cast<float>(size * (size + 1)) / 2.0f;

  std::size_t pool_after_first = 0;
  for (int round = 0; round < 20; ++round) {
    // allreduce sum and avg, ordered after the caller's stream: the input is
    // written there behind a 50 ms host function.
    pinned_floats source(n);
    std::memcpy(source.data, mine.data(), n * sizeof(float));
    GPU_CHECK(cudaMemsetAsync(a.data, 0, n * sizeof(float), stream));
    GPU_CHECK(cudaLaunchHostFunc(
        stream, [](void*) { std::this_thread::sleep_for(50ms); }, nullptr));
    GPU_CHECK(
        cudaMemcpyAsync(a.data, source.data, n * sizeof(float), cudaMemcpyHostToDevice, stream));
    const auto op = round % 2 == 0 ? dtrain::reduce_op::sum : dtrain::reduce_op::avg;
    world.allreduce(a.buffer(), a.buffer(), op, stream).wait(60s);
    std::vector<float> got = download(a.data, n);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const float sum = ranks_sum + static_cast<float>(size) * static_cast<float>(i % 7);
      wrong += got[i] != (op == dtrain::reduce_op::sum ? sum : sum / static_cast<float>(size));
    }
    check(wrong == 0, "allreduce " + std::string(dtrain::to_string(op)) +
                          " of device memory: " + std::to_string(wrong) + " wrong elements");

    // broadcast from the last rank; allgather; reduce_scatter.
    upload(a.data, mine);
    world.broadcast(a.buffer(), size - 1, stream).wait(60s);
    got = download(a.data, n);
    check(got[0] == static_cast<float>(size) &&
              got[n - 1] == static_cast<float>(size) + static_cast<float>((n - 1) % 7),
          "broadcast of device memory");

    upload(a.data, mine);
    world.allgather(a.buffer(), b.buffer(), stream).wait(60s);
    got = download(b.data, b.count);
    for (int r = 0; r < size; ++r)
      check(got[static_cast<std::size_t>(r) * n] == static_cast<float>(r + 1),
            "allgather block " + std::to_string(r));

    std::vector<float> blocks(b.count, static_cast<float>(rank + 1));
    upload(b.data, blocks);
    world.reduce_scatter(b.buffer(), a.buffer(), dtrain::reduce_op::sum, stream).wait(60s);
    got = download(a.data, n);
    check(got[0] == ranks_sum && got[n - 1] == ranks_sum, "reduce_scatter of device memory");

    if (round == 0) pool_after_first = world.staging_bytes();
  }
  // Reused, not grown: the first round allocated every block the later ones need.
  check(pool_after_first > 0, "device buffers were not staged through the pool");
  check(world.staging_bytes() == pool_after_first,
        "the staging pool grew from " + std::to_string(pool_after_first) + " to " +
            std::to_string(world.staging_bytes()) + " bytes over identical rounds");

  // float16 reduces on the host (dtrain's MPI_Op): staged too.
  {
    void* half = nullptr;
    GPU_CHECK(cudaMalloc(&half, 1000 * sizeof(dtrain::float16)));
    std::vector<dtrain::float16> h(1000, dtrain::float16(static_cast<float>(rank + 1)));
    GPU_CHECK(cudaMemcpy(half, h.data(), h.size() * sizeof(h[0]), cudaMemcpyHostToDevice));
    dtrain::device_span<dtrain::float16> span{static_cast<dtrain::float16*>(half), h.size(),
                                              device};
    dtrain::allreduce(world, span).wait(60s);
    GPU_CHECK(cudaMemcpy(h.data(), half, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
    check(static_cast<float>(h[999]) == ranks_sum, "float16 allreduce of device memory");
    GPU_CHECK(cudaFree(half));
  }
  GPU_CHECK(cudaStreamDestroy(stream));
  world.barrier().wait(60s);
  if (rank == 0) std::printf("gpu.mpi_device: %d ranks, %s\n", size, failures ? "FAILED" : "ok");
  return failures == 0 ? 0 : 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  try {
    if (!have_device()) return 77;
    if (mode == "--hang") return hang_case();
    if (mode == "--mpi") {
#if DTRAIN_HAS_MPI()
      return mpi_case();
#else
      std::printf("SKIPPED: dtrain was built without MPI (DTRAIN_WITH_MPI is OFF)\n");
      return 77;
#endif
    }
    doctest::Context context(argc, argv);
    return context.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain_gpu_tests: %s\n", e.what());
    return 1;
  }
}

#else  // !DTRAIN_HAS_NCCL()

int main() {
  std::printf("SKIPPED: dtrain was built without NCCL (DTRAIN_WITH_NCCL is OFF)\n");
  return 77;
}

#endif
