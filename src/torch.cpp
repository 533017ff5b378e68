// dtrain::torch's compiled part: module_ddp<P> (everything of
// dtrain::torch::DistributedDataParallel but its thin, module-typed front) for
// every standard policy of this build's engines (dtrain/torch/compiled.hpp),
// compiled once against the program's own LibTorch. CMake's dtrain::torch
// builds it (a library in dtrain's own build tree; a source of the consuming
// target through an installed dtrain, since LibTorch's ABI is the user's).
// This file reads module_ddp's definitions (dtrain/torch/module_ddp-inl.hpp).
#define DTRAIN_TORCH_COMPILED_DEFINITIONS 1
#include <dtrain/torch.hpp>

#if !DTRAIN_TORCH_HAS_SEPARATE_COMPILATION()
#error \
    "src/torch.cpp is dtrain::torch's compiled part: build it with DTRAIN_TORCH_SEPARATE_COMPILATION=1"
#endif

DTRAIN_TORCH_INSTANTIATE_COMPILED_POLICIES()
