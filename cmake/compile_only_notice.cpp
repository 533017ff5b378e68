// Linked into a program that this build only checks to compile
// (DTRAIN_COMPILE_ONLY, cmake/dtrain_warnings.cmake): it was built without
// optimisation, so what it measures or trains says nothing. One line on stderr
// when it starts.
#include <cstdio>

namespace {
struct compile_only_notice {
  compile_only_notice() {
    std::fprintf(stderr,
                 "note: this program was built only to check that it compiles (unoptimised, "
                 "DTRAIN_COMPILE_ONLY=%s): do not use its figures; configure without that "
                 "option to build it for real\n",
                 DTRAIN_COMPILE_ONLY_KIND);
  }
};
const compile_only_notice notice;
}  // namespace
