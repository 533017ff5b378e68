// The one file of a program that holds dtrain's compiled part, when dtrain is
// used by hand in its compiled form (every file built with
// -DDTRAIN_SEPARATE_COMPILATION=1; consumer.single_header builds one so).
#define DTRAIN_COMPILED_DEFINITIONS 1
#include <dtrain/dtrain.hpp>

DTRAIN_INSTANTIATE_COMPILED_POLICIES()
