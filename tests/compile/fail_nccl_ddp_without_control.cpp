// Must NOT compile: DistributedDataParallel's metadata is host data, which a
// device-only communicator (NCCL) cannot carry; built from a bare NCCL
// communicator it needs a control plane. The test
// compile.fail.nccl_ddp_without_control expects the static_assert's message.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_NCCL()
#error "this check needs NCCL (see tests/CMakeLists.txt)"
#endif

struct gpu_model {
  float* values = nullptr;
  float* grad = nullptr;
  std::vector<dtrain::parameter> parameters() {
    return {dtrain::device_param("w", values, grad, 16, 0)};
  }
};
using job = dtrain::policy<dtrain::launch::per_process, dtrain::backend::nccl>;

void make(dtrain::nccl_communicator& comm, gpu_model& model) {
  dtrain::DistributedDataParallel<gpu_model, job> ddp(comm, model);
}
