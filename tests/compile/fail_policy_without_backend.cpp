// Must NOT compile: this translation unit is built without Gloo, so a policy
// naming backend::gloo is a static_assert that says so. The test
// compile.fail.policy_without_backend expects the message.
#include <dtrain/dtrain.hpp>

#if DTRAIN_HAS_GLOO()
#error "this check needs a build without Gloo (see tests/CMakeLists.txt)"
#endif

using job =
    dtrain::policy<dtrain::launch::per_process, dtrain::backend::gloo, dtrain::topology::flat>;
job::communicator_type* unused = nullptr;
