#pragma once
/// @file
/// dtrain::torch::module_ddp<Policy>: what dtrain::torch::DistributedDataParallel
/// adds to DDP's one core (dtrain::basic_ddp) for a torch::nn::Module, whatever
/// the module's type: the tensors, autograd's hooks and the final callback.
/// Everything about the step (which parameter is ready, whether the step is
/// open, no_sync(), which parameters some rank used) is the core's, asked here.
///
/// - The parameters that require a gradient come from named_parameters(); the
///   frozen ones and named_buffers() are state to agree on; names, shapes,
///   types and devices are checked across ranks, and rank 0's values broadcast.
/// - Each parameter's gradient accumulator gets a post-hook (as c10d's Reducer
///   does) that marks it ready, so buckets are reduced during backward(); when
///   the core says the last one is marked, an autograd final callback completes
///   the step, so that backward() returns with averaged gradients, as in PyTorch.
/// - Each parameter's .grad() is a tensor over the core's bucket storage (no
///   copy in or out); a gradient the optimizer dropped (zero_grad with
///   set_to_none) or the user replaced is copied into the bucket when autograd
///   next writes it.
/// - With find_unused_parameters, the walk of the autograd graph from the
///   outputs (prepare_for_backward) tells the core which parameters the
///   backward pass will not reach; after the step a parameter no rank used
///   keeps the .grad() it had (undefined when it had none), as in PyTorch.
/// - ZeRO stage 3 (ddp_options::sharding = parameters): the units are a
///   torch::nn::Sequential's children (else the whole module); each
///   parameter's storage points into the core's whole bucket while a unit's
///   gather holds it (detail::value_slot), and holds no data between. The
///   wrapper's forward enters and leaves each unit; a hook on a unit's
///   output gathers it again for its backward, given back once autograd has
///   written the unit's last gradient.
///
/// Its members are defined out of the class and not inline, so that a compiled
/// part (src/torch.cpp, DTRAIN_TORCH_SEPARATE_COMPILATION) holds them once;
/// there, a file that links the part reads only the declarations (and build(),
/// for a context other than dtrain::context), not LibTorch's autograd internals.

#include <dtrain/dtrain.hpp>
#include <dtrain/torch/tensor.hpp>

#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>
// CUDA tensors: the current stream comes from LibTorch's CUDA headers, which
// a CPU-only LibTorch lacks or ships incomplete (Debian's libtorch-dev).
#if DTRAIN_HAS_CUDA() && __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define DTRAIN_TORCH_CUDA() 1
#else
#define DTRAIN_TORCH_CUDA() 0
#endif

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

/// DTRAIN_TORCH_SEPARATE_COMPILATION=1 (CMake's dtrain::torch defines it):
/// module_ddp's members are compiled once, in dtrain::torch's part
/// (torch/compiled.hpp, src/torch.cpp); a file that only links them does not
/// even read their definitions (torch/module_ddp-inl.hpp). The one file that
/// holds the part defines DTRAIN_TORCH_COMPILED_DEFINITIONS=1 before including
/// dtrain/torch.hpp (as src/torch.cpp does), and reads them: the convention of
/// dtrain's own compiled part (DTRAIN_COMPILED_DEFINITIONS, DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp), with switches of its own, since this part is compiled
/// against the program's LibTorch.
#if defined(DTRAIN_TORCH_SEPARATE_COMPILATION) && (DTRAIN_TORCH_SEPARATE_COMPILATION + 0)
#define DTRAIN_TORCH_HAS_SEPARATE_COMPILATION() 1
#else
#define DTRAIN_TORCH_HAS_SEPARATE_COMPILATION() 0
#endif
#if !DTRAIN_TORCH_HAS_SEPARATE_COMPILATION() || \
    (defined(DTRAIN_TORCH_COMPILED_DEFINITIONS) && (DTRAIN_TORCH_COMPILED_DEFINITIONS + 0))
#define DTRAIN_TORCH_BODIES() 1
#else
#define DTRAIN_TORCH_BODIES() 0
#endif

namespace dtrain::torch {

/// What dtrain::torch::DistributedDataParallel adds to ddp_options.
struct module_options {
  /// PyTorch DDP's broadcast_buffers: every forward() through the wrapper
  /// (with gradients enabled) first copies rank 0's named_buffers() (batch-norm
  /// running statistics) to every rank. Construction copies them, and the
  /// frozen parameters, anyway (ddp_options::broadcast_parameters).
  bool broadcast_buffers = true;
  /// ZeRO stage 3 (ddp_options::sharding = parameters), FSDP's
  /// reshard_after_forward: true, a unit's whole values are given back as
  /// soon as its forward returns and gathered again when its backward
  /// begins (the least memory); false, they stay whole from its forward to
  /// the end of its backward (one allgather fewer per unit and step). A
  /// module that is one unit (not a torch::nn::Sequential) keeps them
  /// either way, as FSDP's root does.
  bool reshard_after_forward = true;
};

namespace detail {
/// A ddp_context other than dtrain::context<Policy>, whose module_ddp
/// constructor is compiled once (dtrain::torch's part).
template <class C, class Policy>
concept other_ddp_context = ddp_context<C, Policy> && !std::same_as<C, dtrain::context<Policy>>;
}  // namespace detail

/// DistributedDataParallel's part that does not depend on the module's type.
/// Not movable: autograd's hooks point at it.
template <class Policy>
class module_ddp {
 public:
  using core_type = dtrain::basic_ddp<Policy>;
  using memory_space = typename Policy::memory_space;
  using stream_type = typename memory_space::stream_type;

  /// Collective over ctx's communicator: checks that every rank holds the
  /// same module (config_error naming the first parameter that differs),
  /// copies rank 0's parameters and buffers to every rank, lays the
  /// gradients out in buckets and hooks every parameter's gradient accumulator.
  /// (dtrain::context's is compiled once, with the rest, in dtrain::torch's part.)
  module_ddp(dtrain::context<Policy>& ctx, std::shared_ptr<::torch::nn::Module> module,
             ddp_options options, module_options extra);
  /// The same over another ddp_context.
  template <detail::other_ddp_context<Policy> Context>
  module_ddp(Context& ctx, std::shared_ptr<::torch::nn::Module> module, ddp_options options,
             module_options extra)
      : module_(std::move(module)), extra_(extra), rank_(ctx.communicator().rank()) {
    build(ctx, std::move(options));
  }

  module_ddp(const module_ddp&) = delete;
  module_ddp& operator=(const module_ddp&) = delete;

  /// Removes the hooks; then the core gives the gradients back (a .grad()
  /// the module had is restored with the current values, one it lacked
  /// becomes a tensor of its own).
  ~module_ddp();

  /// Before the module's forward() through the wrapper: refuses to begin a
  /// step while the last one is incomplete, orders the step after the current
  /// CUDA stream, broadcasts the buffers (module_options::broadcast_buffers).
  void before_forward();
  /// Whether forward() should walk the graph of its outputs (find_unused_parameters,
  /// outside no_sync(), with gradients enabled).
  [[nodiscard]] bool walks_graph() const;
  /// The graph walk: every parameter the graph behind `outputs` does not
  /// reach is, for the core, unused in the coming backward().
  void prepare_for_backward(const std::vector<::torch::Tensor>& outputs);
  /// Completes a step that backward() could not (see DistributedDataParallel::synchronize).
  void synchronize();
  /// The core's no_sync(), refused while a step is incomplete.
  [[nodiscard]] typename core_type::no_sync_guard no_sync();
  /// Zeroes every gradient in place (the bucket storage).
  void zero_grad();

  [[nodiscard]] core_type& core() noexcept { return *core_; }
  [[nodiscard]] const core_type& core() const noexcept { return *core_; }

  /// For detail::ready_hook: runs on an autograd thread (the caller's for CPU
  /// tensors, the device's own for CUDA) once autograd wrote parameter i's gradient.
  void gradient_written(std::size_t i);

  /// On CUDA streams: the core's compute stream becomes the caller's current
  /// stream (c10's), which its next work (the optimizer step's allgathers
  /// included) is ordered after, as before each forward. Between steps only.
  void follow_current_stream() {
    if constexpr (memory_space::on_stream) core_->set_stream(current_stream());
  }

  /// ZeRO stage 3 (ddp_options::sharding = parameters): the module's units,
  /// whose values DDP holds as this rank's shard between uses. A
  /// torch::nn::Sequential's children are one unit each, run one at a time
  /// by DistributedDataParallel::forward; any other module is one unit.
  [[nodiscard]] bool shards_values() const noexcept { return !units_.empty(); }
  /// Before unit u's forward: collective, its values gathered (their
  /// tensors' storage points at them) until leave_unit().
  void enter_unit(std::size_t u);
  /// After unit u's forward, whose tensors are `outputs`: where a backward
  /// will follow (gradients enabled, an output that requires one), a hook on
  /// each such output gathers the unit again when autograd reaches it, held
  /// until the unit's last gradient is written; its forward's gather is
  /// released now (reshard_after_forward) or with it.
  void leave_unit(std::size_t u, const std::vector<::torch::Tensor>& outputs);
  /// Gives back every unit's gathers (before a step ends, before a forward).
  void release_units() noexcept;

 private:
  /// What the module holds, per trained parameter, indexed like core().parameters().
  struct slot {
    detail::gradient_slot gradient;  // the parameter's gradient_slot points here
    // shared_ptr<Node> in LibTorch 1.13, an intrusive_ptr in later versions; kept: the
    // parameter holds its accumulator weakly, and with it the hook.
    decltype(::torch::autograd::impl::grad_accumulator(
        std::declval<const ::torch::Tensor&>())) accumulator;
    std::uintptr_t hook_key = 0;
    detail::value_slot values;  // stage 3: the parameter's value_slot points here
  };
  /// Stage 3: a part of the module gathered as one, with the gathers that
  /// hold it now (its forward's, its backward's).
  struct unit {
    std::vector<std::size_t> members;  // indices into core().parameters()
    std::vector<typename core_type::gathered_parameters> held;
    bool in_backward = false;  // a backward gather holds it
    std::size_t written = 0;   // of members, gradients written since that gather
  };

  template <class Context>
  void build(Context& ctx, ddp_options options);
  static stream_type current_stream();
  std::string collect(const ddp_options& options, std::vector<parameter>& params,
                      std::vector<parameter>& buffers);
  void attach(stream_type stream);
  [[nodiscard]] const std::string& name_of(std::size_t i) const;
  void check_slots(const char* when);
  void expose(std::size_t i, bool written = false);
  void complete_step();
  void check_step_closed(const std::string& what) const;
  [[nodiscard]] std::string no_gradient_message(const std::string& what) const;
  void broadcast_buffers();
  void sum_in_place(const buffer& b);
  void find_units();
  void unit_backward(std::size_t u);

  // Declared in this order: the slots outlive core_, whose destructor gives
  // the gradients back through them.
  std::shared_ptr<::torch::nn::Module> module_;
  module_options extra_;
  int rank_;
  std::vector<slot> slots_;  // never resized after construction: rebind points into it
  std::vector<::torch::Tensor> buffer_tensors_;
  std::vector<unit> units_;                         // stage 3 only
  std::vector<std::vector<std::size_t>> units_of_;  // stage 3: per parameter, its units
  std::optional<core_type> core_;
};

// ---------------------------------------------------------------------------
// Out of class and not inline: see the file comment. build() is read by every
// file: a context other than dtrain::context<Policy> is compiled where it is used.

/// The constructors' work, once the members above are set.
template <class Policy>
template <class Context>
void module_ddp<Policy>::build(Context& ctx, ddp_options options) {
  std::vector<parameter> params;
  std::vector<parameter> buffers;
  std::string problem = collect(options, params, buffers);
  // A module this rank cannot take stops every rank, each with a message (not only this one,
  // leaving the others to find it gone), over the control plane the core agrees on next.
  control_plane control = ctx.control_plane();
  agree_or_throw<config_error>(control, "wrap its module in dtrain::torch::DistributedDataParallel",
                               problem);
  const stream_type stream = current_stream();
  // The first broadcast goes after what the current stream does (PyTorch orders it so too):
  // the parameters may have been initialised, loaded or copied on it.
  if constexpr (core_type::memory_space::on_stream) options.stream = stream;
  // The core's report names parameters nobody marked, against a forgotten
  // mark_ready; autograd marks here, and PyTorch reports nothing either.
  options.report_unused_parameters = false;
  core_.emplace(ctx, std::move(params), std::move(buffers), std::move(options));
  attach(stream);
}

}  // namespace dtrain::torch

#if DTRAIN_TORCH_BODIES()
#include <dtrain/torch/module_ddp-inl.hpp>
#endif
