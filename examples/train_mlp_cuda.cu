// dtrain_train_mlp_cuda: the MLP classification demo of dtrain_train_mlp, on
// GPUs. Weights, gradients and activations live on the device; the linear
// layers are cuBLAS SGEMMs, bias, ReLU, softmax cross-entropy and SGD are small
// kernels; DistributedDataParallel averages the gradients over NCCL.
//
//   dtrain_train_mlp_cuda --epochs 5                   (the node agent: one worker per GPU)
//   DTRAIN_NPROC_PER_NODE=2 dtrain_train_mlp_cuda      (or --nproc-per-node 2)
//
// The data and the initial weights are those of the host demo (examples/mlp.hpp,
// same seed). Each rank trains on its shard of every epoch (distributed_sampler);
// during backward each layer's gradients are marked ready as soon as they are
// written, so NCCL averages them on its own stream while the compute stream goes
// on; ddp.synchronize(stream) makes the compute stream wait for the averages
// without blocking the host. Rank 0 prints loss, accuracy and throughput per
// epoch. At the end every rank compares a checksum of its weights with every
// other rank's: data parallelism must keep them bit-identical.
//
// Exit status: 77 with "SKIPPED: no CUDA device (...)" when there is no GPU;
// 0; 1 when the ranks' weights differ, the test accuracy is below
// --min-accuracy, or a rank fails; 2 for a bad flag or environment.

#include "mlp.hpp"
#include "train_program.hpp"

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::nccl>;
constexpr std::string_view program = "dtrain_train_mlp_cuda";

// cuBLAS reports a status, not a cudaError_t: the same kind of message as DTRAIN_CUDA_CHECK.
#define TRAIN_CUBLAS_CHECK(call)                                                              \
  do {                                                                                        \
    const cublasStatus_t train_cublas_status_ = (call);                                       \
    if (train_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                      \
      throw dtrain::backend_error(std::string("cuBLAS call `" #call "` failed: ") +           \
                                      cublasGetStatusName(train_cublas_status_) + ": " +      \
                                      cublasGetStatusString(train_cublas_status_) + " (at " + \
                                      __FILE__ + ":" + std::to_string(__LINE__) + ")",        \
                                  static_cast<int>(train_cublas_status_));                    \
    }                                                                                         \
  } while (false)

// A kernel launch fails at the launch (bad configuration) or later, at a sync.
#define TRAIN_LAUNCHED() DTRAIN_CUDA_CHECK(cudaGetLastError())

struct settings : mlp::settings {
  double min_accuracy = 0;  // on the test set after the last epoch, else exit 1
};

// This program's own flags; command_line describes and parses the shared ones.
constexpr const char* own_synopsis = " [--min-accuracy X]\n          [--nproc-per-node N]\n";
constexpr const char* own_options =
    "  --min-accuracy X    exit 1 unless the final test accuracy is at least X (0..1; 0)\n"
    "  --nproc-per-node N  workers the node agent starts, one GPU each (DTRAIN_NPROC_PER_NODE\n"
    "                      wins; default: the number of visible GPUs)\n";

settings parse_flags(int argc, char** argv) {
  const mlp::command_line line(program, own_synopsis, own_options);
  settings s;
  line.parse(argc, argv, s, [&](std::string_view flag, auto& value) {
    if (flag == "--min-accuracy") {
      s.min_accuracy = line.number<double>(flag, value(), 0.0);
    } else if (flag == "--nproc-per-node" || flag == "--nproc_per_node") {
      s.nproc_per_node = line.number<int>(flag, value(), 1);
    } else {
      return false;
    }
    return true;
  });
  return s;
}

// ---- kernels (row-major matrices: rows = samples) ---------------------------

constexpr int threads = 256;

unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + threads - 1) / threads); }

// x[i, :] = data[index[i], :], label[i] = labels[index[i]]: the batch, gathered on the device.
__global__ void gather_batch(const float* data, const int* labels, const int* index, int rows,
                             int features, float* x, int* label) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * features) return;
  const int i = t / features, f = t % features;
  const int source = index[i];
  x[t] = data[static_cast<std::size_t>(source) * features + f];
  if (f == 0) label[i] = labels[source];
}

// y[i, o] += b[o], then ReLU unless this is the last layer.
__global__ void add_bias(float* y, const float* b, int rows, int out, bool relu) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= rows * out) return;
  const float v = y[t] + b[t % out];
  y[t] = relu ? fmaxf(v, 0.0f) : v;
}

// One thread per sample: softmax over the logits, cross-entropy against the
// label, argmax. Adds the summed loss and the correct count to totals[0..1];
// writes d(mean loss)/d(logits) = (p - onehot) / rows to grad when it is not null.
__global__ void softmax_cross_entropy(const float* logits, const int* label, int rows, int classes,
                                      float* grad, double* totals) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const float* z = logits + static_cast<std::size_t>(i) * classes;
  float top = z[0];
  int best = 0;
  for (int c = 1; c < classes; ++c) {
    if (z[c] > top) {
      top = z[c];
      best = c;
    }
  }
  double total = 0;
  for (int c = 0; c < classes; ++c) total += exp(static_cast<double>(z[c] - top));
  const int y = label[i];
  atomicAdd(&totals[0], log(total) - static_cast<double>(z[y] - top));
  if (best == y) atomicAdd(&totals[1], 1.0);
  if (grad == nullptr) return;
  const float scale = 1.0f / static_cast<float>(rows);
  for (int c = 0; c < classes; ++c) {
    const float p = static_cast<float>(exp(static_cast<double>(z[c] - top)) / total);
    grad[static_cast<std::size_t>(i) * classes + c] = (p - (c == y ? 1.0f : 0.0f)) * scale;
  }
}

// db[o] = sum over samples of g[i, o] (written, not added: no zero_grad needed).
__global__ void bias_gradient(const float* g, int rows, int out, float* db) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float sum = 0;
  for (int i = 0; i < rows; ++i) sum += g[static_cast<std::size_t>(i) * out + o];
  db[o] = sum;
}

// Back through the previous layer's ReLU: the gradient passes where its output was > 0.
__global__ void relu_backward(float* g, const float* y, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < n && y[t] <= 0.0f) g[t] = 0.0f;
}

// SGD with momentum as torch.optim.SGD: v = momentum v + g; w -= lr v. With v
// starting at zero the first step's velocity is the gradient, as in torch.
__global__ void sgd_step(float* w, float* v, const float* g, int n, float lr, float momentum) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const float velocity = momentum * v[t] + g[t];
  v[t] = velocity;
  w[t] -= lr * velocity;
}

// ---- the model on the device ---------------------------------------------------
// Every copy and memset goes on the compute stream, the one DDP is given
// (.stream): DDP orders its work after that stream, and a non-blocking stream
// is not ordered after the legacy default stream (cudaMemcpy, cudaMemset).

template <class T>
T* device_alloc(std::size_t count, cudaStream_t stream) {
  void* p = nullptr;
  DTRAIN_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(count, 1) * sizeof(T)));
  DTRAIN_CUDA_CHECK(cudaMemsetAsync(p, 0, std::max<std::size_t>(count, 1) * sizeof(T), stream));
  return static_cast<T*>(p);
}

// Host to device on `stream`. From pageable memory: the host's values may
// change only once `stream` has been synchronised.
template <class T>
void upload(T* to, const std::vector<T>& from, cudaStream_t stream) {
  DTRAIN_CUDA_CHECK(
      cudaMemcpyAsync(to, from.data(), from.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
}

// Device memory, zeroed on `stream`, freed with its owner (cudaFree ignores null).
struct device_memory {
  std::vector<void*> blocks;
  cudaStream_t stream = nullptr;
  template <class T>
  T* alloc(std::size_t count) {
    T* p = device_alloc<T>(count, stream);
    blocks.push_back(p);
    return p;
  }
  explicit device_memory(cudaStream_t on) : stream(on) {}
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  ~device_memory() {
    for (void* p : blocks) (void)cudaFree(p);
  }
};

// y = x Wᵀ + b, W `out × in` row-major. The gradient pointers are the ones DDP
// may repoint into its buckets (param with a device_span): read them afresh every step.
struct device_linear {
  std::string name;
  int in = 0, out = 0;
  float* weight = nullptr;
  float* bias = nullptr;
  float* grad_weight = nullptr;
  float* grad_bias = nullptr;
  float* velocity_weight = nullptr;
  float* velocity_bias = nullptr;
};

class device_mlp {
 public:
  // The host demo's model (same widths, same seed), copied to `device` on
  // `stream`, where it computes too.
  device_mlp(const mlp::model& host, int device, std::size_t max_rows, cudaStream_t stream)
      : device_(device), memory_(stream), stream_(stream) {
    std::size_t widest = 0;
    for (const mlp::linear& l : host.layers()) {
      device_linear d{l.name, static_cast<int>(l.in), static_cast<int>(l.out)};
      d.weight = memory_.alloc<float>(l.weight.size());
      d.bias = memory_.alloc<float>(l.bias.size());
      d.grad_weight = memory_.alloc<float>(l.weight.size());
      d.grad_bias = memory_.alloc<float>(l.bias.size());
      d.velocity_weight = memory_.alloc<float>(l.weight.size());
      d.velocity_bias = memory_.alloc<float>(l.bias.size());
      upload(d.weight, l.weight, stream);
      upload(d.bias, l.bias, stream);
      widest = std::max({widest, l.in, l.out});
      layers_.push_back(std::move(d));
    }
    activations_.push_back(memory_.alloc<float>(max_rows * host.layers().front().in));
    for (const device_linear& l : layers_) {
      activations_.push_back(memory_.alloc<float>(max_rows * static_cast<std::size_t>(l.out)));
    }
    grad_a_ = memory_.alloc<float>(max_rows * widest);
    grad_b_ = memory_.alloc<float>(max_rows * widest);
    labels_ = memory_.alloc<int>(max_rows);
    TRAIN_CUBLAS_CHECK(cublasCreate(&blas_));
    TRAIN_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  }
  device_mlp(const device_mlp&) = delete;
  device_mlp& operator=(const device_mlp&) = delete;
  ~device_mlp() { (void)cublasDestroy(blas_); }

  // fc1.weight, fc1.bias, fc2.weight, ...: as the host model's parameters().
  [[nodiscard]] std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (device_linear& l : layers_) {
      const std::size_t weights = static_cast<std::size_t>(l.in) * l.out;
      out.push_back(dtrain::param(l.name + ".weight",
                                  dtrain::device_span<float>{l.weight, weights, device_},
                                  l.grad_weight));
      out.push_back(dtrain::param(l.name + ".bias",
                                  dtrain::device_span<float>{l.bias, std::size_t(l.out), device_},
                                  l.grad_bias));
    }
    return out;
  }
  [[nodiscard]] static std::array<std::size_t, 2> parameter_indices(std::size_t l) {
    return {2 * l, 2 * l + 1};
  }

  // The batch `index[0..rows)` of (data, labels), forward; adds loss and correct to totals.
  void forward_batch(const float* data, const int* labels, const int* index, int rows,
                     double* totals) {
    const int features = layers_.front().in;
    gather_batch<<<blocks_for(static_cast<std::size_t>(rows) * features), threads, 0, stream_>>>(
        data, labels, index, rows, features, activations_[0], labels_);
    TRAIN_LAUNCHED();
    forward(rows, labels_, totals, true);
  }

  // Rows already contiguous on the device (the test set): loss and accuracy only.
  void evaluate(const float* data, const int* labels, int rows, double* totals) {
    DTRAIN_CUDA_CHECK(cudaMemcpyAsync(
        activations_[0], data, static_cast<std::size_t>(rows) * layers_.front().in * sizeof(float),
        cudaMemcpyDeviceToDevice, stream_));
    forward(rows, labels, totals, false);
  }

  // Backpropagates the last forward_batch; `on_layer_ready(l)` once layer l's
  // gradients are enqueued (they are not written again this step).
  template <class OnLayerReady>
  void backward(OnLayerReady&& on_layer_ready) {
    float* grad_out = grad_a_;  // d loss / d (layer l's output), rows × out
    float* grad_in = grad_b_;
    const float one = 1.0f, zero = 0.0f;
    for (std::size_t l = layers_.size(); l-- > 0;) {
      device_linear& layer = layers_[l];
      const float* x = activations_[l];
      // Column-major views of row-major data: dWᵀ (in × out) = Xᵀ (in × rows) · G (rows × out).
      TRAIN_CUBLAS_CHECK(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, layer.in, layer.out, rows_,
                                     &one, x, layer.in, grad_out, layer.out, &zero,
                                     layer.grad_weight, layer.in));
      bias_gradient<<<blocks_for(static_cast<std::size_t>(layer.out)), threads, 0, stream_>>>(
          grad_out, rows_, layer.out, layer.grad_bias);
      TRAIN_LAUNCHED();
      on_layer_ready(l);
      if (l == 0) break;  // no gradient is needed for the input
      // dXᵀ (in × rows) = Wᵀ (in × out) · Gᵀ (out × rows), then the previous ReLU.
      TRAIN_CUBLAS_CHECK(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, layer.in, rows_, layer.out,
                                     &one, layer.weight, layer.in, grad_out, layer.out, &zero,
                                     grad_in, layer.in));
      const std::size_t n = static_cast<std::size_t>(rows_) * layer.in;
      relu_backward<<<blocks_for(n), threads, 0, stream_>>>(grad_in, x, static_cast<int>(n));
      TRAIN_LAUNCHED();
      std::swap(grad_out, grad_in);
    }
  }

  void sgd(float lr, float momentum) {
    for (device_linear& l : layers_) {
      const std::size_t nw = static_cast<std::size_t>(l.in) * l.out;
      sgd_step<<<blocks_for(nw), threads, 0, stream_>>>(l.weight, l.velocity_weight, l.grad_weight,
                                                        static_cast<int>(nw), lr, momentum);
      TRAIN_LAUNCHED();
      sgd_step<<<blocks_for(static_cast<std::size_t>(l.out)), threads, 0, stream_>>>(
          l.bias, l.velocity_bias, l.grad_bias, l.out, lr, momentum);
      TRAIN_LAUNCHED();
    }
  }

  // FNV-1a over every weight and bias in forward order, copied to the host
  // (the host demo's mlp::checksum over the same bytes).
  std::uint64_t checksum() {
    DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::uint64_t h = 0xcbf29ce484222325ULL;
    std::vector<float> host;
    auto mix = [&](const float* values, std::size_t count) {
      host.resize(count);
      DTRAIN_CUDA_CHECK(cudaMemcpyAsync(host.data(), values, count * sizeof(float),
                                        cudaMemcpyDeviceToHost, stream_));
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream_));
      const auto* bytes = reinterpret_cast<const unsigned char*>(host.data());
      for (std::size_t i = 0; i < count * sizeof(float); ++i) h = (h ^ bytes[i]) * 0x100000001b3ULL;
    };
    for (const device_linear& l : layers_) {
      mix(l.weight, static_cast<std::size_t>(l.in) * l.out);
      mix(l.bias, static_cast<std::size_t>(l.out));
    }
    return h;
  }

 private:
  void forward(int rows, const int* labels, double* totals, bool keep_gradient) {
    rows_ = rows;
    const float one = 1.0f, zero = 0.0f;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const device_linear& layer = layers_[l];
      // Yᵀ (out × rows) = W (out × in) · Xᵀ (in × rows): W row-major is Wᵀ column-major.
      TRAIN_CUBLAS_CHECK(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, layer.out, rows, layer.in,
                                     &one, layer.weight, layer.in, activations_[l], layer.in, &zero,
                                     activations_[l + 1], layer.out));
      const std::size_t n = static_cast<std::size_t>(rows) * layer.out;
      add_bias<<<blocks_for(n), threads, 0, stream_>>>(activations_[l + 1], layer.bias, rows,
                                                       layer.out, l + 1 < layers_.size());
      TRAIN_LAUNCHED();
    }
    softmax_cross_entropy<<<blocks_for(static_cast<std::size_t>(rows)), threads, 0, stream_>>>(
        activations_.back(), labels, rows, layers_.back().out, keep_gradient ? grad_a_ : nullptr,
        totals);
    TRAIN_LAUNCHED();
  }

  int device_;
  device_memory memory_;  // declared before what points into it
  std::vector<device_linear> layers_;
  std::vector<float*> activations_;  // [0] the input, [l + 1] layer l's output
  float* grad_a_ = nullptr;
  float* grad_b_ = nullptr;
  int* labels_ = nullptr;
  int rows_ = 0;
  cublasHandle_t blas_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// A non-blocking CUDA stream, destroyed with its owner.
class owned_stream {
 public:
  owned_stream() { DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;
  ~owned_stream() { (void)cudaStreamDestroy(stream_); }
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A dataset uploaded once: samples row-major, labels as int.
struct device_dataset {
  float* x = nullptr;
  int* y = nullptr;
  int rows = 0;
  // On `memory`'s stream.
  device_dataset(const mlp::dataset& d, device_memory& memory)
      : x(memory.alloc<float>(d.x.size())),
        y(memory.alloc<int>(d.y.size())),
        rows(static_cast<int>(d.size())) {
    upload(x, d.x, memory.stream);
    upload(y, d.y, memory.stream);
  }
};

int train(dtrain::context<Policy>& ctx, const settings& s) {
  const int device = ctx.device();
  DTRAIN_CUDA_CHECK(cudaSetDevice(device));
  const mlp::problem problem{.features = s.features, .classes = s.classes, .seed = s.seed};
  const mlp::dataset train_host = mlp::dataset::generate(problem, s.samples, 0);
  const mlp::dataset test_host = mlp::dataset::generate(problem, s.samples / 4, 1);

  const owned_stream compute;  // outlives the memory, the model and DDP, which use it
  const cudaStream_t stream = compute.get();
  device_memory memory(stream);
  const device_dataset train_set(train_host, memory);
  const device_dataset test_set(test_host, memory);
  // Every rank builds the same model; DDP broadcasts rank 0's weights anyway.
  const mlp::model initial(s.widths(), s.seed);
  device_mlp model(initial, device, std::max(s.batch_size, test_host.size()), stream);
  // The memsets and uploads above are on `stream`, which DDP's broadcast of
  // rank 0's weights is ordered after (.stream); waited for here, so that a
  // failed copy is reported as one, before DDP starts.
  DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
  dtrain::DistributedDataParallel<device_mlp, Policy> ddp(ctx, model, {.stream = stream});
  dtrain::distributed_sampler sampler(train_host.size(), ctx.world(), {.seed = s.seed});

  // This epoch's shard, as device indices; totals: summed loss, correct, samples.
  int* index = memory.alloc<int>(sampler.size());
  double* totals = memory.alloc<double>(3);
  std::vector<int> host_index(sampler.size());

  if (ctx.is_main()) {
    std::printf(
        "training a %s MLP on %zu samples: %d ranks (GPUs) x batch %zu (global batch %zu), "
        "lr %g, momentum %g, %zu gradient buckets, backend %s\n",
        s.widths_text().c_str(), train_host.size(), ctx.size(), s.batch_size,
        s.batch_size * static_cast<std::size_t>(ctx.size()), s.lr, s.momentum, ddp.buckets().size(),
        Policy::backend_type::name.data());
    std::fflush(stdout);
  }

  double accuracy = 0;
  for (std::size_t epoch = 0; epoch < s.epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    sampler.set_epoch(epoch);
    const std::span<const std::size_t> shard = sampler.indices();
    std::ranges::transform(shard, host_index.begin(),
                           [](std::size_t i) { return static_cast<int>(i); });
    // The previous epoch ended with the stream synchronised: host_index may be reused.
    DTRAIN_CUDA_CHECK(cudaMemcpyAsync(index, host_index.data(), shard.size() * sizeof(int),
                                      cudaMemcpyHostToDevice, stream));
    DTRAIN_CUDA_CHECK(cudaMemsetAsync(totals, 0, 3 * sizeof(double), stream));
    // The batches of sampler.batches(), as offsets into the shard on the device.
    for (std::size_t first = 0; first < shard.size(); first += s.batch_size) {
      const int rows = static_cast<int>(std::min(s.batch_size, shard.size() - first));
      model.forward_batch(train_set.x, train_set.y, index + first, rows, totals);
      model.backward(
          [&](std::size_t layer) { ddp.mark_ready(device_mlp::parameter_indices(layer)); });
      ddp.synchronize(stream);  // the stream waits for the means; the host does not
      model.sgd(static_cast<float>(s.lr), static_cast<float>(s.momentum));
    }
    const double samples = static_cast<double>(shard.size());
    DTRAIN_CUDA_CHECK(
        cudaMemcpyAsync(totals + 2, &samples, sizeof(double), cudaMemcpyHostToDevice, stream));
    const dtrain::buffer sums{totals, 3, dtrain::dtype::float64, dtrain::memory::device};
    ctx.communicator().allreduce(sums, sums, dtrain::reduce_op::sum, stream).wait();
    std::array<double, 3> all{};
    DTRAIN_CUDA_CHECK(
        cudaMemcpyAsync(all.data(), totals, sizeof all, cudaMemcpyDeviceToHost, stream));
    DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;

    if (ctx.is_main()) {
      DTRAIN_CUDA_CHECK(cudaMemsetAsync(totals, 0, 3 * sizeof(double), stream));
      model.evaluate(test_set.x, test_set.y, test_set.rows, totals);
      std::array<double, 2> test{};
      DTRAIN_CUDA_CHECK(
          cudaMemcpyAsync(test.data(), totals, sizeof test, cudaMemcpyDeviceToHost, stream));
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
      accuracy = test[1] / static_cast<double>(test_set.rows);
      std::printf(
          "epoch %zu/%zu  loss %.4f  train accuracy %5.1f%%  test accuracy %5.1f%%  %.0f "
          "samples/s (all ranks)\n",
          epoch + 1, s.epochs, all[0] / all[2], 100.0 * all[1] / all[2], 100.0 * accuracy,
          all[2] / elapsed.count());
      std::fflush(stdout);
    }
  }

  // Same data-parallel steps from the same start: the weights must be bit-identical. The
  // checksums are host metadata: they go over the context's control plane, not through NCCL.
  const std::int64_t mine = std::bit_cast<std::int64_t>(model.checksum());
  std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.size()));
  ctx.control_plane().allgather(std::span<const std::int64_t>(&mine, 1), all);

  if (!mlp::weights_agree(program, ctx.is_main(), all)) return 1;
  if (ctx.is_main() && accuracy < s.min_accuracy) {
    std::fprintf(stderr, "%s: test accuracy %.1f%% is below --min-accuracy %.1f%%\n",
                 program.data(), 100.0 * accuracy, 100.0 * s.min_accuracy);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Visibly skipped, never silently green: CTest reads exit 77 and this line.
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n", found != cudaSuccess
                                                      ? cudaGetErrorString(found)
                                                      : "cudaGetDeviceCount found 0 devices");
    return 77;
  }
  const settings s = parse_flags(argc, argv);
  dtrain::run_options options;
  if (s.nproc_per_node) options.agent.nproc_per_node = s.nproc_per_node;
  return dtrain::run<Policy>(
      argc, argv, [&](dtrain::context<Policy>& ctx) { return train(ctx, s); }, options);
}
