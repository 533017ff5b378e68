// dtrain's library, the NCCL part: context, run's agent and worker (and with
// them the store, the agent and the NCCL glue) for every standard policy on NCCL
// (DTRAIN_FOR_EACH_NCCL_POLICY, dtrain/runtime/compiled.hpp), compiled once here.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_SEPARATE_COMPILATION()
#error "src/nccl.cpp is part of dtrain's library: build it with DTRAIN_SEPARATE_COMPILATION=1"
#endif

DTRAIN_FOR_EACH_NCCL_POLICY(DTRAIN_DETAIL_DEFINE_COMPILED)
