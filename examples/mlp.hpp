#pragma once
/// @file
/// A small multilayer perceptron for classification on the host, written
/// out by hand so that every step of data-parallel training is visible:
/// a synthetic dataset, linear and ReLU layers, softmax cross-entropy, a
/// backward pass that reports each layer's finished gradients (where a
/// DistributedDataParallel caller marks them ready), and SGD with momentum
/// or Adam.
///
/// Everything is determined by seeds: the data, the initial weights, and so
/// the whole training run. Used by examples/train_mlp.cpp and by the
/// equivalence tests in tests/training/.

#include <dtrain/dtrain.hpp>

// The matrix products go through a BLAS when the build found one (CMake
// target dtrain_example_blas: OpenBLAS, Debian's libopenblas-dev), as a real
// trainer's do; otherwise through the plain loops of mlp::gemm.
#if MLP_CBLAS
#include <cblas.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mlp {

/// splitmix64: a tiny generator whose output is the same everywhere (the
/// std distributions are implementation-defined, so they are not used).
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1), from the top 53 bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  /// Approximately standard normal (Irwin-Hall: the sum of 12 uniforms,
  /// minus 6); plain arithmetic, so identical on every machine.
  double normal() {
    double sum = 0;
    for (int i = 0; i < 12; ++i) sum += uniform();
    return sum - 6.0;
  }
  /// Uniform in [0, n).
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next() % n); }

 private:
  std::uint64_t state_;
};

/// Row-major C = alpha · op(A) · op(B) + beta · C, op(X) = X or Xᵀ: C is
/// m × n, op(A) m × k, op(B) k × n; lda, ldb, ldc are the row lengths as stored.
inline void gemm(bool transpose_a, bool transpose_b, std::size_t m, std::size_t n, std::size_t k,
                 float alpha, const float* a, std::size_t lda, const float* b, std::size_t ldb,
                 float beta, float* c, std::size_t ldc) {
#if MLP_CBLAS
  const auto i = [](std::size_t v) { return static_cast<blasint>(v); };
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, i(m), i(n), i(k), alpha, a, i(lda), b,
              i(ldb), beta, c, i(ldc));
#else
  for (std::size_t r = 0; r < m; ++r) {
    for (std::size_t col = 0; col < n; ++col) {
      float sum = 0;
      for (std::size_t x = 0; x < k; ++x) {
        const float av = transpose_a ? a[x * lda + r] : a[r * lda + x];
        const float bv = transpose_b ? b[col * ldb + x] : b[x * ldb + col];
        sum += av * bv;
      }
      float& out = c[r * ldc + col];
      out = alpha * sum + (beta == 0.0f ? 0.0f : beta * out);
    }
  }
#endif
}

/// What the build multiplies matrices with, for the demo's first line.
[[nodiscard]] inline const char* gemm_engine() noexcept {
#if MLP_CBLAS
  return "BLAS (cblas_sgemm)";
#else
  return "plain loops (no BLAS found at build time)";
#endif
}

/// Flushes denormal floats to zero on the calling thread (x86: the FTZ and
/// DAZ bits), as CPU trainers usually do (TensorFlow by default, PyTorch with
/// torch.set_flush_denormal(True)): once a model fits, the softmax of the
/// wrong classes underflows into denormals, and every product with one costs
/// a microcode assist — epochs get slower as the loss falls. The values lost
/// are below 1.2e-38. Returns whether this CPU could.
inline bool flush_denormals() noexcept {
#if defined(__x86_64__) || defined(_M_X64)
  constexpr unsigned flush_to_zero = 0x8000, denormals_are_zero = 0x0040;  // MXCSR bits
  _mm_setcsr(_mm_getcsr() | flush_to_zero | denormals_are_zero);
  return true;
#else
  return false;
#endif
}

/// What a synthetic classification problem looks like.
struct problem {
  std::size_t features = 16;
  std::size_t classes = 4;
  /// Gaussian blobs per class: with 2 or more, a class is not one convex
  /// region, so a linear model cannot separate the classes but an MLP can.
  std::size_t blobs_per_class = 3;
  /// Standard deviation of each blob around its centre (centres lie in [-1, 1]^features).
  double spread = 0.8;
  std::uint64_t seed = 1;
};

/// Samples (row-major, features per row) and their labels.
struct dataset {
  std::size_t features = 0;
  std::size_t classes = 0;
  std::vector<float> x;
  std::vector<int> y;

  [[nodiscard]] std::size_t size() const noexcept { return y.size(); }
  [[nodiscard]] std::span<const float> sample(std::size_t i) const {
    return std::span(x).subspan(i * features, features);
  }

  /// `n` samples of problem `p`. The blob centres depend on p.seed only, so
  /// a training set and a test set (another `stream`) come from one distribution.
  static dataset generate(const problem& p, std::size_t n, std::uint64_t stream = 0) {
    const std::size_t blobs = p.classes * p.blobs_per_class;
    rng centre_rng(p.seed);
    std::vector<double> centres(blobs * p.features);
    for (double& c : centres) c = centre_rng.uniform(-1.0, 1.0);

    dataset d{p.features, p.classes, std::vector<float>(n * p.features), std::vector<int>(n)};
    rng sample_rng(p.seed ^ (0x5851f42d4c957f2dULL * (stream + 1)));
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t blob = sample_rng.below(blobs);
      d.y[i] = static_cast<int>(blob % p.classes);
      for (std::size_t f = 0; f < p.features; ++f) {
        d.x[i * p.features + f] =
            static_cast<float>(centres[blob * p.features + f] + p.spread * sample_rng.normal());
      }
    }
    return d;
  }
};

/// y = x Wᵀ + b. Weights are `out × in`, row-major. The values are reached
/// through `weight_values` and `bias_values`, the gradients through
/// `grad_weight` and `grad_bias` only: DistributedDataParallel may repoint the
/// gradients into its buckets (dtrain::param's bucket view), and with ZeRO
/// stage 3 (sharding::parameters) the values into its gathered buckets (null
/// between). `weight` and `bias` hold the initial values (and, below stage 3,
/// the values: the pointers point there).
struct linear {
  std::string name;
  std::size_t in = 0, out = 0;
  std::vector<float> weight, bias;
  float* weight_values = nullptr;
  float* bias_values = nullptr;
  float* grad_weight = nullptr;
  float* grad_bias = nullptr;

  linear(std::string layer_name, std::size_t inputs, std::size_t outputs, rng& init)
      : name(std::move(layer_name)),
        in(inputs),
        out(outputs),
        weight(inputs * outputs),
        bias(outputs, 0.0f),
        own_grad_weight_(weight.size(), 0.0f),
        own_grad_bias_(bias.size(), 0.0f) {
    weight_values = weight.data();
    bias_values = bias.data();
    grad_weight = own_grad_weight_.data();
    grad_bias = own_grad_bias_.data();
    // He (Kaiming) uniform initialisation, suited to ReLU.
    const double bound = std::sqrt(6.0 / static_cast<double>(in));
    for (float& w : weight) w = static_cast<float>(init.uniform(-bound, bound));
  }
  // The value and gradient pointers point into this object's own storage: no copies.
  linear(const linear&) = delete;
  linear& operator=(const linear&) = delete;
  linear(linear&&) noexcept = default;  // vectors keep their storage when moved
  linear& operator=(linear&&) noexcept = default;

 private:
  // Where the gradients live until DistributedDataParallel repoints them.
  std::vector<float> own_grad_weight_, own_grad_bias_;
};

/// Loss and correct predictions over a batch.
struct batch_result {
  double loss = 0;  ///< mean cross-entropy over the batch
  std::size_t correct = 0;
  std::size_t count = 0;
};

/// What forward() and backward() hold around each layer by default: nothing.
/// With ZeRO stage 3, `[&](std::size_t l) { return ddp.gather(...layer l...); }`.
struct hold_nothing {
  int operator()(std::size_t /*layer*/) const noexcept { return 0; }
};

/// An MLP: linear → ReLU → ... → linear, then softmax cross-entropy.
class model {
 public:
  /// `widths` = {features, hidden..., classes}; weights from `seed`.
  model(std::vector<std::size_t> widths, std::uint64_t seed) {
    rng init(seed);
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      layers_.emplace_back("fc" + std::to_string(l + 1), widths[l], widths[l + 1], init);
    }
  }
  model(const model&) = delete;
  model& operator=(const model&) = delete;

  [[nodiscard]] std::vector<linear>& layers() noexcept { return layers_; }
  [[nodiscard]] const std::vector<linear>& layers() const noexcept { return layers_; }

  /// Every parameter in forward order ("fc1.weight", "fc1.bias", "fc2.weight", ...),
  /// values and gradients as pointers DDP may repoint (gradients: bucket
  /// views; values: at ZeRO stage 3): what DistributedDataParallel reduces.
  [[nodiscard]] std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (linear& l : layers_) {
      out.push_back(
          dtrain::param(l.name + ".weight", l.weight_values, l.in * l.out, l.grad_weight));
      out.push_back(dtrain::param(l.name + ".bias", l.bias_values, l.out, l.grad_bias));
    }
    return out;
  }
  /// ZeRO stage 3: frees the initial values, which DDP has copied (its shard)
  /// at construction; the model holds no values from here on.
  void drop_initial_values() {
    for (linear& l : layers_) {
      l.weight = {};
      l.bias = {};
    }
  }
  /// Positions of layer `l`'s parameters in parameters().
  [[nodiscard]] static std::array<std::size_t, 2> parameter_indices(std::size_t l) {
    return {2 * l, 2 * l + 1};
  }

  /// Runs the batch `indices` of `data` forward, keeping what backward() needs;
  /// `hold(l)`'s result lives while layer l computes (ZeRO stage 3's gather).
  template <class Hold = hold_nothing>
  batch_result forward(const dataset& data, std::span<const std::size_t> indices,
                       Hold&& hold = {}) {
    const std::size_t n = indices.size();
    labels_.resize(n);
    activations_.resize(layers_.size() + 1);
    auto& input = activations_[0];
    input.resize(n * data.features);
    for (std::size_t i = 0; i < n; ++i) {
      std::ranges::copy(data.sample(indices[i]),
                        input.begin() + static_cast<std::ptrdiff_t>(i * data.features));
      labels_[i] = data.y[indices[i]];
    }
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      [[maybe_unused]] const auto held = hold(l);  // lives while layer l computes
      const linear& layer = layers_[l];
      const auto& x = activations_[l];
      auto& y = activations_[l + 1];
      y.resize(n * layer.out);
      for (std::size_t i = 0; i < n; ++i)
        std::copy_n(layer.bias_values, layer.out,
                    y.begin() + static_cast<std::ptrdiff_t>(i * layer.out));
      // y = x Wᵀ + b
      gemm(false, true, n, layer.out, layer.in, 1.0f, x.data(), layer.in, layer.weight_values,
           layer.in, 1.0f, y.data(), layer.out);
      if (l + 1 < layers_.size()) {
        for (float& v : y) v = std::max(v, 0.0f);
      }
    }
    return softmax_cross_entropy();
  }

  /// Backpropagates the last forward() and ADDS the gradient of
  /// `loss_sum / mean_over` to the gradients (loss_sum: the batch's summed
  /// cross-entropy). With mean_over = the batch size (0 means that) the
  /// gradient is the batch mean; gradient accumulation over micro-batches
  /// passes the size of the whole step's batch instead.
  ///
  /// Layers are done last to first; `on_layer_ready(l)` is called as soon as
  /// layer l's gradients are final, and they are not touched after it;
  /// `hold(l)`'s result lives while layer l computes (ZeRO stage 3's gather).
  template <class OnLayerReady, class Hold = hold_nothing>
  void backward(OnLayerReady&& on_layer_ready, std::size_t mean_over = 0, Hold&& hold = {}) {
    const std::size_t n = labels_.size();
    const float scale = 1.0f / static_cast<float>(mean_over ? mean_over : n);
    std::vector<float> grad_out(probabilities_.size());  // d loss / d logits
    const std::size_t classes = layers_.back().out;
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t c = 0; c < classes; ++c) {
        const float target = static_cast<int>(c) == labels_[i] ? 1.0f : 0.0f;
        grad_out[i * classes + c] = (probabilities_[i * classes + c] - target) * scale;
      }
    }
    for (std::size_t l = layers_.size(); l-- > 0;) {
      [[maybe_unused]] const auto held = hold(l);  // lives while layer l computes
      linear& layer = layers_[l];
      const auto& x = activations_[l];
      for (std::size_t o = 0; o < layer.out; ++o) {
        double bias_sum = 0;
        for (std::size_t i = 0; i < n; ++i) bias_sum += grad_out[i * layer.out + o];
        layer.grad_bias[o] += static_cast<float>(bias_sum);
      }
      // grad W += grad_outᵀ x
      gemm(true, false, layer.out, layer.in, n, 1.0f, grad_out.data(), layer.out, x.data(),
           layer.in, 1.0f, layer.grad_weight, layer.in);
      on_layer_ready(l);
      if (l == 0) break;  // no gradient is needed for the input
      // Through the weights (grad_in = grad_out W), then through the previous layer's ReLU (x > 0).
      std::vector<float> grad_in(n * layer.in);
      gemm(false, false, n, layer.in, layer.out, 1.0f, grad_out.data(), layer.out,
           layer.weight_values, layer.in, 0.0f, grad_in.data(), layer.in);
      for (std::size_t j = 0; j < grad_in.size(); ++j) {
        if (x[j] <= 0.0f) grad_in[j] = 0.0f;
      }
      grad_out = std::move(grad_in);
    }
  }

  /// Sets every gradient to zero (through the current gradient pointers).
  void zero_grad() {
    for (linear& l : layers_) {
      std::fill_n(l.grad_weight, l.in * l.out, 0.0f);
      std::fill_n(l.grad_bias, l.out, 0.0f);
    }
  }

  /// Accuracy (fraction correct) and mean loss over the whole of `data`.
  template <class Hold = hold_nothing>
  batch_result evaluate(const dataset& data, Hold&& hold = {}) {
    std::vector<std::size_t> all(data.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    return forward(data, all, hold);
  }

 private:
  batch_result softmax_cross_entropy() {
    const auto& logits = activations_.back();
    const std::size_t n = labels_.size(), classes = layers_.back().out;
    probabilities_.resize(logits.size());
    batch_result r{0.0, 0, n};
    for (std::size_t i = 0; i < n; ++i) {
      const float* z = &logits[i * classes];
      float* p = &probabilities_[i * classes];
      const float top = *std::max_element(z, z + classes);
      double total = 0;
      for (std::size_t c = 0; c < classes; ++c) total += std::exp(static_cast<double>(z[c] - top));
      for (std::size_t c = 0; c < classes; ++c) {
        p[c] = static_cast<float>(std::exp(static_cast<double>(z[c] - top)) / total);
      }
      const auto label = static_cast<std::size_t>(labels_[i]);
      r.loss += std::log(total) - static_cast<double>(z[label] - top);
      if (static_cast<std::size_t>(std::max_element(z, z + classes) - z) == label) ++r.correct;
    }
    if (n > 0) r.loss /= static_cast<double>(n);
    return r;
  }

  std::vector<linear> layers_;
  std::vector<std::vector<float>> activations_;  // [0] the input, [l + 1] layer l's output
  std::vector<float> probabilities_;
  std::vector<int> labels_;
};

/// An elementwise optimizer, as torch.optim's: SGD with (optional)
/// momentum (v = momentum · v + g; w -= lr · v, the first step's v being g)
/// or Adam (torch's defaults: betas 0.9, 0.999, eps 1e-8, bias-corrected).
/// Its state is flat arrays indexed by element: a piece of values with its
/// gradients at state offset o uses elements [o, o + n). step(model) takes
/// every weight and bias whole, in the model's order; with
/// DistributedDataParallel the pieces are the rank's shard (ddp.shard(),
/// optimizer_step(): with sharding, the state is the shard's size).
class optimizer {
 public:
  enum class kind : std::uint8_t { sgd, adam };

  optimizer(kind k, double learning_rate, double momentum = 0.0)
      : kind_(k), lr_(learning_rate), momentum_(momentum) {}
  /// SGD (with momentum when it is above 0).
  optimizer(double learning_rate, double momentum = 0.0)
      : optimizer(kind::sgd, learning_rate, momentum) {}

  /// Counts a step: before its updates (Adam's bias correction, SGD's first velocity).
  void begin_step() { ++steps_; }
  /// values[k] -= ... from gradients[k], state at `offset` + k.
  void update(std::span<float> values, std::span<const float> gradients, std::size_t offset) {
    const std::size_t n = values.size();
    if (kind_ == kind::sgd && momentum_ == 0.0) {
      for (std::size_t i = 0; i < n; ++i) values[i] -= static_cast<float>(lr_) * gradients[i];
      return;
    }
    if (first_.size() < offset + n) {
      first_.resize(offset + n);
      if (kind_ == kind::adam) second_.resize(offset + n);
    }
    float* v = first_.data() + offset;
    const auto lr = static_cast<float>(lr_);
    if (kind_ == kind::sgd) {
      const auto momentum = static_cast<float>(momentum_);
      if (steps_ == 1) {  // torch: the first step's velocity is the gradient
        for (std::size_t i = 0; i < n; ++i) {
          v[i] = gradients[i];
          values[i] -= lr * v[i];
        }
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {  // one pass over w, v and g
        v[i] = momentum * v[i] + gradients[i];
        values[i] -= lr * v[i];
      }
      return;
    }
    float* s = second_.data() + offset;
    const double t = static_cast<double>(steps_);
    const auto step_size = static_cast<float>(lr_ / (1.0 - std::pow(0.9, t)));
    const auto root_correction = static_cast<float>(std::sqrt(1.0 - std::pow(0.999, t)));
    for (std::size_t i = 0; i < n; ++i) {
      const float g = gradients[i];
      v[i] = 0.9f * v[i] + 0.1f * g;
      s[i] = 0.999f * s[i] + 0.001f * g * g;
      values[i] -= step_size * v[i] / (std::sqrt(s[i]) / root_correction + 1e-8f);
    }
  }
  /// One step over every weight and bias of `m`, whole (one process, or
  /// DistributedDataParallel without sharding).
  void step(model& m) {
    begin_step();
    std::size_t offset = 0;
    for (linear& l : m.layers()) {
      update({l.weight_values, l.in * l.out}, {l.grad_weight, l.in * l.out}, offset);
      offset += l.in * l.out;
      update({l.bias_values, l.out}, {l.grad_bias, l.out}, offset);
      offset += l.out;
    }
  }

  /// Sizes the state for `elements` values (a sharded DDP's shard_elements()),
  /// so that a checkpoint can hold its arrays before the first step.
  void reserve(std::size_t elements) {
    if (kind_ == kind::sgd && momentum_ == 0.0) return;
    first_.resize(elements);
    if (kind_ == kind::adam) second_.resize(elements);
  }
  /// The state's arrays and step count, for a checkpoint that holds them as
  /// they are (dtrain::checkpoint::add_sharded, add).
  [[nodiscard]] std::vector<float>& first_moment() noexcept { return first_; }
  [[nodiscard]] std::vector<float>& second_moment() noexcept { return second_; }
  [[nodiscard]] std::uint64_t& step_count() noexcept { return steps_; }

  /// Bytes of state it holds now (SGD: a velocity per element; Adam: two moments).
  [[nodiscard]] std::size_t state_bytes() const noexcept {
    return (first_.size() + second_.size()) * sizeof(float);
  }
  /// The state as bytes for a checkpoint: the step count, then each array's
  /// length (u64) and its floats.
  [[nodiscard]] std::string state() const {
    std::string out(reinterpret_cast<const char*>(&steps_), sizeof steps_);
    for (const std::vector<float>* a : {&first_, &second_}) {
      const std::uint64_t n = a->size();
      out.append(reinterpret_cast<const char*>(&n), sizeof n);
      out.append(reinterpret_cast<const char*>(a->data()), a->size() * sizeof(float));
    }
    return out;
  }
  /// Takes back what state() gave; throws std::invalid_argument on bytes it did not give.
  void load_state(std::string_view bytes) {
    std::uint64_t steps = 0;
    if (bytes.size() < sizeof steps) throw std::invalid_argument("optimizer state: cut short");
    std::memcpy(&steps, bytes.data(), sizeof steps);
    bytes.remove_prefix(sizeof steps);
    std::array<std::vector<float>, 2> arrays;
    for (std::vector<float>& a : arrays) {
      std::uint64_t n = 0;
      if (bytes.size() < sizeof n)
        throw std::invalid_argument("optimizer state: a length is cut short");
      std::memcpy(&n, bytes.data(), sizeof n);
      bytes.remove_prefix(sizeof n);
      if (n > bytes.size() / sizeof(float))
        throw std::invalid_argument("optimizer state: values are cut short");
      a.resize(static_cast<std::size_t>(n));
      std::memcpy(a.data(), bytes.data(), a.size() * sizeof(float));
      bytes.remove_prefix(a.size() * sizeof(float));
    }
    if (!bytes.empty()) throw std::invalid_argument("optimizer state: bytes after the end");
    steps_ = steps;
    first_ = std::move(arrays[0]);
    second_ = std::move(arrays[1]);
  }

 private:
  kind kind_;
  double lr_, momentum_;
  std::uint64_t steps_ = 0;
  std::vector<float> first_, second_;  // SGD: velocity; Adam: the two moments
};

/// The name the examples and tests used first.
using sgd = optimizer;

/// FNV-1a over the bytes of every weight and bias, in forward order: equal
/// checksums mean (barring a 2⁻⁶⁴ accident) bit-identical models.
inline std::uint64_t checksum(const model& m) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&](const float* values, std::size_t count) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(values);
    for (std::size_t i = 0; i < count * sizeof(float); ++i) {
      h = (h ^ bytes[i]) * 0x100000001b3ULL;
    }
  };
  for (const linear& l : m.layers()) {  // the values (stage 3: held by a gather)
    mix(l.weight_values, l.in * l.out);
    mix(l.bias_values, l.out);
  }
  return h;
}

}  // namespace mlp
