#pragma once
// The LibTorch CNN of dtrain_train_torch (train_torch.cpp) and of
// bench/torch_ddp: a synthetic image set and the model.

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace cnn {

constexpr std::int64_t side = 16;
constexpr std::int64_t classes = 4;

struct images {
  torch::Tensor x;  // [n, 1, side, side]
  torch::Tensor y;  // [n] class labels
};

// `count` images of the 4 patterns, from `seed` (the same on every rank).
inline images generate(std::size_t count, std::uint64_t seed) {
  torch::manual_seed(seed);
  const auto n = static_cast<std::int64_t>(count);
  const torch::Tensor y = torch::randint(0, classes, {n});
  const torch::Tensor phase = torch::randint(0, 4, {n, 1, 1}).to(torch::kFloat);
  const torch::Tensor r = torch::arange(side, torch::kFloat).view({side, 1}).expand({side, side});
  const torch::Tensor c = torch::arange(side, torch::kFloat).view({1, side}).expand({side, side});
  const torch::Tensor rows = torch::cos((r + phase) * (3.14159265f / 2));
  const torch::Tensor cols = torch::cos((c + phase) * (3.14159265f / 2));
  const torch::Tensor diag = torch::cos((r + c + phase) * (3.14159265f / 4));
  const torch::Tensor square =
      ((r - 7.5f).abs() < 3 + phase).logical_and((c - 7.5f).abs() < 3 + phase).to(torch::kFloat) *
          2 -
      1;
  const torch::Tensor patterns = torch::stack({rows, cols, diag, square}, 1);  // [n, 4, side, side]
  const torch::Tensor pick = y.view({n, 1, 1, 1}).expand({n, 1, side, side});
  torch::Tensor x = patterns.gather(1, pick) + 1.5 * torch::randn({n, 1, side, side});
  return {x, y};
}

// Four 3x3 convolution blocks (convolution, batch norm, ReLU), with a 2x2
// max-pool after the second and the fourth, then two fully connected layers:
// 16 parameter tensors and 12 buffers, as a small ResNet-style network has.
struct CnnImpl : torch::nn::Module {
  // channels: of the last two blocks (the first two have half); hidden: the
  // first fully connected layer's width.
  CnnImpl(std::int64_t channels, std::int64_t hidden) {
    const std::int64_t widths[] = {1, channels / 2, channels / 2, channels, channels};
    for (int i = 0; i < 4; ++i) {
      blocks[i] = register_module(
          "block" + std::to_string(i + 1),
          torch::nn::Sequential(
              torch::nn::Conv2d(
                  torch::nn::Conv2dOptions(widths[i], widths[i + 1], 3).padding(1).bias(false)),
              torch::nn::BatchNorm2d(widths[i + 1]), torch::nn::ReLU()));
    }
    fc1 = register_module("fc1", torch::nn::Linear(channels * (side / 4) * (side / 4), hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(blocks[1]->forward(blocks[0]->forward(x)), 2);
    x = torch::max_pool2d(blocks[3]->forward(blocks[2]->forward(x)), 2);
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Sequential blocks[4] = {nullptr, nullptr, nullptr, nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

inline double checksum(Cnn& model) {
  double sum = 0;
  for (const torch::Tensor& p : model->parameters())
    sum += p.to(torch::kDouble).sum().item<double>() * 1.000001;
  return sum;
}

}  // namespace cnn
