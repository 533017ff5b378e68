// dtrain's library, the Gloo part: context, run's agent and worker (and with
// them the store, the agent and the Gloo glue) for every standard policy on Gloo
// (DTRAIN_FOR_EACH_GLOO_POLICY, dtrain/runtime/compiled.hpp), compiled once here.
#include <dtrain/dtrain.hpp>

#if !DTRAIN_HAS_SEPARATE_COMPILATION()
#error "src/gloo.cpp is part of dtrain's library: build it with DTRAIN_SEPARATE_COMPILATION=1"
#endif

DTRAIN_FOR_EACH_GLOO_POLICY(DTRAIN_DETAIL_DEFINE_COMPILED)
