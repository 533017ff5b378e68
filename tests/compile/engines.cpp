// Compiled once per combination of the enabled engines: dtrain.hpp must build
// with any subset of DTRAIN_WITH_MPI / _GLOO / _NCCL, and each switch must
// reach its DTRAIN_HAS_*() macro.
#include <dtrain/dtrain.hpp>

static_assert(DTRAIN_HAS_MPI() == DTRAIN_TEST_EXPECT_MPI, "DTRAIN_WITH_MPI did not set DTRAIN_HAS_MPI()");
static_assert(DTRAIN_HAS_GLOO() == DTRAIN_TEST_EXPECT_GLOO, "DTRAIN_WITH_GLOO did not set DTRAIN_HAS_GLOO()");
static_assert(DTRAIN_HAS_NCCL() == DTRAIN_TEST_EXPECT_NCCL, "DTRAIN_WITH_NCCL did not set DTRAIN_HAS_NCCL()");
