// The one file of a program that holds dtrain's compiled part, when dtrain is
// used by hand in its compiled form (see CMakeLists.txt beside it).
#define DTRAIN_COMPILED_DEFINITIONS 1
#include <dtrain/dtrain.hpp>

DTRAIN_INSTANTIATE_COMPILED_POLICIES()
