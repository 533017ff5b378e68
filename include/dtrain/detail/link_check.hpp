#pragma once
/// @file
/// The link check of separate compilation: a program links dtrain's compiled
/// code for one set of engines, the one its translation units were compiled
/// with, or it does not link.
///
/// The engines change what dtrain's code does (with NCCL, CUDA is compiled in
/// and the MPI engine reaches device memory; with MPI, a failed rank ends the
/// MPI job), so a library built with other engines than a TU would hand that
/// TU other bodies than the ones it expects, and link order would pick one.
/// Two symbols make either mistake a link error that names it:
///   - every TU compiled in separate mode, and every object of the library,
///     refers to `library_built_with_engines_<set>`, which only the library of
///     that set defines: a missing or other library is an undefined reference;
///   - each library (and DTRAIN_INSTANTIATE_COMPILED_POLICIES()) defines
///     `every_unit_must_use_the_same_dtrain_engines`, not weak: objects of two
///     sets in one program (a TU on dtrain::gloo beside one on dtrain::dtrain)
///     are a multiple definition.
/// Header-only TUs take no part. Shared libraries that each link a static
/// dtrain escape the second check (the dynamic linker lets one interpose).

#include <dtrain/config.hpp>

#if DTRAIN_HAS_GLOO()
#define DTRAIN_DETAIL_LINK_GLOO _gloo
#else
#define DTRAIN_DETAIL_LINK_GLOO
#endif
#if DTRAIN_HAS_MPI()
#define DTRAIN_DETAIL_LINK_MPI _mpi
#else
#define DTRAIN_DETAIL_LINK_MPI
#endif
#if DTRAIN_HAS_NCCL()
#define DTRAIN_DETAIL_LINK_NCCL _nccl
#elif DTRAIN_HAS_CUDA()  // DTRAIN_WITH_CUDA=1 alone: the CUDA runtime without NCCL
#define DTRAIN_DETAIL_LINK_NCCL _cuda
#else
#define DTRAIN_DETAIL_LINK_NCCL
#endif
#if !DTRAIN_HAS_GLOO() && !DTRAIN_HAS_MPI() && !DTRAIN_HAS_CUDA()
#define DTRAIN_DETAIL_LINK_NONE _none
#else
#define DTRAIN_DETAIL_LINK_NONE
#endif

#define DTRAIN_DETAIL_LINK_PASTE(a, b, c, d, e) a##b##c##d##e
#define DTRAIN_DETAIL_LINK_NAME(a, b, c, d, e) DTRAIN_DETAIL_LINK_PASTE(a, b, c, d, e)
/// library_built_with_engines_gloo_mpi_nccl, ..._gloo, ..._none: this TU's engines.
#define DTRAIN_DETAIL_LINK_SYMBOL                                              \
  DTRAIN_DETAIL_LINK_NAME(library_built_with_engines, DTRAIN_DETAIL_LINK_GLOO, \
                          DTRAIN_DETAIL_LINK_MPI, DTRAIN_DETAIL_LINK_NCCL,     \
                          DTRAIN_DETAIL_LINK_NONE)

namespace dtrain::detail::link_check {
/// Defined by the compiled library built with this TU's engines, and only there.
extern const int DTRAIN_DETAIL_LINK_SYMBOL;
/// Defined, not weak, by each compiled library: two in one program do not link.
extern const int every_unit_must_use_the_same_dtrain_engines;
}  // namespace dtrain::detail::link_check

/// The library's half (src/link_check.cpp, DTRAIN_INSTANTIATE_COMPILED_POLICIES()),
/// at namespace scope, without a semicolon.
#define DTRAIN_DETAIL_DEFINE_LINK_CHECK()                           \
  namespace dtrain::detail::link_check {                            \
  extern const int DTRAIN_DETAIL_LINK_SYMBOL = 1;                   \
  extern const int every_unit_must_use_the_same_dtrain_engines = 1; \
  }

/// The TU's half: a reference that the linker must resolve, kept even when
/// nothing else in the TU uses dtrain (`used`). GCC and Clang only.
#if defined(__GNUC__)
#define DTRAIN_DETAIL_REQUIRE_LINK_CHECK()                                                 \
  namespace dtrain::detail::link_check {                                                   \
  namespace {                                                                              \
  [[gnu::used]] const int* const this_unit_needs_its_library = &DTRAIN_DETAIL_LINK_SYMBOL; \
  }                                                                                        \
  }
#else
#define DTRAIN_DETAIL_REQUIRE_LINK_CHECK()
#endif
