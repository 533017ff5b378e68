// Part of every dtrain library (cmake/dtrain_compiled.cmake), its one
// definitions TU: the non-template functions (dtrain.hpp's and
// dtrain/checkpoint.hpp's) that every other TU linked to the library only
// declares (DTRAIN_DETAIL_BODIES(), dtrain/config.hpp), compiled once here
// with the library's engines. The policy-dependent templates are
// instantiated in src/<engine>.cpp, the link check's symbols in src/link_check.cpp.
#define DTRAIN_COMPILED_DEFINITIONS 1
#if defined(__GNUC__) && !defined(__clang__)
// The functions defined here are in headers, and not inline in this one TU:
// GCC then warns about each coroutine frame or class that holds a lambda
// (-Wsubobject-linkage), a risk only for what more than one TU defines.
#pragma GCC diagnostic ignored "-Wsubobject-linkage"
#endif
#include <dtrain/dtrain.hpp>
// dtrain.hpp leaves the checkpoints out (compile time); the library has them.
#include <dtrain/checkpoint.hpp>

#if !DTRAIN_HAS_SEPARATE_COMPILATION()
#error "src/core.cpp is part of a dtrain library: build it with DTRAIN_SEPARATE_COMPILATION=1"
#endif
