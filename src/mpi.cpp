// dtrain's library, the MPI part: context, run's agent and worker (and with
// them the store, the agent and the MPI glue) for every standard policy on MPI
// (DTRAIN_FOR_EACH_MPI_POLICY, dtrain/runtime/compiled.hpp), compiled once here.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_SEPARATE_COMPILATION()
#error "src/mpi.cpp is part of dtrain's library: build it with DTRAIN_SEPARATE_COMPILATION=1"
#endif

DTRAIN_FOR_EACH_MPI_POLICY(DTRAIN_DETAIL_DEFINE_COMPILED)
