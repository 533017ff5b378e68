// Must NOT compile: MPI built without CUDA reduces host memory only, and a
// device_span says at compile time that the data lives on the GPU. The test
// compile.fail.device_on_host_backend expects the static_assert's message.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_MPI() || DTRAIN_HAS_CUDA()
#error "this check needs MPI without CUDA (see tests/CMakeLists.txt)"
#endif

void reduce_gradients(dtrain::mpi_communicator& comm, dtrain::device_span<float> gradients) {
  dtrain::allreduce(comm, gradients, dtrain::reduce_op::avg).wait();
}
