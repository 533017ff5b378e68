// Must NOT compile: Gloo moves host memory only, and a device_span says at
// compile time that the data is on the GPU. The test
// compile.fail.device_span_to_gloo expects the static_assert's message.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_GLOO()
#error "this check needs Gloo (see tests/CMakeLists.txt)"
#endif

void broadcast_weights(dtrain::gloo_communicator& comm, dtrain::device_span<float> weights) {
  dtrain::broadcast(comm, weights, 0).wait();
}
