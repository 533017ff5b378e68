#pragma once
/// @file
/// dtrain::torch's compiled part: with DTRAIN_TORCH_SEPARATE_COMPILATION=1
/// (which CMake's dtrain::torch defines), every translation unit declares
/// `extern template class dtrain::torch::module_ddp<P>;` for the standard
/// policies (dtrain/runtime/compiled.hpp's list; NCCL's only with LibTorch's CUDA
/// headers), and src/torch.cpp, compiled once against the program's own
/// LibTorch, holds them. A LibTorch user's training file then compiles
/// dtrain::torch::DistributedDataParallel's thin front only. Without the
/// macro this header does nothing, and every TU compiles the whole wrapper.
///
/// By hand: compile every TU with -DDTRAIN_TORCH_SEPARATE_COMPILATION=1 and,
/// in one of them, define DTRAIN_TORCH_COMPILED_DEFINITIONS=1 before the `#include` and
/// put `DTRAIN_TORCH_INSTANTIATE_COMPILED_POLICIES()` after it (as
/// src/torch.cpp does). Every TU and that one must agree on
/// the engines: a torch part built for others is an undefined reference to
/// dtrain::torch::detail::link_check::library_built_with_engines_<set>.

#include <dtrain/dtrain.hpp>  // dtrain/runtime/compiled.hpp's policy lists, the link check's symbol name
#include <dtrain/torch/module_ddp.hpp>

// NCCL's policies need LibTorch's CUDA headers (the current CUDA stream).
#if DTRAIN_TORCH_CUDA()
#define DTRAIN_TORCH_DETAIL_FOR_EACH_NCCL_POLICY(X) DTRAIN_FOR_EACH_NCCL_POLICY(X)
#else
#define DTRAIN_TORCH_DETAIL_FOR_EACH_NCCL_POLICY(X)
#endif
/// Every standard policy whose engine is compiled in, and that LibTorch can serve.
#define DTRAIN_TORCH_FOR_EACH_COMPILED_POLICY(X) \
  DTRAIN_FOR_EACH_GLOO_POLICY(X)                 \
  DTRAIN_FOR_EACH_MPI_POLICY(X) DTRAIN_TORCH_DETAIL_FOR_EACH_NCCL_POLICY(X)

#define DTRAIN_TORCH_DETAIL_DECLARE_COMPILED(...) \
  extern template class ::dtrain::torch::module_ddp<__VA_ARGS__>;
#define DTRAIN_TORCH_DETAIL_DEFINE_COMPILED(...) \
  template class ::dtrain::torch::module_ddp<__VA_ARGS__>;

namespace dtrain::torch::detail {
/// Whether dtrain::torch's part holds module_ddp<P> (with separate compilation,
/// a file that links the part does not read module_ddp's definitions).
template <class P>
inline constexpr bool in_torch_part = false;
#define DTRAIN_TORCH_DETAIL_MARK_COMPILED(...) \
  template <>                                  \
  inline constexpr bool in_torch_part<__VA_ARGS__> = true;
DTRAIN_TORCH_FOR_EACH_COMPILED_POLICY(DTRAIN_TORCH_DETAIL_MARK_COMPILED)
#undef DTRAIN_TORCH_DETAIL_MARK_COMPILED
}  // namespace dtrain::torch::detail

namespace dtrain::torch::detail::link_check {
/// Defined by the torch part built with this TU's engines, and only there.
extern const int DTRAIN_DETAIL_LINK_SYMBOL;
}  // namespace dtrain::torch::detail::link_check

/// Instantiates, in the one TU that writes it (at namespace scope, after the
/// `#include`, with DTRAIN_TORCH_COMPILED_DEFINITIONS=1 defined before it), what the
/// other TUs declared `extern template`.
#define DTRAIN_TORCH_INSTANTIATE_COMPILED_POLICIES()                                              \
  static_assert(                                                                                  \
      DTRAIN_TORCH_BODIES(),                                                                      \
      "DTRAIN_TORCH_INSTANTIATE_COMPILED_POLICIES(): define DTRAIN_TORCH_COMPILED_DEFINITIONS=1 " \
      "before including dtrain/torch.hpp in this file, or it instantiates "                       \
      "declarations only");                                                                       \
  DTRAIN_TORCH_FOR_EACH_COMPILED_POLICY(DTRAIN_TORCH_DETAIL_DEFINE_COMPILED)                      \
  namespace dtrain::torch::detail::link_check {                                                   \
  extern const int DTRAIN_DETAIL_LINK_SYMBOL = 1;                                                 \
  }

#if DTRAIN_TORCH_HAS_SEPARATE_COMPILATION()
DTRAIN_TORCH_FOR_EACH_COMPILED_POLICY(DTRAIN_TORCH_DETAIL_DECLARE_COMPILED)
#if defined(__GNUC__)
// An undefined reference to dtrain::torch::detail::link_check::library_built_with_engines_<set>
// from this line: no torch part built for this TU's engines is linked (with CMake, link
// dtrain::torch).
namespace dtrain::torch::detail::link_check {
namespace {
[[gnu::used]] const int* const this_unit_needs_its_torch_part = &DTRAIN_DETAIL_LINK_SYMBOL;
}
}  // namespace dtrain::torch::detail::link_check
#endif
#endif
