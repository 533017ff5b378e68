#pragma once
/// @file
/// dtrain::torch: LibTorch modules made data-parallel (optional: needs
/// LibTorch; dtrain.hpp never includes it).
///
/// ```cpp
/// #include <dtrain/torch.hpp>
/// auto ddp = dtrain::torch::DistributedDataParallel(ctx, model);
/// auto loss = loss_fn(ddp(x), y); loss.backward(); optimizer.step();
/// ```
///
/// - torch/ddp.hpp: DistributedDataParallel for torch::nn modules, with
///   autograd marking gradients ready and backward() completing each step;
///   torch/module_ddp.hpp holds all of it that does not depend on the
///   module's type (tensors, hooks, the final callback, over DDP's core), and
///   torch/compiled.hpp lets a compiled part hold that once (dtrain::torch);
/// - torch/checkpoint.hpp: a module, an optimizer and the sampler in a dtrain::checkpoint;
/// - torch/sampler.hpp: dtrain::distributed_sampler as a torch::data sampler;
/// - torch/tensor.hpp: tensors as dtrain buffers, .grad() as bucket views.
///
/// Not part of the single header: vendor this file and the torch/ folder
/// beside it.

#include <dtrain/torch/checkpoint.hpp>
#include <dtrain/torch/ddp.hpp>
#include <dtrain/torch/sampler.hpp>
#include <dtrain/torch/tensor.hpp>
