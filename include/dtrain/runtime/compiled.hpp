#pragma once
/// @file
/// Separate compilation: the policy-dependent code of dtrain (context, run's
/// agent and worker, DistributedDataParallel's machinery, and with them the
/// store, the agent and the engine glue) compiled once in a library instead of
/// in every translation unit that calls dtrain::run. This header does nothing
/// unless DTRAIN_SEPARATE_COMPILATION=1 is defined.
///
/// With DTRAIN_SEPARATE_COMPILATION=1, every TU that includes this header (as
/// dtrain.hpp does) declares `extern template` for the standard policies below,
/// and the program must link their instantiations:
///   - CMake: dtrain::dtrain, dtrain::gloo, dtrain::mpi and dtrain::nccl are
///     that library (src/*.cpp, cmake/dtrain_compiled.cmake), built with the
///     target's engines, and define the macro for their users (the default;
///     dtrain::header_only, or DTRAIN_HEADER_ONLY=ON, is the header-only form);
///   - by hand (e.g. with the single header): compile every TU with
///     -DDTRAIN_SEPARATE_COMPILATION=1 and, in one of them, `#define
///     DTRAIN_COMPILED_DEFINITIONS 1` before the `#include` and put
///     `DTRAIN_INSTANTIATE_COMPILED_POLICIES()` after it.
/// In such a TU (and in a user's, with CMake) dtrain's non-template functions
/// are declared, not defined (DTRAIN_DETAIL_BODIES(), config.hpp): the
/// library's definitions TU (src/core.cpp; by hand, the one above) compiles
/// them once.
/// Policies not in the list (a backend of one's own) are compiled in the TU
/// that uses them, as in header-only mode. Every TU and the library must agree
/// on the engines (DTRAIN_WITH_GLOO/MPI/NCCL): dtrain/detail/link_check.hpp
/// makes a mismatch a link error that names it.

#include <dtrain/config.hpp>
#include <dtrain/ddp/basic_ddp.hpp>
#include <dtrain/detail/link_check.hpp>
#include <dtrain/policy.hpp>
#include <dtrain/runtime/context.hpp>
#include <dtrain/runtime/run.hpp>

// The policies compiled in the library, per engine: X(policy type) for each.
#define DTRAIN_DETAIL_POLICY(L, B, T) \
  ::dtrain::policy<::dtrain::launch::L, ::dtrain::backend::B, ::dtrain::topology::T>
#if DTRAIN_HAS_GLOO()
#define DTRAIN_FOR_EACH_GLOO_POLICY(X)                  \
  X(DTRAIN_DETAIL_POLICY(per_node, gloo, flat))         \
  X(DTRAIN_DETAIL_POLICY(per_node, gloo, hierarchical)) \
  X(DTRAIN_DETAIL_POLICY(per_process, gloo, flat))      \
  X(DTRAIN_DETAIL_POLICY(per_process, gloo, hierarchical))
#else
#define DTRAIN_FOR_EACH_GLOO_POLICY(X)
#endif
#if DTRAIN_HAS_MPI()  // launch::per_node cannot start MPI processes (policy.hpp)
#define DTRAIN_FOR_EACH_MPI_POLICY(X)             \
  X(DTRAIN_DETAIL_POLICY(per_process, mpi, flat)) \
  X(DTRAIN_DETAIL_POLICY(per_process, mpi, hierarchical))
#else
#define DTRAIN_FOR_EACH_MPI_POLICY(X)
#endif
#if DTRAIN_HAS_NCCL()
#define DTRAIN_FOR_EACH_NCCL_POLICY(X)                  \
  X(DTRAIN_DETAIL_POLICY(per_node, nccl, flat))         \
  X(DTRAIN_DETAIL_POLICY(per_node, nccl, hierarchical)) \
  X(DTRAIN_DETAIL_POLICY(per_process, nccl, flat))      \
  X(DTRAIN_DETAIL_POLICY(per_process, nccl, hierarchical))
#else
#define DTRAIN_FOR_EACH_NCCL_POLICY(X)
#endif
/// Every standard policy whose engine is compiled in.
#define DTRAIN_FOR_EACH_COMPILED_POLICY(X) \
  DTRAIN_FOR_EACH_GLOO_POLICY(X) DTRAIN_FOR_EACH_MPI_POLICY(X) DTRAIN_FOR_EACH_NCCL_POLICY(X)

/// The templates compiled once per policy, the one list of them: `EXTERN` is
/// `extern` (a declaration, in every user TU) or empty (the definition, in the
/// library). A class template here must define its heavy members out of the
/// class and not inline, or GCC still compiles them in every TU (basic_ddp is
/// DistributedDataParallel's Model-free part, which holds all its machinery;
/// detail::ddp_sharding its sharding part).
#define DTRAIN_DETAIL_COMPILED_TEMPLATES(EXTERN, ...)                \
  EXTERN template class ::dtrain::context<__VA_ARGS__>;              \
  EXTERN template class ::dtrain::basic_ddp<__VA_ARGS__>;            \
  EXTERN template class ::dtrain::detail::ddp_sharding<__VA_ARGS__>; \
  EXTERN template int ::dtrain::detail::run_process<__VA_ARGS__>(    \
      int, char**, ::dtrain::detail::training_function<__VA_ARGS__>, \
      const ::dtrain::run_options&);

#define DTRAIN_DETAIL_DECLARE_COMPILED(...) DTRAIN_DETAIL_COMPILED_TEMPLATES(extern, __VA_ARGS__)
#define DTRAIN_DETAIL_DEFINE_COMPILED(...) DTRAIN_DETAIL_COMPILED_TEMPLATES(, __VA_ARGS__)

/// Instantiates, in the one TU that writes it (at namespace scope, after the
/// `#include`), everything the other TUs declared `extern template`, and
/// defines the link check's symbols for this TU's engines (link_check.hpp).
/// Not beside a dtrain library: the link check refuses two definitions.
#define DTRAIN_INSTANTIATE_COMPILED_POLICIES()                                                   \
  static_assert(DTRAIN_DETAIL_BODIES(),                                                          \
                "DTRAIN_INSTANTIATE_COMPILED_POLICIES(): #define DTRAIN_COMPILED_DEFINITIONS 1 " \
                "before including dtrain in this file (and DTRAIN_SEPARATE_COMPILATION=1)");     \
  DTRAIN_FOR_EACH_COMPILED_POLICY(DTRAIN_DETAIL_DEFINE_COMPILED)                                 \
  DTRAIN_DETAIL_DEFINE_LINK_CHECK()

#if DTRAIN_HAS_SEPARATE_COMPILATION()
DTRAIN_FOR_EACH_COMPILED_POLICY(DTRAIN_DETAIL_DECLARE_COMPILED)
// An undefined reference to link_check::library_built_with_engines_<set> from
// this line: no dtrain library built for this TU's engines is linked (see
// dtrain/detail/link_check.hpp; with CMake, link the same dtrain target everywhere).
DTRAIN_DETAIL_REQUIRE_LINK_CHECK()
#endif
