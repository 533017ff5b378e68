// Must NOT compile: NCCL moves GPU memory only, and a std::span says at
// compile time that the data is on the host. The test
// compile.fail.host_span_to_nccl expects the static_assert's message.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_NCCL()
#error "this check needs NCCL (see tests/CMakeLists.txt)"
#endif

void reduce_on_host(dtrain::nccl_communicator& comm, std::span<float> gradients) {
  dtrain::allreduce(comm, gradients, dtrain::reduce_op::avg).wait();
}
