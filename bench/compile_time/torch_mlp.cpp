// A LibTorch user's training translation unit (issue 30): their own MLP, an
// SGD loop, and dtrain::run with dtrain::torch::DistributedDataParallel, the
// file whose compile time bench/compile_time.sh measures with and without
// dtrain. With -DDTRAIN_BENCH_WITHOUT_DTRAIN=1 it is the same loop on one
// process, as the user had it before (the baseline of dtrain's cost).
#include <torch/torch.h>

#if !DTRAIN_BENCH_WITHOUT_DTRAIN
#include <dtrain/torch.hpp>
#endif

#include <cstdio>

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t in, std::int64_t hidden, std::int64_t out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return fc3(x);
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

#if !DTRAIN_BENCH_WITHOUT_DTRAIN
using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

int train(dtrain::context<Policy>& ctx) {
#else
int train() {
#endif
  torch::set_num_threads(1);
  torch::manual_seed(1);
  Mlp model(64, 128, 8);
#if !DTRAIN_BENCH_WITHOUT_DTRAIN
  auto net = dtrain::torch::DistributedDataParallel(ctx, model);
#else
  auto& net = model;
#endif
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const torch::Tensor x = torch::randn({256, 64});
  const torch::Tensor y = torch::randint(0, 8, {256});
  for (int step = 0; step < 100; ++step) {
    const torch::Tensor loss = torch::nn::functional::cross_entropy(net(x), y);
    loss.backward();
    optimizer.step();
#if !DTRAIN_BENCH_WITHOUT_DTRAIN
    net.zero_grad();
#else
    optimizer.zero_grad();
#endif
    if (step % 10 == 0) std::printf("step %d: loss %.4f\n", step, loss.item<double>());
  }
  return 0;
}

int main(int argc, char** argv) {
#if !DTRAIN_BENCH_WITHOUT_DTRAIN
  return dtrain::run<Policy>(argc, argv, train);
#else
  (void)argc;
  (void)argv;
  return train();
#endif
}
