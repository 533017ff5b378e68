#pragma once
/// @file
/// Version and the engine switches. The engines are opt-in: the CMake target
/// dtrain::dtrain defines DTRAIN_WITH_MPI / DTRAIN_WITH_GLOO / DTRAIN_WITH_NCCL
/// for the engines it found; a user of the single header defines them before
/// including it. Test them with the function-like macros below, so that a typo
/// is a compile error rather than a silently false `#if`.

#define DTRAIN_VERSION_MAJOR 0
#define DTRAIN_VERSION_MINOR 1
#define DTRAIN_VERSION_PATCH 0
#define DTRAIN_VERSION_STRING "0.1.0"

#if defined(DTRAIN_WITH_MPI) && (DTRAIN_WITH_MPI + 0)
#define DTRAIN_HAS_MPI() 1
// dtrain calls MPI's C API only. Without these, a plain g++ build against Open
// MPI 4 or MPICH also needs their deprecated C++ bindings (libmpi_cxx). A
// program that wants those bindings includes <mpi.h> before dtrain.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#else
#define DTRAIN_HAS_MPI() 0
#endif

#if defined(DTRAIN_WITH_GLOO) && (DTRAIN_WITH_GLOO + 0)
#define DTRAIN_HAS_GLOO() 1
#else
#define DTRAIN_HAS_GLOO() 0
#endif

#if defined(DTRAIN_WITH_NCCL) && (DTRAIN_WITH_NCCL + 0)
#define DTRAIN_HAS_NCCL() 1
#else
#define DTRAIN_HAS_NCCL() 0
#endif

// CUDA's runtime comes with NCCL (dtrain::dtrain links CUDA::cudart with it),
// or on its own with DTRAIN_WITH_CUDA=1.
#if DTRAIN_HAS_NCCL() || (defined(DTRAIN_WITH_CUDA) && (DTRAIN_WITH_CUDA + 0))
#define DTRAIN_HAS_CUDA() 1
#else
#define DTRAIN_HAS_CUDA() 0
#endif

// Separate compilation (dtrain/runtime/compiled.hpp has the whole story). With
// DTRAIN_SEPARATE_COMPILATION=1 a TU uses dtrain's compiled library: its
// non-template functions (the store, the agent, the engines' glue, world
// discovery...) are only declared here, and one TU of the library defines
// them, with DTRAIN_COMPILED_DEFINITIONS=1 (src/core.cpp; by hand, the file
// that writes DTRAIN_INSTANTIATE_COMPILED_POLICIES()). Header-only, every TU
// has them, inline. A header's bodies are in its -inl.hpp, which the header
// includes on its last line when DTRAIN_DETAIL_BODIES() (fmt's -inl.h).
#if defined(DTRAIN_SEPARATE_COMPILATION) && (DTRAIN_SEPARATE_COMPILATION + 0)
#define DTRAIN_HAS_SEPARATE_COMPILATION() 1
#else
#define DTRAIN_HAS_SEPARATE_COMPILATION() 0
#endif
#if DTRAIN_HAS_SEPARATE_COMPILATION() && defined(DTRAIN_COMPILED_DEFINITIONS) && \
    (DTRAIN_COMPILED_DEFINITIONS + 0)
#define DTRAIN_DETAIL_BODIES() 1  // the library's definitions TU
#define DTRAIN_DETAIL_INLINE
#elif DTRAIN_HAS_SEPARATE_COMPILATION()
#define DTRAIN_DETAIL_BODIES() 0  // a TU that links the library: declarations only
#define DTRAIN_DETAIL_INLINE
#else
#define DTRAIN_DETAIL_BODIES() 1  // header-only
#define DTRAIN_DETAIL_INLINE inline
#endif
