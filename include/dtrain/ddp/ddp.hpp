#pragma once
/// @file
/// DistributedDataParallel<Model, Policy>: averages a model's gradients over
/// the ranks while the backward pass is still running. A thin layer over
/// basic_ddp<Policy> (ddp/basic_ddp.hpp), which does the work and does not
/// depend on the model's type: this one asks the model for its parameters()
/// (and buffers()) and keeps it for module().

#include <dtrain/ddp/basic_ddp.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>

#include <concepts>
#include <utility>
#include <vector>

namespace dtrain {

/// Data-parallel training of `Model` (anything with `parameters()`, see
/// trainable_model) over the communicator of `Policy`.
///
/// Per step: mark each parameter ready (mark_ready) as soon as its gradient
/// is final, or all of them after the backward pass (mark_all_ready), then
/// synchronize(); gradients then hold the mean over ranks. Everything but
/// the constructors and module() is basic_ddp<Policy>'s.
template <class Model, class Policy>
class DistributedDataParallel : public basic_ddp<Policy> {
  static_assert(trainable_model<Model>,
                "DistributedDataParallel<Model, Policy>: Model needs parameters() "
                "returning a range of dtrain::parameter (see dtrain::param)");
  using base = basic_ddp<Policy>;

 public:
  using typename base::communicator_type;

  /// Collective over ctx's communicator (ctx: the dtrain::context<Policy>
  /// that dtrain::run hands over); metadata goes over ctx's control plane
  /// where the communicator cannot carry host data (NCCL). The policy's
  /// topology groups the ranks by ctx.world()'s nodes.
  template <ddp_context<Policy> Context>
  DistributedDataParallel(Context& ctx, Model& model, ddp_options options = {})
      : base(ctx, parameters_of(model), buffers_of(model), std::move(options)), model_(model) {}

  /// Collective over `comm`, which carries the metadata too (MPI, Gloo: a
  /// communicator that reaches host memory). A device-only backend (NCCL)
  /// needs the constructor with a control plane (a static_assert says so).
  template <std::same_as<Model> M>
  DistributedDataParallel(communicator_type& comm, M& model, ddp_options options = {})
      : base(comm, parameters_of(model), buffers_of(model), std::move(options)), model_(model) {}

  /// Collective over `comm`, metadata over `control` (see basic_ddp).
  DistributedDataParallel(communicator_type& comm, control_plane control, Model& model,
                          ddp_options options = {})
      : base(comm, control, parameters_of(model), buffers_of(model), std::move(options)),
        model_(model) {}

  [[nodiscard]] Model& module() noexcept { return model_; }

 private:
  static std::vector<parameter> parameters_of(Model& model) {
    std::vector<parameter> out;
    if constexpr (trainable_model<Model>) {
      for (auto&& p : model.parameters()) out.push_back(static_cast<parameter>(p));
    }
    return out;
  }
  static std::vector<parameter> buffers_of([[maybe_unused]] Model& model) {
    std::vector<parameter> out;
    if constexpr (model_with_buffers<Model>) {
      for (auto&& b : model.buffers()) out.push_back(static_cast<parameter>(b));
    }
    return out;
  }

  Model& model_;
};

}  // namespace dtrain
