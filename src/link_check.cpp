// Part of every dtrain library (cmake/dtrain_compiled.cmake): the symbols of
// the link check for the library's engines (dtrain/detail/link_check.hpp), in
// an object of their own, so that a program pulls in no engine's code for them.
#include <dtrain/detail/link_check.hpp>

#if !(defined(DTRAIN_SEPARATE_COMPILATION) && (DTRAIN_SEPARATE_COMPILATION + 0))
#error "src/link_check.cpp is part of a dtrain library: build it with DTRAIN_SEPARATE_COMPILATION=1"
#endif

DTRAIN_DETAIL_DEFINE_LINK_CHECK()
