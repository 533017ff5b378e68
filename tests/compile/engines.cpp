// Compiled once per combination of the enabled engines: dtrain.hpp must build
// with any subset of DTRAIN_WITH_MPI / _GLOO / _NCCL, and each switch must
// reach its DTRAIN_HAS_*() macro.
#include <dtrain/dtrain.hpp>

static_assert(DTRAIN_HAS_MPI() == DTRAIN_TEST_EXPECT_MPI,
              "DTRAIN_WITH_MPI did not set DTRAIN_HAS_MPI()");
static_assert(DTRAIN_HAS_GLOO() == DTRAIN_TEST_EXPECT_GLOO,
              "DTRAIN_WITH_GLOO did not set DTRAIN_HAS_GLOO()");
static_assert(DTRAIN_HAS_NCCL() == DTRAIN_TEST_EXPECT_NCCL,
              "DTRAIN_WITH_NCCL did not set DTRAIN_HAS_NCCL()");

// DistributedDataParallel with every member instantiated, for each backend compiled in.
namespace {
struct engines_model {
  std::vector<float> w{1, 2};
  float* grad = nullptr;
  std::vector<float> running{0};
  std::vector<dtrain::parameter> parameters() { return {dtrain::param("w", w, grad)}; }
  std::vector<dtrain::parameter> buffers() { return {dtrain::model_buffer("running", running)}; }
};
}  // namespace
// Both topologies, and the hierarchical group with every member, for each.
#if DTRAIN_HAS_MPI()
template class dtrain::DistributedDataParallel<
    engines_model, dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>>;
template class dtrain::DistributedDataParallel<
    engines_model, dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi,
                                  dtrain::topology::hierarchical>>;
template class dtrain::topology::hierarchical::group<dtrain::mpi_communicator>;
#endif
#if DTRAIN_HAS_GLOO()
template class dtrain::DistributedDataParallel<
    engines_model, dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>>;
template class dtrain::DistributedDataParallel<
    engines_model, dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo,
                                  dtrain::topology::hierarchical>>;
template class dtrain::topology::hierarchical::group<dtrain::gloo_communicator>;
#endif
#if DTRAIN_HAS_NCCL()
template class dtrain::DistributedDataParallel<
    engines_model, dtrain::policy<dtrain::launch::per_node, dtrain::backend::nccl>>;
template class dtrain::DistributedDataParallel<
    engines_model, dtrain::policy<dtrain::launch::per_node, dtrain::backend::nccl,
                                  dtrain::topology::hierarchical>>;
template class dtrain::topology::hierarchical::group<dtrain::nccl_communicator>;
#endif
