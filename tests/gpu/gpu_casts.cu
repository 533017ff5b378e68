// The nvcc unit of dtrain_gpu_tests and dtrain_nccl_ranks: including dtrain
// here registers its CUDA kernels (gradient compression of GPU buckets, the
// division of 16-bit averages) for the whole program, the way a user's own
// .cu file does.
#include <dtrain/dtrain.hpp>

// The program asks for this, so that the linker keeps this unit.
#include <string_view>

std::string_view dtrain_gpu_casts_unit();
std::string_view dtrain_gpu_casts_unit() { return dtrain::detail::compiled_by(); }
