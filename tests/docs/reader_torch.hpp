// reader.hpp's names for the blocks that need LibTorch (<!-- compile: torch -->,
// <!-- compile: torch statements -->): a module, its data, an optimizer.
#pragma once

#include <dtrain/torch.hpp>

#include "reader.hpp"

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtrain_docs {

struct NetImpl : torch::nn::Module {
  NetImpl();
  torch::Tensor forward(torch::Tensor x);
};
TORCH_MODULE(Net);

inline constexpr std::size_t n = 4096;
inline constexpr std::size_t batch = 32;
/// The inputs and the labels of a batch of sample indices.
torch::Tensor x_of(const std::vector<std::size_t>& indices);
torch::Tensor y_of(const std::vector<std::size_t>& indices);

/// What a block of torch statements finds in scope.
struct torch_scope {
  dtrain::context<Policy>& ctx;
  Net& model;
  torch::optim::SGD& optimizer;
  dtrain::torch::distributed_sampler& sampler;
  torch::data::datasets::TensorDataset& dataset;
};

}  // namespace dtrain_docs
