// A serial training loop made data-parallel: linear regression, y = w . x + b,
// trained by SGD on every rank's share of each batch (docs/getting-started.md).
//   build/examples/dtrain_quickstart --nproc-per-node 2
#include <dtrain/dtrain.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

constexpr std::size_t features = 8;

// The model: its values, and its gradients where DistributedDataParallel puts them.
struct model {
  std::vector<float> w = std::vector<float>(features, 0.0f), b = {0.0f};
  float* grad_w = nullptr;  // DDP points these into its buckets
  float* grad_b = nullptr;
  std::vector<dtrain::parameter> parameters() {  // the same names and sizes on every rank
    return {dtrain::param("w", w, grad_w), dtrain::param("b", b, grad_b)};
  }
};

// The data: the same on every rank (one seed); each rank reads only its share.
struct dataset {
  std::vector<std::vector<float>> x;
  std::vector<float> y;
};
dataset make_data(std::size_t n) {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  dataset d;
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<float> x(features);
    float y = 0.5f;  // the true b; the true w[j] is 0.1 * (j + 1)
    for (std::size_t j = 0; j < features; ++j) {
      x[j] = normal(rng);
      y += 0.1f * static_cast<float>(j + 1) * x[j];
    }
    d.x.push_back(x);
    d.y.push_back(y);
  }
  return d;
}

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

int main(int argc, char** argv) {
  return dtrain::run<Policy>(argc, argv, [](dtrain::context<Policy>& ctx) {
    const dataset data = make_data(4096);
    model m;
    dtrain::DistributedDataParallel<model, Policy> ddp(
        ctx, m);  // every rank starts from rank 0's values
    // The global batch stays 64 whatever the number of ranks: each rank takes its part.
    const std::size_t batch = 64 / static_cast<std::size_t>(ctx.size());
    dtrain::distributed_sampler sampler(data.y.size(), ctx.world(), {.seed = 1});
    for (int epoch = 1; epoch <= 5; ++epoch) {
      sampler.set_epoch(static_cast<std::uint64_t>(epoch));
      double loss = 0;
      std::size_t seen = 0;
      for (auto indices : sampler.batches(batch)) {
        ddp.zero_grad();
        for (std::size_t i : indices) {  // forward and backward over this rank's samples
          float error = m.b[0] - data.y[i];
          for (std::size_t j = 0; j < features; ++j) error += m.w[j] * data.x[i][j];
          loss += static_cast<double>(error * error);
          ++seen;
          for (std::size_t j = 0; j < features; ++j)
            m.grad_w[j] += 2.0f * error * data.x[i][j] / static_cast<float>(indices.size());
          m.grad_b[0] += 2.0f * error / static_cast<float>(indices.size());
        }
        ddp.mark_all_ready();  // every gradient of this step is final
        ddp.synchronize();     // now each is the mean over the ranks: the whole batch's
        for (std::size_t j = 0; j < features; ++j) m.w[j] -= 0.05f * m.grad_w[j];
        m.b[0] -= 0.05f * m.grad_b[0];
      }
      if (ctx.is_main())
        std::printf("epoch %d: mean squared error %.6f on rank 0's share\n", epoch,
                    loss / static_cast<double>(seen));
    }
    bool learned = std::fabs(m.b[0] - 0.5f) < 0.01f;
    for (std::size_t j = 0; j < features; ++j)
      learned = learned && std::fabs(m.w[j] - 0.1f * static_cast<float>(j + 1)) < 0.01f;
    if (ctx.is_main())
      std::printf("%d ranks: w[0] %.3f ... w[7] %.3f, b %.3f (truth 0.1, 0.8, 0.5): %s\n",
                  ctx.size(), m.w[0], m.w[features - 1], m.b[0],
                  learned ? "learned" : "NOT learned");
    return learned ? 0 : 1;
  });
}
