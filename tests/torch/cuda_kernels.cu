// The one nvcc translation unit of dtrain_torch_ddp_nccl: dtrain's CUDA kernels
// (gradient compression of GPU buckets: float32 to bfloat16 and back) are
// compiled where a .cu file includes dtrain.hpp, as a LibTorch program on CUDA
// that compresses its gradients must have one (docs/libtorch.md).
#include <dtrain/dtrain.hpp>
