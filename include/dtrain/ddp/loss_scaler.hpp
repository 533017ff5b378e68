#pragma once
/// @file
/// dtrain::loss_scaler: dynamic loss scaling for float16 training, as
/// PyTorch's `torch.amp.GradScaler`, across ranks. float16's range ends at
/// 65504 and its normal numbers at 6.1e-5: small gradients underflow to zero
/// unless the loss is multiplied by a large scale before the backward pass.
/// The scaler picks that scale: it halves it (backoff) at a step whose
/// averaged gradients hold an inf or a NaN, which every rank then skips
/// together, and doubles it (growth) after `growth_interval` steps without
/// one.
///
///   dtrain::loss_scaler scaler;             // 65536, x2 every 2000 clean steps
///   ckpt.add(scaler);                       // its state in the checkpoint
///   ... forward; loss * scaler.scale(); backward; ddp.synchronize();
///   if (scaler.unscale(ddp))                // every rank the same answer
///     ddp.optimizer_step(update);           // on the unscaled gradients
///   else
///     ddp.gather_parameters();              // skipped: the values stay as they were
///   scaler.update();                        // backoff or growth
///
/// unscale() reads the averaged gradients of this rank's pieces
/// (ddp.shard(): the whole model without sharding, the rank's shard at ZeRO
/// stages 1-3) through ddp.gradient_norm() (one collective with sharding),
/// agrees through ddp.any_rank() (one collective), and divides the gradients
/// by the scale in place (host memory; float32, float64, bfloat16, float16).

#include <dtrain/config.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/error.hpp>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace dtrain {

/// Options of dtrain::loss_scaler (PyTorch's GradScaler defaults).
/// Aggregate: `{.init_scale = 1024, .growth_interval = 100}`.
struct loss_scaler_options {
  /// The first scale: finite and at least 2^-24 (lowest_scale).
  double init_scale = 65536.0;
  /// The scale is multiplied by it after growth_interval steps without an
  /// inf or a NaN: more than 1.
  double growth_factor = 2.0;
  /// The scale is multiplied by it at a step with an inf or a NaN: between 0
  /// and 1.
  double backoff_factor = 0.5;
  /// Steps without an inf or a NaN before the scale grows: at least 1.
  std::uint64_t growth_interval = 2000;
  /// false: scale() is 1, unscale() changes nothing and skips nothing (no
  /// collective), update() does nothing; the same program runs in float32.
  bool enabled = true;
};

/// Dynamic loss scaling across the ranks of one DistributedDataParallel: see
/// the file's comment for the step it is used in.
class loss_scaler {
 public:
  /// The scale falls no lower than this: below it, a step with an inf or a
  /// NaN is not an overflow any scale can cure (a NaN in the model or the
  /// loss), and update() throws instead of scaling the loss to nothing.
  static constexpr double lowest_scale = 0x1p-24;

  /// Throws config_error naming the option and its value when one is out of
  /// its range.
  explicit loss_scaler(loss_scaler_options options = {});

  /// What to multiply the loss by before the backward pass (1 when disabled).
  [[nodiscard]] double scale() const noexcept { return options_.enabled ? scale_ : 1.0; }
  /// Once per step, after ddp.synchronize(), before the optimizer's step:
  /// whether the averaged gradients are finite on every rank (the same
  /// answer on every rank), and if they are, divides them by the scale, in
  /// place, in this rank's pieces (ddp.shard()). If not, they are left as
  /// they are and the step is to be skipped (ddp.gather_parameters() keeps
  /// the values). Collective. Throws config_error for gradients in device
  /// memory (there: check(), and 1 / scale() in the optimizer's update) or
  /// of an integer type, naming the parameter and the rank.
  template <class DDP>
  [[nodiscard]] bool unscale(DDP& ddp) {
    if (!check(ddp)) return false;
    if (options_.enabled) {
      const auto parameters = ddp.parameters();
      for (const shard_piece& piece : ddp.shard())  // all refusals before any division
        divisible(piece.gradients, parameters[piece.parameter].name);
      for (const shard_piece& piece : ddp.shard()) divide(piece.gradients);
    }
    return true;
  }
  /// unscale() without the division: whether the step may be taken, the
  /// gradients left scaled (multiply them by 1 / scale() in the optimizer's
  /// update: the way on a GPU, and one pass over the gradients fewer).
  /// Collective; once per step, instead of unscale().
  template <class DDP>
  [[nodiscard]] bool check(DDP& ddp) {
    rank_ = ddp.rank();
    if (checked_) throw_twice();
    found_inf_ = false;
    if (options_.enabled) {
      const double norm = ddp.gradient_norm();  // what these throw leaves the step unchecked
      found_inf_ = ddp.any_rank(!std::isfinite(norm));
      norm_ = norm / scale_;
    }
    checked_ = true;
    return !found_inf_;
  }
  /// Once per step, after unscale() or check() (and the step, taken or skipped): the
  /// scale backs off after an inf or a NaN, grows after growth_interval
  /// steps without. Throws dtrain::error without unscale() or check() first, and when
  /// the scale would fall below lowest_scale.
  void update();

  /// The L2 norm of the averaged gradients, unscaled, at the last check()
  /// (for clipping: no second collective); inf or NaN at a skipped step, 0
  /// when disabled.
  [[nodiscard]] double gradient_norm() const noexcept { return norm_; }
  /// Whether the last check() found an inf or a NaN (its step is skipped).
  [[nodiscard]] bool found_inf() const noexcept { return found_inf_; }
  /// Steps skipped since the start (a resumed job: since the first start).
  [[nodiscard]] std::uint64_t skipped_steps() const noexcept { return skipped_; }
  /// Steps since the last growth or backoff without an inf or a NaN.
  [[nodiscard]] std::uint64_t growth_tracker() const noexcept { return tracker_; }
  [[nodiscard]] const loss_scaler_options& options() const noexcept { return options_; }

  /// The scaler's state as text (the scale exactly, the growth tracker, the
  /// skipped steps): what checkpoint::add(scaler) saves. Between check() and
  /// update() it is the state this step's update() will leave (a checkpoint
  /// of the step taken before update() resumes as one taken after it).
  [[nodiscard]] std::string state() const;
  /// Restores state(); throws config_error naming what is wrong with `text`
  /// (and nothing changes).
  void load_state(std::string_view text);

 private:
  struct counters {
    double scale;
    std::uint64_t tracker, skipped;
  };
  counters updated(bool& floor) const;
  void divisible(const buffer& gradients, std::string_view name) const;
  void divide(const buffer& gradients) const noexcept;
  [[noreturn]] void throw_twice() const;
  std::string who() const;

  loss_scaler_options options_;
  double scale_;
  std::uint64_t tracker_ = 0;
  std::uint64_t skipped_ = 0;
  double norm_ = 0;
  bool found_inf_ = false;
  bool checked_ = false;  // unscale() or check() called, update() not yet
  int rank_ = -1;         // known from the first check()
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/loss_scaler-inl.hpp>
#endif
