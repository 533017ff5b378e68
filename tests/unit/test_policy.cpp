// The policy slots resolve at compile time; these are the combinations this build has.
#include "support.hpp"

#include <type_traits>

TEST_CASE("policy: launch modes, backends and the flat topology resolve at compile time") {
  using dtrain::launch::per_node;
  using dtrain::launch::per_process;
  static_assert(per_process::mode == dtrain::launch_mode::per_process);
  static_assert(per_node::mode == dtrain::launch_mode::per_node);
  static_assert(dtrain::topology::flat::name == "flat");
#if DTRAIN_HAS_MPI()
  using job = dtrain::policy<per_process, dtrain::backend::mpi>;
  static_assert(std::is_same_v<job::communicator_type, dtrain::mpi_communicator>);
  static_assert(std::is_same_v<job::topology_type, dtrain::topology::flat>);
  static_assert(job::reaches_device_memory == (DTRAIN_HAS_CUDA() != 0));
#endif
#if DTRAIN_HAS_GLOO()
  using cpu_job = dtrain::policy<per_node, dtrain::backend::gloo, dtrain::topology::flat>;
  static_assert(std::is_same_v<cpu_job::communicator_type, dtrain::gloo_communicator>);
  static_assert(!cpu_job::reaches_device_memory);
#endif
#if DTRAIN_HAS_NCCL()
  using gpu_job = dtrain::policy<per_node, dtrain::backend::nccl>;
  static_assert(std::is_same_v<gpu_job::communicator_type, dtrain::nccl_communicator>);
  static_assert(gpu_job::reaches_device_memory);
#endif
  CHECK(dtrain::backend::mpi::available == (DTRAIN_HAS_MPI() != 0));
  CHECK(dtrain::backend::gloo::available == (DTRAIN_HAS_GLOO() != 0));
  CHECK(dtrain::backend::nccl::available == (DTRAIN_HAS_NCCL() != 0));
}
