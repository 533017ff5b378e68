// compile.strict_torch_<engine>: dtrain/torch.hpp under the warnings careful
// users turn on (-Wall -Wextra -Wpedantic -Wshadow -Wconversion
// -Wsign-conversion -Werror), dtrain's headers not as system headers and
// LibTorch's as system headers. Every member of the wrapper's front is
// instantiated, built as a user's file that links dtrain::torch (its compiled
// part, module_ddp's members, is built with the same warnings): over Gloo (CPU
// tensors), and over NCCL (CUDA tensors on the current stream) where NCCL is
// on; the sampler in LibTorch's data loader. Compiled only, never run.
#include <dtrain/torch.hpp>

#if DTRAIN_STRICT_ENGINE_NCCL
using strict_policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::nccl>;
#elif DTRAIN_STRICT_ENGINE_GLOO
using strict_policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
#else
#error "define DTRAIN_STRICT_ENGINE_GLOO or DTRAIN_STRICT_ENGINE_NCCL"
#endif

template class dtrain::torch::DistributedDataParallel<strict_policy, torch::nn::Linear>;

int strict_torch_step(dtrain::context<strict_policy>& ctx, torch::nn::Linear& model) {
  auto ddp = dtrain::torch::DistributedDataParallel(ctx, model, {.find_unused_parameters = true});
  {
    auto guard = ddp.no_sync();
    ddp(torch::ones({2, model->options.in_features()})).sum().backward();
  }
  ddp->forward(torch::ones({2, model->options.in_features()})).sum().backward();
  ddp.synchronize();
  ddp.zero_grad();
  dtrain::torch::distributed_sampler sampler(10, ctx.world());
  sampler.set_epoch(1);
  return static_cast<int>(sampler.next(4)->size() + ddp.buckets().size());
}

// The sampler in LibTorch's data loader (which calls reset() with no argument).
struct strict_dataset : torch::data::datasets::Dataset<strict_dataset> {
  torch::data::Example<> get(std::size_t i) override {
    return {torch::full({1}, static_cast<double>(i)), torch::zeros({1})};
  }
  torch::optional<std::size_t> size() const override { return 10; }
};

std::size_t strict_torch_loader(dtrain::context<strict_policy>& ctx) {
  dtrain::torch::distributed_sampler sampler(10, ctx.world());
  auto loader =
      torch::data::make_data_loader(strict_dataset{}.map(torch::data::transforms::Stack<>()),
                                    sampler, torch::data::DataLoaderOptions().batch_size(2));
  std::size_t batches = 0;
  for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);
    for (const auto& batch : *loader) batches += static_cast<std::size_t>(batch.data.size(0));
  }
  return batches;
}
