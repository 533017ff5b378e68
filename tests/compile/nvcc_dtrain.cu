// dtrain.hpp must get through nvcc: users include it from their .cu files.
// Built twice, against include/ and against single_include/.
#include <dtrain/dtrain.hpp>

#include <cstdio>

#if DTRAIN_HAS_NCCL()
// DistributedDataParallel for NCCL with every member, the compression kernels included.
namespace {
struct nvcc_model {
  float* values = nullptr;
  float* grad = nullptr;
  std::vector<dtrain::parameter> parameters() {
    return {dtrain::device_param("w", values, grad, 16, 0)};
  }
};
}  // namespace
template class dtrain::DistributedDataParallel<
    nvcc_model, dtrain::policy<dtrain::launch::per_node, dtrain::backend::nccl>>;
// topology::hierarchical on NCCL streams: the group with every member.
template class dtrain::DistributedDataParallel<
    nvcc_model, dtrain::policy<dtrain::launch::per_node, dtrain::backend::nccl,
                               dtrain::topology::hierarchical>>;
template class dtrain::topology::hierarchical::group<dtrain::nccl_communicator>;
#endif

__global__ void dtrain_nvcc_kernel(int* out) { *out = DTRAIN_HAS_NCCL(); }

int main() {
  // No kernel launch: the test machines have the toolkit but no GPU.
  std::printf("dtrain %s under nvcc (mpi=%d gloo=%d nccl=%d)\n", DTRAIN_VERSION_STRING,
              DTRAIN_HAS_MPI(), DTRAIN_HAS_GLOO(), DTRAIN_HAS_NCCL());
  return 0;
}
