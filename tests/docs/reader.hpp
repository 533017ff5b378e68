// The names that the pages' C++ blocks leave to the reader (docs.blocks,
// tests/scripts/docs_blocks.cmake): the model, the data, the helpers a
// training loop has. Only their shape matters: the blocks are compiled, never
// linked or run, so a function here is declared and not defined. A block that
// is whole declarations sees these by `using namespace dtrain_docs`; a block of
// statements (<!-- compile: statements -->) is the body of a member function
// of a struct derived from host_scope, so its members are in scope too.
#pragma once

#include <dtrain/dtrain.hpp>

#include "mlp.hpp"  // examples/: the demo's model and optimizer (docs/checkpoints.md)

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace dtrain_docs {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

/// A model as the pages write one: parameters(), a forward pass on a batch of
/// sample indices, a backward pass that calls back with each finished layer.
struct Model {
  std::vector<dtrain::parameter> parameters();
  void forward(std::span<const std::size_t> batch);
  void backward(const std::function<void(std::size_t layer)>& on_layer_ready);
  /// The names of layer `layer`'s parameters ("fc2.w", "fc2.b").
  std::vector<std::string> layer_parameters(std::size_t layer);
};

inline constexpr std::size_t n_samples = 4096;
inline constexpr std::size_t global_batch = 64;
inline constexpr std::size_t batch_size = 32;
inline constexpr int epochs = 5;

// The reader's own training steps, called with anything.
struct reader_step {
  template <class... Args>
  void operator()(Args&&... args) const;
};
inline constexpr reader_step forward, backward, backward_fc1, backward_fc2, sgd_step, zero,
    accumulate_gradient;
void compute_something_else();
std::vector<float> compute_gradients();
std::vector<std::size_t> shuffled(std::size_t n);
std::vector<std::vector<std::size_t>> batches_of(const std::vector<std::size_t>& order,
                                                 std::size_t batch);

/// What a block of statements finds in scope: a rank's context, its model and
/// DDP, the data and the values that the page's text has introduced.
struct host_scope {
  dtrain::context<Policy>& ctx;
  Model& model;
  Model& m;  // docs/ddp.md's name for it
  dtrain::DistributedDataParallel<Model, Policy>& ddp;
  dtrain::distributed_sampler& sampler;
  std::vector<std::size_t>& indices;  // this rank's batch
  std::vector<float>& grads;
  std::vector<std::vector<float>>& data;
  // a collective's buffers
  std::vector<float>& in;
  std::vector<float>& out;
  std::vector<float>& weights;
  std::vector<float>& mine;
  std::vector<float>& all;
  std::string& secret;  // the store's token
  std::string& bytes;
  std::vector<std::string>& keys;
  std::size_t world_size;
  // examples/train_mlp.cpp's settings and data (docs/checkpoints.md)
  std::vector<std::size_t> widths;
  std::uint64_t seed;
  double lr, momentum;
  const mlp::dataset& train_set;
};

}  // namespace dtrain_docs
