// nccl.hpp through nvcc: CUDA users include dtrain from .cu files. Instantiates
// the templates (the store constructor, launch(), the typed collectives) so
// nvcc's front end sees them; runs host code only, no GPU needed.
#include <dtrain/backend/nccl/nccl.hpp>
#include <dtrain/rendezvous/client.hpp>

#include <cstdio>

[[maybe_unused]] static dtrain::nccl_communicator make(dtrain::store_client& store) {
  return dtrain::nccl_communicator(store, 0, 1, 0, {.init_timeout = std::chrono::seconds(5)});
}

[[maybe_unused]] static dtrain::work reduce(dtrain::nccl_communicator& comm,
                                            dtrain::device_span<float> data, cudaStream_t stream) {
  comm.stream_wait(stream);
  return dtrain::allreduce(comm, data, dtrain::reduce_op::avg);
}

__global__ void dtrain_nccl_nvcc_kernel(int* out) { *out = DTRAIN_HAS_NCCL(); }

int main() {
  static_assert(dtrain::communicator<dtrain::nccl_communicator>);
  const bool mapped = dtrain::detail::nccl_type(dtrain::dtype::bfloat16) == ncclBfloat16 &&
                      dtrain::detail::nccl_op(dtrain::reduce_op::avg, 2) == ncclAvg;
  std::printf("dtrain's %s backend under nvcc (NCCL %d.%d.%d): types %s\n",
              dtrain::nccl_communicator::name.data(), NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH,
              mapped ? "map" : "DO NOT MAP");
  return mapped ? 0 : 1;
}
